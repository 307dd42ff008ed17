"""Tree attention for verification: one signature, a jnp reference and Pallas kernels.

The T queries of a block (the padded draft tree during verification, a single token in plain
decoding, a chunk of the prompt in prefill) attend to

- the committed prefix: cache slots `s < length[b]`, all visible; and
- the block itself: block key j is visible to query t iff bit j of `bits_btw[b, t]` is set
  (ancestor-or-self in a tree, lower triangle for a causal chunk),

optionally restricted to a sliding window by position (committed slot s holds position s; the
block's token t sits at `q_pos_bt[b, t]`; a key is visible iff `q_pos - k_pos < window`).

The block mask is passed compactly as a per-query ancestor bitmask: `bits_btw` int32 [B, T, W]
with W = ceil(T / 32), bit (j % 32) of word j // 32 standing for block key j (`pack_bits` builds it
from a boolean [B, T, T] mask). No [T, S] mask is ever built by the kernels.

    out_bthd = tree_attention(q_bthd, k_cache_bshd, v_cache_bshd, length_b, k_new_bthd, v_new_bthd,
                              bits_btw, q_pos_bt, window=None, impl="pallas")

Shapes: q [B, T, H, D]; cache k/v [B, S, Hkv, D] (one layer); new k/v [B, T, Hkv, D] (the block's
keys/values, the same ones the caller scatters into the cache at slots `length + t`); H is a
multiple of Hkv (GQA: query head h reads kv head h // (H // Hkv)). Scores, softmax and the
accumulator are float32; the output has q's dtype. A query that sees no key gets zeros (never NaN).

Forward only: the kernels define no VJP, so gradients are not available through `impl="pallas"`
(training uses the reference path, which is differentiable).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..models.layers import dense_attention

IMPLS = ("reference", "pallas")
# tpu: the grid kernel through Mosaic; gpu: the loop kernel through Triton; *-interpret: the same
# kernels under Pallas' generic interpreter (any platform); tpu-sim: the grid kernel under Pallas'
# TPU interpret mode (pltpu.InterpretParams: simulates TPU memory spaces, DMAs and semaphores).
BACKENDS = ("tpu", "gpu", "tpu-interpret", "gpu-interpret", "tpu-sim")


class BlockMask(NamedTuple):
    """The compact attention mask of a cached block: what `tree_attention` needs besides q/k/v.
    Passed through the decoder layers in place of a dense [B, T, S] mask when the model's
    `attention_impl` is "pallas"."""

    length_b: jax.Array  # int32 [B] committed slots
    bits_btw: jax.Array  # int32 [B, T, W] block visibility bitmask
    q_pos_bt: jax.Array  # int32 [B, T] positions of the block's tokens


def num_words(t: int) -> int:
    return (t + 31) // 32


def pack_bits(mask_btt: jax.Array) -> jax.Array:
    """bool [B, T, T] block mask → int32 [B, T, ceil(T/32)] bitmask (bit j%32 of word j//32)."""
    b, t, t2 = mask_btt.shape
    w = num_words(t2)
    padded = jnp.pad(mask_btt, ((0, 0), (0, 0), (0, 32 * w - t2))).reshape(b, t, w, 32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
    words = jnp.sum(jnp.where(padded, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)  # distinct bits: sum == or
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def unpack_bits(bits_btw: jax.Array, t: int) -> jax.Array:
    """int32 [B, T, W] → bool [B, T, t] (the inverse of `pack_bits`)."""
    j = jnp.arange(t)
    words = jnp.take(bits_btw, j // 32, axis=-1)  # B T t
    return (jnp.right_shift(words, j % 32) & 1).astype(bool)


def reference_mask(length_b, bits_btw, q_pos_bt, s: int, window: int | None):
    """bool [B, T, S + T]: visibility of the cache slots, then of the block's keys (for the reference)."""
    b, t, _ = bits_btw.shape
    slot = jnp.arange(s)[None, None, :]
    committed = jnp.broadcast_to(slot < length_b[:, None, None], (b, t, s))
    block = unpack_bits(bits_btw, t)
    if window is not None:
        committed &= (q_pos_bt[:, :, None] - slot) < window
        block &= (q_pos_bt[:, :, None] - q_pos_bt[:, None, :]) < window
    return jnp.concatenate([committed, block], axis=-1)


def tree_attention_reference(q_bthd, k_cache_bshd, v_cache_bshd, length_b, k_new_bthd, v_new_bthd, bits_btw,
                             q_pos_bt=None, *, window: int | None = None):
    """The jnp reference: dense attention over [cache ; block] under the expanded mask."""
    _check(q_bthd, k_cache_bshd, k_new_bthd, bits_btw, q_pos_bt, window)
    s = k_cache_bshd.shape[1]
    mask = reference_mask(length_b, bits_btw, q_pos_bt, s, window)
    k = jnp.concatenate([k_cache_bshd, k_new_bthd.astype(k_cache_bshd.dtype)], axis=1)
    v = jnp.concatenate([v_cache_bshd, v_new_bthd.astype(v_cache_bshd.dtype)], axis=1)
    return dense_attention(q_bthd, k, v, mask)


def default_backend() -> str:
    """"tpu" (Mosaic), "gpu" (Triton), elsewhere "gpu-interpret": on CPU the loop kernel under the
    interpreter is the faster of the two (it skips blocks past the length without grid steps)."""
    platform = jax.default_backend()
    return platform if platform in ("tpu", "gpu") else "gpu-interpret"


DEFAULT_BLOCK_K = {"tpu": 512, "gpu": 64, "tpu-interpret": 256, "gpu-interpret": 128, "tpu-sim": 128}


def tree_attention(q_bthd, k_cache_bshd, v_cache_bshd, length_b, k_new_bthd, v_new_bthd, bits_btw, q_pos_bt=None,
                   *, window: int | None = None, impl: str = "pallas", backend: str | None = None,
                   block_k: int | None = None):
    """Tree attention (see the module docstring). impl="reference" is the jnp path; impl="pallas"
    runs the kernel for `backend` (one of BACKENDS; default: the platform's — Mosaic on TPU,
    Triton on GPU, the interpreter elsewhere).
    `block_k` is the number of cache slots per KV block (default per backend)."""
    if impl == "reference":
        return tree_attention_reference(q_bthd, k_cache_bshd, v_cache_bshd, length_b, k_new_bthd, v_new_bthd,
                                        bits_btw, q_pos_bt, window=window)
    if impl != "pallas":
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"tree attention backend must be one of {BACKENDS}, got {backend!r}")
    _check(q_bthd, k_cache_bshd, k_new_bthd, bits_btw, q_pos_bt, window)
    b, t = q_bthd.shape[:2]
    if q_pos_bt is None:
        q_pos_bt = jnp.broadcast_to(length_b[:, None] + jnp.arange(t, dtype=jnp.int32), (b, t))
    bk = block_k or DEFAULT_BLOCK_K[backend]
    args = (q_bthd, k_cache_bshd, v_cache_bshd, length_b.astype(jnp.int32), k_new_bthd.astype(k_cache_bshd.dtype),
            v_new_bthd.astype(v_cache_bshd.dtype), bits_btw, q_pos_bt.astype(jnp.int32))
    if backend in ("gpu", "gpu-interpret"):
        from .tree_attention_gpu import tree_attention_gpu
        return tree_attention_gpu(*args, window=window, block_k=bk, interpret=backend == "gpu-interpret")
    from .tree_attention_tpu import tree_attention_tpu
    interpret = {"tpu": False, "tpu-interpret": True, "tpu-sim": "tpu"}[backend]
    return tree_attention_tpu(*args, window=window, block_k=bk, interpret=interpret)


def _check(q, k_cache, k_new, bits, q_pos, window):
    b, t, h, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"k/v cache must be [B={b}, S, Hkv, D={d}], got {k_cache.shape}")
    if k_new.shape != (b, t, k_cache.shape[2], d):
        raise ValueError(f"new k/v must be [B, T, Hkv, D] = {(b, t, k_cache.shape[2], d)}, got {k_new.shape}")
    if h % k_cache.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k_cache.shape[2]})")
    if bits.shape != (b, t, num_words(t)):
        raise ValueError(f"bits must be int32 [B, T, ceil(T/32)] = {(b, t, num_words(t))}, got {bits.shape}")
    if window is not None and q_pos is None:
        raise ValueError("a sliding window needs the queries' positions (q_pos_bt)")


# --------------------------------------------------------------------------- shared kernel math
NEG = -1e30  # finite "minus infinity": a fully masked block leaves m, l and acc unchanged


def block_visibility_from_words(word_cols, t_cols, n_cols: int):
    """bool [R, n_cols] from W int32 word columns [R, 1]: column j is bit j % 32 of word j // 32.

    `t_cols` is an int32 [1, n_cols] iota of block-key indices. A static loop over words keeps
    every operation elementwise (no gather), which all Pallas backends lower."""
    vis = None
    for w, word in enumerate(word_cols):
        in_word = (t_cols >= 32 * w) & (t_cols < 32 * (w + 1))
        shift = jnp.clip(t_cols - 32 * w, 0, 31)
        bit = (jnp.right_shift(word, shift) & 1) == 1
        part = in_word & bit
        vis = part if vis is None else (vis | part)
    return vis


def online_update(q_rd, k_kd, v_kd, vis_rk, m_r1, l_r1, acc_rd, scale: float):
    """One flash-attention step over a block of keys: returns the new (m, l, acc).

    Scores are float32 (q·k in the inputs' dtype, accumulated in float32, then scaled, as the
    reference does); masked scores never contribute (p is zeroed, not just made small)."""
    s = jax.lax.dot_general(q_rd, k_kd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis_rk, s, NEG)
    m_new = jnp.maximum(m_r1, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(vis_rk, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_r1 - m_new)
    l_new = alpha * l_r1 + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(p.astype(v_kd.dtype), v_kd, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, l_new, alpha * acc_rd + pv


def finish(l_r1, acc_rd, dtype):
    return (acc_rd / jnp.where(l_r1 > 0, l_r1, 1.0)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("groups",))
def to_rows(q_bthd, bits_btw, q_pos_bt, groups: int):
    """[B, T, H, D] queries → [B, Hkv, R = T·G, D] rows (row r = t·G + g), with bits and positions per row."""
    b, t, h, d = q_bthd.shape
    kvh = h // groups
    q = q_bthd.reshape(b, t, kvh, groups, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * groups, d)
    return q, jnp.repeat(bits_btw, groups, axis=1), jnp.repeat(q_pos_bt, groups, axis=1)


def from_rows(out_bkrd, t: int):
    b, kvh, r, d = out_bkrd.shape
    g = r // t
    return out_bkrd.reshape(b, kvh, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, kvh * g, d)
