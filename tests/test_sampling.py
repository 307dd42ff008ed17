"""The sampler: logit filtering identical to transformers' warpers, and plain decoding's draws
distributed as the filtered target distribution (a chi-square test that can fail)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

from eagle_jax.decoding import generate_tokens, pack_prompts
from eagle_jax.models.decoder import forward, lm_logits
from eagle_jax.sampling import SamplingParams, argmax_last, filter_logits, target_probs, validate_sampling


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.5, 10, 0.6), (2.0, 1, 0.9), (1.0, 0, 0.01)])
def test_filter_matches_transformers_warpers(temperature, top_k, top_p, rng):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
    t = torch.tensor(logits)
    t = TemperatureLogitsWarper(temperature)(None, t)
    if top_k:
        t = TopKLogitsWarper(top_k)(None, t)
    if top_p < 1:
        t = TopPLogitsWarper(top_p)(None, t)
    ref = t.numpy()
    got = np.asarray(filter_logits(jnp.asarray(logits), SamplingParams.create(4, temperature, top_p, top_k)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    np.testing.assert_allclose(got[np.isfinite(got)], ref[np.isfinite(ref)], rtol=1e-6)


def _warped(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    t = TemperatureLogitsWarper(temperature)(None, torch.tensor(logits))
    if top_k:
        t = TopKLogitsWarper(top_k)(None, t)
    if top_p < 1:
        t = TopPLogitsWarper(top_p)(None, t)
    return t.numpy()


def _sorted_reference(logits, temperature, top_k, top_p):
    """The filter by a full sort (numpy, float32): the k-th value, then the smallest value whose
    strictly more likely tokens (within the top-k) hold less than top_p; every logit >= it kept."""
    x = logits.astype(np.float32) / np.float32(temperature)
    out = np.full_like(x, -np.inf)
    for r in range(x.shape[0]):
        srt = -np.sort(-x[r])
        k = top_k if 0 < top_k < len(srt) else len(srt)
        srt = np.where(srt >= srt[k - 1], srt, -np.inf)
        e = np.exp(srt - srt[0])
        probs = e / e.sum()
        before = np.cumsum(probs) - probs
        keep = (before < top_p) & np.isfinite(srt) if top_p < 1 else np.isfinite(srt)
        keep[0] = True
        thresh = srt[keep.sum() - 1]
        out[r] = np.where(x[r] >= thresh, x[r], -np.inf)
    return out


def test_filter_over_a_vocabulary_wide_row_matches_transformers_on_both_paths(rng):
    """Rows of 49152 logits: top-p settled among the 64 largest (a peaked row) and past them (a flat
    row, found by bisection), top-k inside and beyond the candidates, ties at the k-th value; each row
    filtered alone and in one batch with the others gives the same bits."""
    v = 49152
    flat = rng.normal(size=v).astype(np.float32)
    peaked = flat.copy()
    peaked[rng.choice(v, 12, replace=False)] += 14.0
    tied = np.round(flat * 2) / 2  # many equal values around every k-th
    block = np.full(v, -30.0, np.float32)  # one logit, then 100 tied 4.6 below it: the top-20 set is all 101
    block[rng.choice(v, 101, replace=False)] = [5.0 + np.log(100.0)] + [5.0] * 100
    rows = np.stack([peaked, flat, flat, peaked, tied, tied, flat, block])
    settings = [(0.7, 0, 0.95), (0.7, 0, 0.95), (1.0, 200, 0.9), (1.3, 40, 0.8), (1.0, 20, 0.7), (1.0, 90, 1.0),
                (1.0, 0, 1.0), (1.0, 20, 0.55)]
    sp = SamplingParams(jnp.asarray([t for t, _, _ in settings], jnp.float32),
                        jnp.asarray([p for _, _, p in settings], jnp.float32),
                        jnp.asarray([k for _, k, _ in settings], jnp.int32))
    got = np.asarray(jax.jit(filter_logits)(jnp.asarray(rows), sp))
    for i, (temperature, top_k, top_p) in enumerate(settings):
        # transformers splits a tie at the top-p boundary by sort position; eagle_jax keeps the tie whole
        ref = (_sorted_reference if i in (4, 5, 7) else _warped)(rows[i:i + 1], temperature, top_k, top_p)[0]
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(ref), err_msg=f"row {i}")
        np.testing.assert_allclose(got[i][np.isfinite(got[i])], ref[np.isfinite(ref)], rtol=1e-6)
        alone = filter_logits(jnp.asarray(rows[i:i + 1]), SamplingParams.create(1, temperature, top_p, top_k))
        np.testing.assert_array_equal(np.asarray(alone)[0], got[i])
    kept = np.isfinite(got).sum(-1)
    assert kept[0] <= 64 < kept[1] and 64 < kept[5] and kept[7] == 101  # both paths were taken


def test_draws_follow_the_given_probabilities_and_never_hit_a_zero():
    from eagle_jax.sampling import categorical, categorical_probs

    rng = np.random.default_rng(3)
    v = 700  # three blocks of 256, the last one padded
    p = np.zeros(v, np.float32)
    support = rng.choice(v, 9, replace=False)
    p[support] = rng.dirichlet(np.ones(9)).astype(np.float32)
    n = 40000
    keys = jax.random.split(jax.random.PRNGKey(5), n)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: categorical_probs(k, jnp.asarray(p)[None] * 3.0)[0]))(keys))
    assert set(np.unique(draws)) <= set(support.tolist())
    counts = np.array([(draws == s).sum() for s in support])
    assert stats.chisquare(counts, p[support] / p[support].sum() * n).pvalue > 1e-3
    # the test has power: a sampler off by one token, or with one probability doubled, is rejected
    assert stats.chisquare(counts, np.roll(p[support], 1) / p[support].sum() * n).pvalue < 1e-6
    logits = np.where(p > 0, np.log(np.maximum(p, 1e-30)), -np.inf).astype(np.float32)
    from_logits = np.asarray(jax.jit(jax.vmap(lambda k: categorical(k, jnp.asarray(logits)[None])[0]))(keys))
    np.testing.assert_array_equal(from_logits, draws)


@pytest.mark.parametrize("shape", [(3, 49152), (2, 12288), (2, 3, 1000), (5, 257), (4, 100)])
@pytest.mark.parametrize("kind", ["normal", "ties", "nan", "inf_then_nan", "all_neg_inf", "pos_inf", "bool", "int"])
def test_argmax_last_is_jnp_argmax(shape, kind, monkeypatch):
    """The chunked argmax every greedy token goes through: the first index of the maximum, a NaN
    counting as the maximum, in padded and unpadded widths, for floats, bools and ints. (Float32
    takes the CPU kernel where it is built: tests/test_cpu_topk.py; here its jnp path.)"""
    from eagle_jax.kernels import cpu_topk

    monkeypatch.setattr(cpu_topk, "usable", lambda *a, **k: False)
    rng = np.random.default_rng(zlib.crc32(f"{shape}{kind}".encode()))
    x = rng.normal(size=shape).astype(np.float32)
    last = shape[-1]
    if kind == "ties":
        x = np.minimum(np.round(x * 2), 2.0)  # the maximum 2.0 in most chunks: the first must win
    elif kind == "nan":
        x[..., rng.integers(last)] = np.nan
        x[..., -1] = np.nan
    elif kind == "inf_then_nan":
        x[..., 0], x[..., -1] = np.inf, np.nan
    elif kind == "all_neg_inf":
        x[:] = -np.inf
    elif kind == "pos_inf":
        x[..., 3], x[..., -2] = np.inf, np.inf
    elif kind == "bool":
        x = x > 2.0
    elif kind == "int":
        x = np.round(x * 3).astype(np.int32)
    got = np.asarray(jax.jit(argmax_last)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_greedy_rows_ignore_filters():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 50)), jnp.float32)
    p = target_probs(logits, SamplingParams.create(3, 0.0, 0.5, 3))
    np.testing.assert_array_equal(np.argmax(np.asarray(p), -1), np.argmax(np.asarray(logits), -1))
    assert np.all(np.asarray(p).max(-1) == 1.0)


@pytest.mark.parametrize("kw,msg", [(dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
                                    (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k")])
def test_invalid_settings_are_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        validate_sampling(**{**dict(temperature=1.0, top_p=1.0, top_k=0), **kw})


def _exact_two_token_distribution(params, cfg, prompt, sp1):
    """P(t1, t2) enumerated exactly with the tiny target."""
    ids = jnp.asarray(prompt)[None]
    p1 = np.asarray(target_probs(lm_logits(params, cfg, forward(params, cfg, ids).hidden[:, -1]), sp1))[0]
    support = np.flatnonzero(p1 > 0)
    seqs = jnp.asarray([list(prompt) + [t] for t in support])
    sp = SamplingParams.create(len(support), float(sp1.temperature[0]), float(sp1.top_p[0]), int(sp1.top_k[0]))
    p2 = np.asarray(target_probs(lm_logits(params, cfg, forward(params, cfg, seqs).hidden[:, -1]), sp))
    joint = {}
    for i, t1 in enumerate(support):
        for t2 in np.flatnonzero(p2[i] > 0):
            joint[(t1, t2)] = p1[t1] * p2[i, t2]
    return joint


def _chi2_pvalue(samples, joint):
    keys = list(joint)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys) + 1)
    for s in samples:
        counts[index.get(s, len(keys))] += 1
    expected = np.array([joint[k] for k in keys], np.float64) * len(samples)
    if counts[-1]:  # a sample outside the support: impossible under the target
        return 0.0
    big = expected >= 5  # pool rare cells so the chi-square approximation holds
    obs = np.r_[counts[:-1][big], counts[:-1][~big].sum()]
    exp = np.r_[expected[big], expected[~big].sum()]
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_sampled_tokens_follow_the_target_distribution(tiny_llama):
    _, cfg, params = tiny_llama
    prompt = [3, 14, 15, 92, 65]
    n = 6000
    sp = SamplingParams.create(n, 0.9, 0.9, 8)
    toks, lens = pack_prompts([prompt] * n, 16)
    out = generate_tokens(params, cfg, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(2),
                          jnp.array([-1], jnp.int32), sp, jax.random.PRNGKey(7), prefill_chunk=8)
    draws = [tuple(r) for r in np.asarray(out.tokens[:, 5:7])]
    joint = _exact_two_token_distribution(params, cfg, prompt, SamplingParams.create(1, 0.9, 0.9, 8))
    assert abs(sum(joint.values()) - 1) < 1e-5
    assert _chi2_pvalue(draws, joint) > 1e-3

    # The test has power: the same draws judged against the distribution without top-k/top-p,
    # and draws from a sampler that forgets the temperature, are rejected.
    unfiltered = _exact_two_token_distribution(params, cfg, prompt, SamplingParams.create(1, 0.9, 1.0, 0))
    assert _chi2_pvalue(draws, {k: v for k, v in unfiltered.items()}) < 1e-6
    biased = generate_tokens(params, cfg, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(2),
                             jnp.array([-1], jnp.int32), SamplingParams.create(n, 1.0, 0.9, 8),
                             jax.random.PRNGKey(8), prefill_chunk=8)
    assert _chi2_pvalue([tuple(r) for r in np.asarray(biased.tokens[:, 5:7])], joint) < 1e-6
