"""Offline target features: cached once, read back equal to the online teacher, resumable."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from conftest import make_hf_model, twin
from eagle_jax.draft import DraftConfig
from eagle_jax.models.decoder import lm_logits
from eagle_jax.training.features import FeatureStore, cache_features
from eagle_jax.training.objectives import teacher


def test_cache_read_back_and_resume(tmp_path, rng):
    cfg, params = twin(make_hf_model("llama"))
    dc = DraftConfig.for_target("eagle3", cfg, draft_vocab_size=50, target_layers=(0, 1, 2))
    examples = [{"input_ids": rng.integers(0, cfg.vocab_size, n)} for n in (5, 9, 3, 12, 7)]
    cache_features(params, cfg, dc, examples[:3], tmp_path, batch_size=2, seq_len=16, dtype="float32",
                   progress=False)
    meta = json.loads((tmp_path / "index.json").read_text())
    assert meta["num_examples"] == 3
    with open(tmp_path / "features.bin", "ab") as f:  # a killed run left a partial write behind
        f.write(b"\0" * 100)
    cache_features(params, cfg, dc, examples, tmp_path, batch_size=2, seq_len=16, dtype="float32", progress=False)
    store = FeatureStore(tmp_path)
    assert len(store) == 5
    for i, ex in enumerate(examples):
        feats, hidden = teacher(params, cfg, dc, jnp.asarray(ex["input_ids"])[None])
        f, h, a = store[i]
        assert f.shape == (len(ex["input_ids"]), 3 * cfg.hidden_size)
        np.testing.assert_allclose(f, np.asarray(feats[0]), atol=1e-5)
        np.testing.assert_allclose(h, np.asarray(hidden[0]), atol=1e-5)
        np.testing.assert_array_equal(a, np.asarray(lm_logits(params, cfg, hidden[0])).argmax(-1))
