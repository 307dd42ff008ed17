"""Speculative greedy decoding of the real SmolLM2-135M equals plain greedy decoding, token for
token, for EAGLE-1 (static tree), EAGLE-2 and EAGLE-3 — with the oracle head (whole paths
accepted) and with the packaged trained heads (some drafts accepted, many rejected), several
prompts in one batch. Random heads (almost nothing accepted) are covered on the tiny models of
test_speculative.py; on this model they added no path the trained heads' rejections miss.

The plain reference decodes with the engine's CPU layout (layers unrolled); the speculative runs
use the scanned layout of the same weights (`stack_layers`), which compiles about 3x faster — an
oracle head runs the whole target at every draft level — and checks the two layouts against
each other on the real model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decoding import pack_prompts
from eagle_jax.draft import oracle_head
from eagle_jax.engine import default_budget
from eagle_jax.models.decoder import stack_layers
from eagle_jax.sampling import SamplingParams
from eagle_jax.speculative import speculative_generate

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for a good night's sleep.",
    "Explain photosynthesis to a child.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "List the planets of the solar system in order.",
]
NEW = 64


@pytest.fixture(scope="module")
def plain(smollm2_engine):
    engine = smollm2_engine
    ids = [engine.encode(p) for p in PROMPTS]
    assert engine.layers == "unroll"
    return ids, [engine.generate_ids(p, NEW).tokens for p in ids]


@pytest.fixture(scope="module")
def scan_params(smollm2_engine):
    return stack_layers(smollm2_engine.params)


@pytest.mark.parametrize("method", ["eagle1", "eagle2", "eagle3"])
def test_oracle_speculative_greedy_equals_plain(smollm2_engine, plain, scan_params, method):
    engine = smollm2_engine
    ids, expected = plain
    cfg = engine.cfg
    head = oracle_head(cfg, scan_params)
    toks, lens = pack_prompts(ids, 128)
    out = speculative_generate(scan_params, cfg, head, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(NEW),
                               jnp.asarray(engine.eos_ids, jnp.int32), SamplingParams.create(len(ids)),
                               jax.random.PRNGKey(0), budget=default_budget(method))
    for i, exp in enumerate(expected):
        assert np.asarray(out.tokens[i, lens[i]:out.length[i]]).tolist() == exp, PROMPTS[i]
    tau = np.asarray(out.num_new).sum() / np.asarray(out.target_calls).sum()
    assert tau > 3.0  # whole paths accepted


@pytest.mark.parametrize("method", ["eagle3", "eagle2", "eagle1"])
def test_packaged_default_drafters_are_lossless_and_trained(smollm2_engine, plain, scan_params, method):
    """The drafters shipped for the default target: exact greedy output, and clearly better than a
    random head (which accepts almost nothing: tau ≈ 1.0)."""
    from eagle_jax.engine import default_drafter_path

    engine = smollm2_engine
    ids, expected = plain
    assert default_drafter_path("smollm2-135m-instruct", "eagle3" if method == "eagle3" else "eagle1") is not None
    engine.add_method(method, "default")
    toks, lens = pack_prompts(ids, 128)
    out = speculative_generate(scan_params, engine.cfg, engine.heads[method], jnp.asarray(toks), jnp.asarray(lens),
                               jnp.int32(NEW), jnp.asarray(engine.eos_ids, jnp.int32), SamplingParams.create(len(ids)),
                               jax.random.PRNGKey(0), budget=default_budget(method))
    for i, exp in enumerate(expected):
        assert np.asarray(out.tokens[i, lens[i]:out.length[i]]).tolist() == exp, PROMPTS[i]
    tau = np.asarray(out.num_new).sum() / np.asarray(out.target_calls).sum()
    assert tau > 1.2, tau
    steps = np.asarray(out.accept_lengths)
    assert (steps == 1).sum() > 0 and (steps > 1).sum() > 0  # both paths ran: all drafts rejected, some accepted
