"""Plain generation: greedy equals transformers' generate; stopping rules; one compile per shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import make_hf_model, twin
from eagle_jax.cpu_jit import TRACE_COUNTS
from eagle_jax.decoding import cache_length_for, chunk_counts, generate_tokens, pack_prompts, prefill, prefill_plan
from eagle_jax.engine import parse_prefill_chunk
from eagle_jax.models.decoder import KVCache, forward, lm_logits
from eagle_jax.sampling import SamplingParams

NO_EOS = jnp.array([-1], jnp.int32)


def _generate(params, cfg, prompts, max_new, cache_len=128, sp=None, eos=NO_EOS, chunk=16, seed=0):
    toks, lens = pack_prompts(prompts, cache_len)
    sp = sp or SamplingParams.create(len(prompts))
    out = generate_tokens(params, cfg, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(max_new), eos, sp,
                          jax.random.PRNGKey(seed), prefill_chunk=chunk)
    return [list(np.asarray(out.tokens[i, lens[i]:out.length[i]])) for i in range(len(prompts))], out


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_greedy_equals_transformers_generate(name, rng):
    model = make_hf_model(name, std=0.2)
    cfg, params = twin(model)
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (5, 16, 17, 40)]  # chunk boundaries
    got, out = _generate(params, cfg, prompts, 24)
    for p, g in zip(prompts, got):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert g == ref
    assert np.asarray(out.num_new).tolist() == [24] * 4


def test_prefill_plans_cover_the_prompt_with_little_padding():
    assert prefill_plan(64) == (64, 0) and prefill_plan((128, 8)) == (128, 8)
    for bad in (0, (8, 8), (8, 16), (16, -1)):
        with pytest.raises(ValueError, match="prefill chunks"):
            prefill_plan(bad)
    for total in range(0, 400):
        n_big, n_tail = (int(x) for x in chunk_counts(jnp.int32(total), (128, 8)))
        rows = 128 * n_big + 8 * n_tail
        assert rows >= total
        assert rows - total < (8 if n_tail else 33)  # a big chunk runs only while 96 or more tokens remain
        assert int(chunk_counts(jnp.int32(total), 64)[0]) == -(-total // 64)
    assert parse_prefill_chunk("128,8") == (128, 8) and parse_prefill_chunk("64") == 64
    assert parse_prefill_chunk("64,0") == 64 and parse_prefill_chunk("auto") is None
    for bad in ("x", "8,8", "1,2,3"):
        with pytest.raises(ValueError, match="prefill"):
            parse_prefill_chunk(bad)


@pytest.mark.parametrize("chunk", [16, (16, 4), (8, 1), 5])
def test_prefill_plans_give_the_uncached_logits_and_features(tiny_llama, chunk, rng):
    """Whatever the chunks (whole, big then tail, one token at a time), prefill's last-token logits
    and captured features are the uncached forward's."""
    _, cfg, params = tiny_llama
    lens = [3, 21, 30]  # 30 under (16, 4): one chunk of 16, then 4 of 4 (the last one partly padding)
    toks, lens = pack_prompts([list(rng.integers(3, cfg.vocab_size, n)) for n in lens], 48)
    cache, logits, (feats,) = prefill(params, cfg, jnp.asarray(toks), jnp.asarray(lens),
                                      KVCache.create(cfg, 3, 48), chunk, capture=(1,))
    assert np.asarray(cache.length).tolist() == lens.tolist()
    for i, n in enumerate(lens):
        ref = forward(params, cfg, jnp.asarray(toks[i:i + 1, :n]), jnp.arange(n)[None], capture=(1,))
        np.testing.assert_allclose(np.asarray(logits[i]), np.asarray(lm_logits(params, cfg, ref.hidden[0, -1:]))[0],
                                   rtol=0, atol=1e-5)
        # Features reach |8| here, where 1e-5 is ~20 float32 steps, and the Xeon VM's XLA sums the
        # chunks' products in another order (1.0014e-5 apart at -7.83, stop 81): 1e-5 up to |4|, in
        # proportion to the features' largest above (a wrong chunk or position is off by far more).
        want = np.asarray(ref.captured[0][0])
        np.testing.assert_allclose(np.asarray(feats[i, :n]), want, rtol=0, atol=2.5e-6 * max(4.0, np.abs(want).max()))
        assert not np.asarray(feats[i, n:]).any()


def test_stops_at_eos_and_keeps_it(tiny_llama):
    _, cfg, params = tiny_llama
    prompts = [[5, 6, 7, 8], [9, 10]]
    free, _ = _generate(params, cfg, prompts, 12)
    eos = free[0][4]  # the 5th greedy token of row 0 becomes the stop token
    first = [row.index(eos) + 1 if eos in row else 12 for row in free]
    stopped, out = _generate(params, cfg, prompts, 12, eos=jnp.array([eos, -1], jnp.int32))
    for row, n, s in zip(free, first, stopped):
        assert s == row[:n]
    assert np.asarray(out.num_new).tolist() == first


def test_max_new_tokens_and_cache_full(tiny_llama):
    _, cfg, params = tiny_llama
    got, out = _generate(params, cfg, [[1, 2, 3]], 5, cache_len=16)
    assert len(got[0]) == 5 and int(out.target_calls) == 5
    got, out = _generate(params, cfg, [[1, 2, 3]], 50, cache_len=16)
    assert len(got[0]) == 13 and int(out.length[0]) == 16  # stops when the cache is full


def test_compiles_once_per_shape(tiny_llama):
    """Different prompts, lengths, budgets, temperatures and seeds reuse one compiled generation."""
    _, cfg, params = tiny_llama
    _generate(params, cfg, [[1, 2, 3]], 4, cache_len=32)
    before = TRACE_COUNTS.get("generate", 0)
    for i, (prompt, n, temp) in enumerate([([4, 5], 9, 0.0), ([7] * 20, 3, 0.8), ([2, 9, 4, 1], 11, 1.5)]):
        _generate(params, cfg, [prompt], n, cache_len=32, sp=SamplingParams.create(1, temp, 0.9, 5), seed=i)
    assert TRACE_COUNTS["generate"] == before
    _generate(params, cfg, [[1, 2, 3]], 4, cache_len=64)  # a new cache length is a new shape
    assert TRACE_COUNTS["generate"] == before + 1


def test_sampling_is_reproducible_per_seed(tiny_llama):
    _, cfg, params = tiny_llama
    sp = SamplingParams.create(1, 1.0)
    a, _ = _generate(params, cfg, [[1, 2, 3]], 10, sp=sp, seed=3)
    b, _ = _generate(params, cfg, [[1, 2, 3]], 10, sp=sp, seed=3)
    c, _ = _generate(params, cfg, [[1, 2, 3]], 10, sp=sp, seed=4)
    assert a == b and a != c


def test_prompt_longer_than_cache_is_rejected():
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens, which does not fit the cache of 32"):
        pack_prompts([[1, 2], list(range(40))], 32)
    with pytest.raises(ValueError, match="empty"):
        pack_prompts([[]], 32)
    assert cache_length_for(100, 28) == 128 and cache_length_for(100, 29) == 256


@pytest.mark.parametrize("steps_per_call", [3, 14])
def test_continuous_batching_equals_generation_per_prompt(tiny_llama, rng, steps_per_call):
    """Self-distillation's continuous batching (`decode_refill` puts new prompts into finished
    rows while the others keep decoding) gives every prompt the greedy reply it gets alone, with its
    stop reason; rows finish at different steps because of an EOS token and different prompts.
    With 14 steps a call (the reply limit) every row finishes in every call, so one call refills
    several rows (padded to a power of two, at most the batch)."""
    from types import SimpleNamespace

    from eagle_jax.training.selfdistill import Distiller

    _, cfg, params = tiny_llama
    prompts = [list(map(int, rng.integers(3, cfg.vocab_size, n))) for n in (4, 9, 17, 6, 30, 3, 12, 21)]
    free, _ = _generate(params, cfg, prompts, 14, cache_len=64)
    counts = np.bincount(np.concatenate([r[1:10] for r in free]), minlength=cfg.vocab_size)
    eos = int(np.argmax(counts))  # a token several rows produce early: they stop at different steps
    ref, _ = _generate(params, cfg, prompts, 14, cache_len=64, eos=jnp.array([eos, -1], jnp.int32))
    lengths = {len(r) for r in ref}
    assert len(lengths) > 2 and 14 in lengths, "the test needs rows that stop early and rows that run to the end"
    engine = SimpleNamespace(params=params, cfg=cfg, eos_ids=[eos], prefill_chunk=16)
    d = Distiller(engine, max_new_tokens=14, batch_size=3, steps_per_call=steps_per_call)
    got = {i: (toks, finish) for i, toks, finish in d.stream(prompts, cache_len=64)}
    assert sorted(got) == list(range(len(prompts)))
    for i, r in enumerate(ref):
        assert got[i] == (r, "stop" if r[-1] == eos else "length"), i
    assert TRACE_COUNTS.get("decode_refill", 0) >= 1
    assert d.refilled_rows == len(prompts) - 3
    if steps_per_call == 14:  # 8 prompts, 3 rows: refills of 3 and 2 rows
        assert d.refill_calls == 2
        assert d.refill_sizes() == [1, 2, 3]
        traced = TRACE_COUNTS.get("decode_refill", 0)
        d.compile_refills(prompts[0], 80)  # a new cache length: each refill size compiles once here
        assert TRACE_COUNTS.get("decode_refill", 0) == traced + 3
        again = {i: toks for i, toks, _ in d.stream(prompts, cache_len=80)}  # ... and not again
        assert TRACE_COUNTS.get("decode_refill", 0) == traced + 3
        assert again == {i: t for i, (t, _) in got.items()}
