"""A linear layer for bfloat16/float16 compute that keeps XLA:CPU on its fast matmul path.

XLA:CPU runs a bfloat16 product on the CPU's matrix units (AMX, AVX512-BF16; through YNNPACK)
only when it is a plain `[M, K] · [K, N]` product with a float32 result. Two things Flax's
`nn.Dense(dtype=bfloat16)` and JAX's autodiff produce fall off that path, and XLA then widens both
operands to float32 (several times slower: on the 2-core Sapphire Rapids VM a [3072, 576] ·
[576, 8192] product takes 150 ms instead of 51):

- a bfloat16 *result* (`dot` without `preferred_element_type`);
- a contraction over a transposed operand — exactly the two products of the backward pass,
  `dx = g · wᵀ` and `dw = xᵀ · g`. XLA folds a `transpose` into the dot's dimension numbers, so
  writing `w.T` does not help; the transpose has to be a real copy, which `_materialized_t` forces
  by splitting a dimension first (the reshape cannot be folded away: 137 → 23 ms and 144 → 35 ms
  for the two products above).

`lowp_matmul` is the product with a custom VJP doing both: float32 accumulation cast to the compute
dtype (what `nn.Dense` returns, summed in a different order), and backward products on copied
transposes. Its parameters are `nn.Dense`'s (kernel [in, out], bias), so checkpoints do not change.
Used by `layers.dense` for low-precision compute on the CPU backend only; elsewhere (and in
float32) `nn.Dense` is kept.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def _materialized_t(a_rc: jax.Array) -> jax.Array:
    """aᵀ as a real row-major copy [C, R] (a plain transpose would be folded into the next dot)."""
    r, c = a_rc.shape
    if r % 2:  # no split: XLA folds the transpose (a slower product, the same numbers)
        return a_rc.T
    return jnp.transpose(a_rc.reshape(2, r // 2, c), (2, 0, 1)).reshape(c, r)


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def lowp_matmul(x, w_kn):
    """x [..., K] · w [K, N] → [..., N] in x's dtype, accumulated in float32."""
    return _dot(x.reshape(-1, x.shape[-1]), w_kn).astype(x.dtype).reshape(*x.shape[:-1], w_kn.shape[1])


def _fwd(x, w_kn):
    return lowp_matmul(x, w_kn), (x, w_kn)


def _bwd(res, g):
    x, w_kn = res
    x_mk = x.reshape(-1, x.shape[-1])
    g_mn = g.reshape(-1, g.shape[-1]).astype(x.dtype)
    dx = _dot(g_mn, _materialized_t(w_kn)).astype(x.dtype).reshape(x.shape)
    dw = _dot(_materialized_t(x_mk), g_mn).astype(w_kn.dtype)
    return dx, dw


lowp_matmul.defvjp(_fwd, _bwd)


class LowpDense(nn.Module):
    """`nn.Dense` (same parameters) whose product is `lowp_matmul` in `dtype`."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.param_dtype)
        y = lowp_matmul(x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


def use_lowp_dense(dtype) -> bool:
    """Whether `layers.dense` should build a `LowpDense` for this compute dtype here."""
    return jnp.dtype(dtype) in [jnp.dtype(d) for d in LOW_PRECISION] and jax.default_backend() == "cpu"
