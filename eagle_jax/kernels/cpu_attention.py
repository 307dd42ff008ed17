"""Few-query attention that reads the stacked KV cache in place (AVX-512 or AVX2 custom call).

`cache_attention(q, k_all, v_all, layer, mask)` is `dense_attention(q, k_all[layer], v_all[layer],
mask)` for decoding steps and tree verifications (any number of queries a row; the decoder sends
blocks of at most `ModelConfig.kernel_rows`, `MAX_QUERIES` by default) on a CPU
with the matmul kernel (`cpu_matmul.available()`; the same library, see `cpu_attention.cc`):
XLA would first copy the layer's keys and values into its dot layout on every step. The decoder
uses it when `ModelConfig.matmul_impl == "cpu_kernel"`; anything else (more queries, another
dtype, no kernel) takes the reference path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import cpu_matmul

MAX_QUERIES = cpu_matmul.MAX_ROWS  # prefill chunks above this go through XLA's dots


def usable(q_bthd, k_all, max_queries: int = MAX_QUERIES) -> bool:
    """Whether `cache_attention` takes these operands (else use the reference attention): float32, at
    most `max_queries` queries a row (`ModelConfig.kernel_rows`), the kernels built."""
    return (q_bthd.shape[1] <= max_queries and q_bthd.dtype == jnp.float32 and k_all.dtype == jnp.float32
            and cpu_matmul.available())


def cache_attention(q_bthd, k_all, v_all, layer, mask_bts):
    """softmax(q k^T / sqrt(D)) v over layer `layer` of the cache [L, B, S, Hkv, D], masked by
    `mask_bts` [B, T, S] (True = visible); a query with no visible key gets zeros. → [B, T, H, D]."""
    b, t, h, d = q_bthd.shape
    if k_all.ndim != 5 or k_all.shape[1] != b or k_all.shape[4] != d or h % k_all.shape[3]:
        raise ValueError(f"cache_attention: q {tuple(q_bthd.shape)} does not fit the cache {tuple(k_all.shape)}")
    if tuple(mask_bts.shape) != (b, t, k_all.shape[2]):
        raise ValueError(f"cache_attention: mask {tuple(mask_bts.shape)}, expected {(b, t, k_all.shape[2])}")
    if not cpu_matmul.available():
        raise RuntimeError(f"cache_attention needs the CPU kernels: {cpu_matmul.unavailable_reason()}")
    call = jax.ffi.ffi_call(cpu_matmul._TARGETS["attention"], jax.ShapeDtypeStruct((b, t, h, d), jnp.float32))
    return call(q_bthd.astype(jnp.float32), k_all, v_all, jnp.asarray(layer, jnp.int32), mask_bts.astype(bool))
