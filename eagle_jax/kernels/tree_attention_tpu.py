"""The tree-attention kernel in the TPU style: a grid over (row, kv head, KV block).

Grid (B, Hkv, ceil(S / block_k)); the KV-block axis is the sequential ("arbitrary") reduction
axis, the other two are parallel. Each program holds the T·G query rows of one kv head (row
r = t·G + g) and float32 online-softmax state (m, l, acc) in VMEM scratch:

- KV block i (cache slots [i·bk, (i+1)·bk)) is folded in only when it starts before the row's
  committed length (`pl.when`); the cache's index map clamps i to the last valid block, so blocks
  past the length are neither computed nor copied (a repeated block index is not re-fetched);
- at the last grid step the block's own keys (the tree) are folded in under the ancestor bitmask,
  and the output is normalised and written.

The lengths are scalar-prefetched (SMEM) so the index maps can read them. The cache is viewed
as [B, S, Hkv·D] (a free reshape) and blocked [bk, D] per kv head, so on a real TPU head_dim must
be a multiple of 128 (or Hkv = 1) and bk a multiple of 8; interpret mode has no such limits.

Lowering: `interpret=False` compiles with Mosaic (TPU only); `interpret=True` runs Pallas'
generic interpreter (what CPU uses); `interpret="tpu"` runs the TPU interpret mode
(`pltpu.InterpretParams()`), which also checks TPU semantics such as DMA and scratch handling.
The tests also lower it for TPU through `jax.export` (Pallas' Mosaic lowering rules run there);
what no test here reaches is Mosaic's own compilation (layout and tiling checks) and a run — that
needs a TPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .tree_attention import NEG, block_visibility_from_words, finish, from_rows, num_words, online_update, to_rows


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, bits_ref, qpos_ref, kpos_ref, o_ref, m_sc, l_sc, acc_sc,
            *, bk: int, n_blocks: int, t: int, scale: float, window):
    b, i = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(i * bk < length)
    def _committed():
        slot_1k = i * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        vis = slot_1k < length
        if window is not None:
            vis = vis & ((qpos_ref[...] - slot_1k) < window)
        slot_k1 = i * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        v = jnp.where(slot_k1 < length, v_ref[...], 0)  # rows past the length may hold anything
        m, l, acc = online_update(q_ref[...], k_ref[...], v, vis, m_sc[...], l_sc[...], acc_sc[...], scale)
        m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

    @pl.when(i == n_blocks - 1)
    def _tree_and_write():
        cols = jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)
        words = [bits_ref[:, w:w + 1] for w in range(num_words(t))]
        vis = block_visibility_from_words(words, cols, t)
        if window is not None:
            vis = vis & ((qpos_ref[...] - kpos_ref[...]) < window)
        m, l, acc = online_update(q_ref[...], kn_ref[...], vn_ref[...], vis, m_sc[...], l_sc[...], acc_sc[...], scale)
        o_ref[...] = finish(l, acc, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "block_k", "interpret"))
def tree_attention_tpu(q_bthd, k_cache_bshd, v_cache_bshd, length_b, k_new_bthd, v_new_bthd, bits_btw, q_pos_bt,
                       *, window=None, block_k: int = 512, interpret=False):
    b, t, h, d = q_bthd.shape
    s, kvh = k_cache_bshd.shape[1], k_cache_bshd.shape[2]
    g = h // kvh
    r = t * g
    bk = _block(s, block_k)
    if interpret is False and (d % 128 and kvh > 1 or bk % 8 and bk != s):
        raise ValueError(f"the Mosaic TPU kernel blocks the cache as [{bk}, head_dim={d}] per kv head: it needs "
                         f"head_dim % 128 == 0 (or one kv head) and a block size that is a multiple of 8; use "
                         f"attention_impl='reference' for this model")
    n_blocks = pl.cdiv(s, bk)
    q_bkrd, bits_brw, qpos_br = to_rows(q_bthd, bits_btw, q_pos_bt, g)
    k_cache = k_cache_bshd.reshape(b, s, kvh * d)
    v_cache = v_cache_bshd.reshape(b, s, kvh * d)
    k_new = k_new_bthd.reshape(b, t, kvh * d)
    v_new = v_new_bthd.reshape(b, t, kvh * d)

    def kv_index(bi, hi, i, lens):  # past the row's length: stay on its last valid block (no new copy)
        last = jnp.maximum(pl.cdiv(lens[bi], bk) - 1, 0)
        return bi, jnp.minimum(i, last), hi

    w = num_words(t)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, kvh, n_blocks),
        in_specs=[
            pl.BlockSpec((None, None, r, d), lambda bi, hi, i, lens: (bi, hi, 0, 0)),  # q rows
            pl.BlockSpec((None, bk, d), kv_index),  # cache k
            pl.BlockSpec((None, bk, d), kv_index),  # cache v
            pl.BlockSpec((None, t, d), lambda bi, hi, i, lens: (bi, 0, hi)),  # block k
            pl.BlockSpec((None, t, d), lambda bi, hi, i, lens: (bi, 0, hi)),  # block v
            pl.BlockSpec((None, r, w), lambda bi, hi, i, lens: (bi, 0, 0)),  # bits per row
            pl.BlockSpec((None, r, 1), lambda bi, hi, i, lens: (bi, 0, 0)),  # query positions per row
            pl.BlockSpec((None, 1, t), lambda bi, hi, i, lens: (bi, 0, 0)),  # block key positions
        ],
        out_specs=pl.BlockSpec((None, None, r, d), lambda bi, hi, i, lens: (bi, hi, 0, 0)),
        scratch_shapes=[pltpu.VMEM((r, 1), jnp.float32), pltpu.VMEM((r, 1), jnp.float32),
                        pltpu.VMEM((r, d), jnp.float32)],
    )
    kernel = functools.partial(_kernel, bk=bk, n_blocks=n_blocks, t=t, scale=1.0 / math.sqrt(d), window=window)
    interp = pltpu.InterpretParams() if interpret == "tpu" else bool(interpret)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kvh, r, d), q_bthd.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interp,
    )(length_b, q_bkrd, k_cache, v_cache, k_new, v_new, bits_brw, qpos_br[..., None], q_pos_bt[:, None, :])
    return from_rows(out, t)


def _block(s: int, block_k: int) -> int:
    """KV block size: the whole cache when it fits, else a multiple of 8 that divides S if one is
    close to block_k (no partial last block), else block_k (the last block is partial and masked)."""
    if s <= block_k:
        return s
    for bk in range(block_k - block_k % 8, max(block_k // 2, 8) - 1, -8):
        if s % bk == 0:
            return bk
    return block_k
