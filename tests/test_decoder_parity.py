"""Parity of the JAX decoder with transformers' PyTorch models on tiny random configs.

Tolerance policy (fp32): 1e-4 absolute on logits and on every hidden state; never loosened.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import FAMILY_EXTRAS, make_hf_model, twin
from eagle_jax.models.decoder import forward, lm_logits

TOL = 1e-4


@pytest.mark.parametrize("name", sorted(FAMILY_EXTRAS))
def test_logits_and_hidden_states_match_transformers(name, rng):
    model = make_hf_model(name)
    cfg, params = twin(model)
    ids = rng.integers(0, cfg.vocab_size, (2, 19))
    with torch.no_grad():
        ref = model(torch.tensor(ids), output_hidden_states=True)
    out = forward(params, cfg, jnp.asarray(ids), capture=tuple(range(cfg.num_layers + 1)))
    logits = np.asarray(lm_logits(params, cfg, out.hidden))
    np.testing.assert_allclose(logits, ref.logits.numpy(), atol=TOL, rtol=0)
    assert len(out.captured) == len(ref.hidden_states)
    for i, (mine, theirs) in enumerate(zip(out.captured, ref.hidden_states)):
        np.testing.assert_allclose(np.asarray(mine), theirs.numpy(), atol=TOL, rtol=0, err_msg=f"hidden_states[{i}]")
    np.testing.assert_allclose(np.asarray(out.hidden), ref.hidden_states[-1].numpy(), atol=TOL, rtol=0)


def test_family_switches_are_set_by_config():
    cfgs = {n: twin(make_hf_model(n))[0] for n in FAMILY_EXTRAS}
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].o_bias
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32
    assert cfgs["mistral"].sliding_window == 6
    assert cfgs["llama"].rope_scaling.kind == "llama3"
    assert cfgs["llama_bias_untied"].o_bias and cfgs["llama_bias_untied"].mlp_bias
    assert not cfgs["llama_bias_untied"].tie_word_embeddings


def test_sliding_window_changes_the_result(rng):
    """The window is really applied: without it, positions past the window give other logits."""
    model = make_hf_model("mistral")
    cfg, params = twin(model)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 16)))
    with_w = np.asarray(lm_logits(params, cfg, forward(params, cfg, ids).hidden))
    no_w = np.asarray(lm_logits(params, cfg.replace(sliding_window=None),
                                forward(params, cfg.replace(sliding_window=None), ids).hidden))
    np.testing.assert_allclose(with_w[:, :6], no_w[:, :6], atol=1e-6)
    assert np.abs(with_w[:, 7:] - no_w[:, 7:]).max() > 1e-3
