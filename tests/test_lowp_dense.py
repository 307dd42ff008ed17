"""`models.lowp_dense`: the low-precision linear layer that keeps XLA:CPU's bfloat16 matmuls on the
matrix units. Its forward is a float32-accumulated product cast to bf16 and its custom backward
must be exactly the transposed products; on integer-valued operands every sum is exact in float32,
so the results can be compared for equality, not closeness."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.models.config import ModelConfig
from eagle_jax.models.layers import dense
from eagle_jax.models.lowp_dense import LowpDense, _materialized_t, lowp_matmul, use_lowp_dense


def _ints(rng, shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.integers(-4, 5, shape).astype(np.float32), dtype)


@pytest.mark.parametrize("lead,k,n", [((6,), 8, 10), ((2, 3), 5, 7), ((7,), 6, 4)])  # even/odd rows and K
def test_matmul_and_its_gradients_are_exact_on_integers(lead, k, n):
    rng = np.random.default_rng(0)
    x, w, c = _ints(rng, lead + (k,)), _ints(rng, (k, n)), _ints(rng, lead + (n,))
    f32 = lambda a: np.asarray(a, np.float32)
    y = lowp_matmul(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == lead + (n,)
    np.testing.assert_array_equal(f32(y), f32(x) @ f32(w))
    dx, dw = jax.grad(lambda x, w: jnp.sum((lowp_matmul(x, w) * c).astype(jnp.float32)), argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(f32(dx), f32(c) @ f32(w).T)
    np.testing.assert_array_equal(f32(dw), f32(x).reshape(-1, k).T @ f32(c).reshape(-1, n))


def test_matmul_under_jit_matches_float32_on_random_values():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 48)) * 0.1, jnp.bfloat16)
    loss = lambda x, w: jnp.sum(jnp.sin(lowp_matmul(x, w).astype(jnp.float32)))
    ref = lambda x, w: jnp.sum(jnp.sin(x.astype(jnp.float32) @ w.astype(jnp.float32)))
    (l, g), (lr, gr) = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w), jax.value_and_grad(ref, (0, 1))(x, w)
    np.testing.assert_allclose(float(l), float(lr), rtol=1e-2, atol=0.1)
    for a, b in zip(g, gr):
        a, b = np.asarray(a, np.float32).ravel(), np.asarray(b, np.float32).ravel()
        assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999


def test_materialized_transpose_is_the_transpose():
    a = jnp.arange(6 * 5, dtype=jnp.float32).reshape(6, 5)
    np.testing.assert_array_equal(np.asarray(jax.jit(_materialized_t)(a)), np.asarray(a).T)
    b = a[:5]  # odd rows: the plain transpose
    np.testing.assert_array_equal(np.asarray(_materialized_t(b)), np.asarray(b).T)


def test_lowp_dense_has_nn_dense_parameters_and_output():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4, 16)), jnp.bfloat16)
    ours, ref = (m(24, use_bias=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16) for m in (LowpDense, nn.Dense))
    p = ours.init(jax.random.PRNGKey(0), x)
    q = ref.init(jax.random.PRNGKey(0), x)
    assert jax.tree.structure(p) == jax.tree.structure(q)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    p = jax.tree.map(lambda a: a + 0.5, p)  # a non-zero bias
    np.testing.assert_allclose(np.asarray(ours.apply(p, x), np.float32), np.asarray(ref.apply(p, x), np.float32),
                               rtol=2e-2, atol=2e-2)


def test_dense_picks_the_layer_by_compute_dtype():
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8)
    assert jax.default_backend() == "cpu"
    assert type(dense(cfg.replace(dtype="bfloat16"), "x", 8, False)) is LowpDense
    assert type(dense(cfg, "x", 8, False)) is nn.Dense
    assert use_lowp_dense("float16") and not use_lowp_dense("float32")
