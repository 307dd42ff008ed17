"""The CPU kernels' top-k / argmax custom call (kernels/cpu_topk): lax.top_k's and jnp.argmax's
order bit for bit (NaN above every number, ties to the lower index), the log-sum-exp beside it, and
its users (greedy tokens, drafting's top-k) giving what their jnp paths give."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import cpu_topk

pytestmark = pytest.mark.skipif(not cpu_topk.usable(jnp.zeros((1, 4), jnp.float32)),
                                reason="no CPU kernels here")

KINDS = ["normal", "ties", "nan", "nan_ties", "inf", "neg_inf", "all_neg_inf", "signed_zeros"]


def _data(shape, kind):
    rng = np.random.default_rng(zlib.crc32(f"{shape}{kind}".encode()))
    x = rng.normal(size=shape).astype(np.float32)
    if kind == "ties":
        x = np.minimum(np.round(x * 2), 2.0) + np.float32(0.0)  # many equal maxima (no -0: see below)
    elif kind == "nan":
        x[rng.random(shape) < 0.002] = np.nan
        x[..., -1] = np.nan
    elif kind == "nan_ties":  # more NaNs than k, spread over the row
        x[..., ::7] = np.nan
    elif kind == "inf":
        x[..., 5], x[..., -3] = np.inf, np.inf
    elif kind == "neg_inf":
        x[rng.random(shape) < 0.5] = -np.inf
    elif kind == "all_neg_inf":
        x[:] = -np.inf
    elif kind == "signed_zeros":
        x = np.where(rng.random(shape) < 0.5, np.float32(-0.0), np.float32(0.0)) + np.minimum(x, 0) * (x < -3)
    return x


@pytest.mark.parametrize("shape", [(1, 12288), (3, 49152), (2, 3, 100), (4, 17), (5, 8)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_top_k_is_lax_top_k_and_argmax_is_jnp_argmax(shape, kind, k):
    x = jnp.asarray(_data(shape, kind))
    vals, idx, lse = jax.jit(lambda a: cpu_topk.top_k(a, k))(x)
    want_v, want_i = jax.lax.top_k(x, k)
    assert idx.dtype == jnp.int32 and vals.shape == want_v.shape and lse is None
    if kind == "signed_zeros":  # lax.top_k sorts -0 below +0; the kernel, like jnp.argmax, calls them equal
        want_i = np.argsort(-np.asarray(x), axis=-1, kind="stable")[..., :k]
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(want_v))
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_topk.argmax)(x)), np.asarray(jnp.argmax(x, axis=-1)))


@pytest.mark.parametrize("kind", KINDS)
def test_log_sum_exp_beside_the_top_k(kind):
    x = jnp.asarray(_data((3, 12288), kind))
    _, _, lse = jax.jit(lambda a: cpu_topk.top_k(a, 2, with_lse=True))(x)
    want = np.asarray(jax.nn.logsumexp(x, axis=-1))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want))  # NaN where a NaN is; ±inf where jax has them
    np.testing.assert_allclose(np.asarray(lse), want, rtol=2e-6, atol=2e-6)


def test_k_up_to_64_and_the_limits():
    x = jnp.asarray(_data((2, 1000), "ties"))
    for k in (17, 64):
        got = cpu_topk.top_k(x, k)
        want = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert not cpu_topk.usable(x, 65) and not cpu_topk.usable(x, 0) and not cpu_topk.usable(x[:, :4], 5)
    assert not cpu_topk.usable(x.astype(jnp.bfloat16))
    with pytest.raises(RuntimeError, match="k=65"):
        cpu_topk.top_k(x, 65)


def test_greedy_tokens_and_drafting_top_k_agree_with_their_jnp_paths(monkeypatch):
    """`sampling.argmax_last` and drafting's `_top_k_rows` take the kernel here; with it switched off
    they take their jnp paths, and both give the same indices (NaN aside for the top-k: the jnp passes
    never pick one, the kernel ranks it first as lax.top_k does)."""
    from eagle_jax.draft.drafting import _top_k_rows
    from eagle_jax.sampling import argmax_last

    x = jnp.asarray(_data((3, 12288), "ties"))
    x_nan = x.at[1, 77].set(jnp.nan)
    fast = np.asarray(jax.jit(argmax_last)(x_nan)), [np.asarray(a) for a in jax.jit(lambda a: _top_k_rows(a, 3))(x)]
    monkeypatch.setattr(cpu_topk, "usable", lambda *a, **k: False)
    slow = np.asarray(jax.jit(argmax_last)(x_nan)), [np.asarray(a) for a in jax.jit(lambda a: _top_k_rows(a, 3))(x)]
    assert fast[0][1] == 77
    np.testing.assert_array_equal(fast[0], slow[0])
    np.testing.assert_array_equal(fast[1][1], slow[1][1])
    np.testing.assert_array_equal(fast[1][0], slow[1][0])
