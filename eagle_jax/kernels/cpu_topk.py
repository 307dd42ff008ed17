"""Top-k and argmax over the last axis through the CPU kernels' custom call (`cpu_topk.cc`).

`top_k(x, k, with_lse)` is `jax.lax.top_k(x, k)` (plus `jax.nn.logsumexp(x, -1)` to float32
rounding when `with_lse`) for float32 `x`; `argmax(x)` is `jnp.argmax(x, -1)`. The order is theirs
bit for bit: descending, NaN above every number, equal values to the lower index. XLA:CPU lowers
these reductions over a vocabulary-wide row to scalar loops: drafting's top-3 over a [3, 12288]
head vocabulary took ≈ 0.4 ms a step, a tree's argmax over [5, 49152] ≈ 0.2 ms, where the kernel
takes one vectorised pass (see the C++ file's header).

`usable(x, k)` says whether the kernel takes these operands (JAX on the CPU, the kernels built,
float32, 1 <= k <= 64); `sampling.argmax_last` and drafting's top-k use it and otherwise keep their
jnp paths. No gradient: inference only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_matmul

MAX_K = 64  # the C++ side's candidate list


def usable(x: jax.Array, k: int = 1) -> bool:
    """Whether `top_k`/`argmax` run the kernel for these operands (else the caller's jnp path)."""
    return (x.dtype == jnp.float32 and x.ndim >= 1 and 1 <= k <= min(MAX_K, x.shape[-1])
            and jax.default_backend() == "cpu" and cpu_matmul.available())


def top_k(x: jax.Array, k: int, with_lse: bool = False):
    """(values [..., k], int32 indices [..., k], log-sum-exp [...] or None) of the last axis."""
    if not usable(x, k):
        raise RuntimeError(f"cpu_topk.top_k: not for {x.dtype} {tuple(x.shape)} with k={k} here "
                           f"({cpu_matmul.unavailable_reason() or 'see usable()'})")
    lead, v = x.shape[:-1], x.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))
    if rows == 0:
        zeros = jnp.zeros((*lead, k), jnp.float32)
        return zeros, zeros.astype(jnp.int32), (jnp.zeros(lead, jnp.float32) if with_lse else None)
    call = jax.ffi.ffi_call(cpu_matmul._TARGETS["top_k"],
                            (jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((rows, k), jnp.int32),
                             jax.ShapeDtypeStruct((rows,), jnp.float32)))
    vals, idx, lse = call(x.reshape(rows, v), k=np.int64(k), lse=np.int64(int(with_lse)))
    return vals.reshape(*lead, k), idx.reshape(*lead, k), (lse.reshape(lead) if with_lse else None)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` (int32) for float32 x."""
    return top_k(x, 1)[1][..., 0]
