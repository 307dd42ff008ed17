"""The tree-attention kernel in the GPU style (Pallas' Triton backend, what JAX 0.10 lowers on
NVIDIA GPUs; Mosaic GPU is the path from JAX 0.11 on — not written yet).

Grid (B, Hkv), both parallel: each program holds the T·G query rows of one kv head and walks the
row's committed cache in blocks of `block_k` slots with a `fori_loop` whose trip count is
ceil(length / block_k), so blocks past the valid length are never loaded; then it folds in the
block's own keys (the tree) under the ancestor bitmask and writes the normalised output.

Triton wants power-of-two tensor shapes: the wrapper pads the query rows (≥ 16, for `tl.dot`),
the tree size and the bitmask words to powers of two (padded rows see nothing and are dropped;
padded tree keys are invisible); cache loads are masked past S, so S is arbitrary.

`interpret=True` runs the same kernel under Pallas' interpreter (how the tests exercise it on
CPU). The tests also lower it for CUDA through `jax.export` (Pallas' Triton lowering rules, e.g.
power-of-two shapes, are checked there); compiling the Triton IR to PTX and running it needs a
GPU, which no session of this project has had.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .tree_attention import NEG, block_visibility_from_words, finish, from_rows, num_words, online_update, to_rows


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, bits_ref, qpos_ref, kpos_ref, o_ref,
            *, bk: int, s: int, tp: int, wp: int, scale: float, window):
    length = len_ref[...]
    q = q_ref[...]
    rp, d = q.shape
    qpos = qpos_ref[...][:, None]  # Rp 1

    def body(i, carry):
        m, l, acc = carry
        start = i * bk
        slot = start + jnp.arange(bk, dtype=jnp.int32)
        in_cache = (slot < s)[:, None]
        k = plgpu.load(k_ref.at[pl.ds(start, bk), :], mask=in_cache, other=0.0)
        v = plgpu.load(v_ref.at[pl.ds(start, bk), :], mask=in_cache, other=0.0)
        v = jnp.where((slot < length)[:, None], v, 0)
        vis = (slot < length)[None, :]
        if window is not None:
            vis = vis & ((qpos - slot[None, :]) < window)
        vis = jnp.broadcast_to(vis, (rp, bk))
        return online_update(q, k, v, vis, m, l, acc, scale)

    carry = (jnp.full((rp, 1), NEG, jnp.float32), jnp.zeros((rp, 1), jnp.float32), jnp.zeros((rp, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(length, bk), body, carry)

    cols = jnp.arange(tp, dtype=jnp.int32)[None, :]
    words = [bits_ref[:, w][:, None] for w in range(wp)]
    vis = block_visibility_from_words(words, cols, tp)
    if window is not None:
        vis = vis & ((qpos - kpos_ref[...][None, :]) < window)
    m, l, acc = online_update(q, kn_ref[...], vn_ref[...], vis, m, l, acc, scale)
    o_ref[...] = finish(l, acc, o_ref.dtype)


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(n - 1, 0).bit_length())


@functools.partial(jax.jit, static_argnames=("window", "block_k", "interpret", "num_warps", "num_stages"))
def tree_attention_gpu(q_bthd, k_cache_bshd, v_cache_bshd, length_b, k_new_bthd, v_new_bthd, bits_btw, q_pos_bt,
                       *, window=None, block_k: int = 64, interpret: bool = False, num_warps: int = 4,
                       num_stages: int = 2):
    b, t, h, d = q_bthd.shape
    s, kvh = k_cache_bshd.shape[1], k_cache_bshd.shape[2]
    g = h // kvh
    r = t * g
    rp, tp, wp = _pow2(r, 16), _pow2(t, 16), _pow2(num_words(t))
    bk = _pow2(block_k, 16)
    q_bkrd, bits_brw, qpos_br = to_rows(q_bthd, bits_btw, q_pos_bt, g)
    q_bkrd = jnp.pad(q_bkrd, ((0, 0), (0, 0), (0, rp - r), (0, 0)))
    bits_brw = jnp.pad(bits_brw, ((0, 0), (0, rp - r), (0, wp - bits_brw.shape[2])))  # padded rows see nothing
    qpos_br = jnp.pad(qpos_br, ((0, 0), (0, rp - r)))
    k_new = jnp.pad(k_new_bthd, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    v_new = jnp.pad(v_new_bthd, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    kpos = jnp.pad(q_pos_bt, ((0, 0), (0, tp - t)))
    kernel = functools.partial(_kernel, bk=bk, s=s, tp=tp, wp=wp, scale=1.0 / math.sqrt(d), window=window)
    out = pl.pallas_call(
        kernel,
        grid=(b, kvh),
        in_specs=[
            pl.BlockSpec((None,), lambda bi, hi: (bi,)),  # committed length
            pl.BlockSpec((None, None, rp, d), lambda bi, hi: (bi, hi, 0, 0)),  # query rows
            pl.BlockSpec((None, s, None, d), lambda bi, hi: (bi, 0, hi, 0)),  # cache k (walked in-kernel)
            pl.BlockSpec((None, s, None, d), lambda bi, hi: (bi, 0, hi, 0)),  # cache v
            pl.BlockSpec((None, tp, None, d), lambda bi, hi: (bi, 0, hi, 0)),  # block k
            pl.BlockSpec((None, tp, None, d), lambda bi, hi: (bi, 0, hi, 0)),  # block v
            pl.BlockSpec((None, rp, wp), lambda bi, hi: (bi, 0, 0)),  # bits per row
            pl.BlockSpec((None, rp), lambda bi, hi: (bi, 0)),  # query positions per row
            pl.BlockSpec((None, tp), lambda bi, hi: (bi, 0)),  # block key positions
        ],
        out_specs=pl.BlockSpec((None, None, rp, d), lambda bi, hi: (bi, hi, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, rp, d), q_bthd.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(length_b, q_bkrd, k_cache_bshd, v_cache_bshd, k_new, v_new, bits_brw, qpos_br, kpos)
    return from_rows(out[:, :, :r], t)
