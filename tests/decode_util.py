"""Greedy decoding of a batch of prompts, plain or speculative, for the kernel tests
(test_cpu_matmul.py, test_gguf_blocks.py)."""

import jax
import jax.numpy as jnp
import numpy as np


def decode(fn_params, cfg, prompts, max_new, **kw):
    from eagle_jax.decoding import generate_tokens, pack_prompts
    from eagle_jax.sampling import SamplingParams
    from eagle_jax.speculative import speculative_generate

    toks, lens = pack_prompts(prompts, 64)
    head = kw.pop("head", None)
    args = (jnp.asarray(toks), jnp.asarray(lens), jnp.int32(max_new), jnp.asarray([-1], jnp.int32),
            SamplingParams.create(len(prompts)), jax.random.PRNGKey(0))
    if head is None:
        out = generate_tokens(fn_params, cfg, *args, prefill_chunk=16)
    else:
        out = speculative_generate(fn_params, cfg, head, *args, prefill_chunk=16, **kw)
    return np.asarray(out.tokens), lens
