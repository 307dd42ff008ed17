"""Offline target features: cached once, read back equal to the online teacher, resumable."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_hf_model, twin
from eagle_jax.draft import DraftConfig
from eagle_jax.models.decoder import lm_logits
from eagle_jax.training.data import make_dataset
from eagle_jax.training.eagle_job import _feature_loader
from eagle_jax.training.features import FeatureStore, _pack_batch, cache_features
from eagle_jax.training.objectives import teacher


@pytest.mark.parametrize("pack", [True, False])
def test_cache_read_back_and_resume(tmp_path, rng, pack):
    """Each example's stored features equal the teacher on that example alone, whether examples
    share rows (packed: 5 + 9, then 3 + 12, …) or not, and across a resumed run."""
    cfg, params = twin(make_hf_model("llama"))
    dc = DraftConfig.for_target("eagle3", cfg, draft_vocab_size=50, target_layers=(0, 1, 2))
    examples = [{"input_ids": rng.integers(0, cfg.vocab_size, n)} for n in (5, 9, 3, 12, 7)]
    cache_features(params, cfg, dc, examples[:3], tmp_path, batch_size=2, seq_len=16, dtype="float32",
                   progress=False, pack=pack)
    meta = json.loads((tmp_path / "index.json").read_text())
    assert meta["num_examples"] == 3
    with open(tmp_path / "features.bin", "ab") as f:  # a killed run left a partial write behind
        f.write(b"\0" * 100)
    cache_features(params, cfg, dc, examples, tmp_path, batch_size=2, seq_len=16, dtype="float32", progress=False,
                   pack=pack)
    store = FeatureStore(tmp_path)
    assert len(store) == 5
    for i, ex in enumerate(examples):
        feats, hidden = teacher(params, cfg, dc, jnp.asarray(ex["input_ids"])[None])
        f, h, a = store[i]
        assert f.shape == (len(ex["input_ids"]), 3 * cfg.hidden_size)
        np.testing.assert_allclose(f, np.asarray(feats[0]), atol=1e-5)
        np.testing.assert_allclose(h, np.asarray(hidden[0]), atol=1e-5)
        np.testing.assert_array_equal(a, np.asarray(lm_logits(params, cfg, hidden[0])).argmax(-1))


def test_store_is_keyed_by_tokens(tmp_path, rng):
    """A store serves any list drawing on it: another list (reordered, a subset, new examples in the
    middle, a repeat) computes only the examples whose tokens it lacks, and `slots` finds each
    example's own features; an example the store lacks is named."""
    cfg, params = twin(make_hf_model("llama"))
    dc = DraftConfig.for_target("eagle3", cfg, draft_vocab_size=50, target_layers=(0, 1, 2))
    examples = [{"input_ids": rng.integers(0, cfg.vocab_size, n)} for n in (5, 9, 3, 12, 7)]
    kw = dict(batch_size=2, seq_len=16, dtype="float32", progress=False)
    cache_features(params, cfg, dc, examples[:3], tmp_path, **kw)
    other = {"input_ids": (examples[1]["input_ids"] + 1) % cfg.vocab_size}  # same length, other tokens
    mixed = [examples[2], other, examples[0], examples[4], examples[1], examples[2]]
    cache_features(params, cfg, dc, mixed, tmp_path, **kw)
    store = FeatureStore(tmp_path)
    assert len(store) == 5  # 3 cached + `other` + examples[4]; nothing computed twice
    slots = store.slots(mixed, 16)
    assert slots.tolist() == [2, 3, 0, 4, 1, 2]
    for ex, k in zip(mixed, slots):
        feats, hidden = teacher(params, cfg, dc, jnp.asarray(ex["input_ids"])[None])
        np.testing.assert_allclose(store[int(k)][0], np.asarray(feats[0]), atol=1e-5)
        np.testing.assert_allclose(store[int(k)][1], np.asarray(hidden[0]), atol=1e-5)
    assert store.slots([examples[1]], 16).tolist() == [1]  # a subset needs nothing new
    with pytest.raises(ValueError, match="no features for example 1 \\(12 tokens\\)"):
        store.slots([examples[0], examples[3]], 16)
    long = {"input_ids": rng.integers(0, cfg.vocab_size, 20)}  # keyed by the tokens kept (the first seq_len)
    cache_features(params, cfg, dc, [long], tmp_path, **kw)
    cut = {"input_ids": np.concatenate([long["input_ids"][:16], [0, 1]])}
    assert FeatureStore(tmp_path).slots([cut], 16).tolist() == [5]


def test_store_before_digests_keeps_the_prefix_rule(tmp_path, rng):
    """A store written before digests is only extended by a list that starts with its examples
    (checked by length: the first that differs is named), and maps example i to entry i."""
    cfg, params = twin(make_hf_model("llama"))
    dc = DraftConfig.for_target("eagle3", cfg, draft_vocab_size=50, target_layers=(0, 1, 2))
    examples = [{"input_ids": rng.integers(0, cfg.vocab_size, n)} for n in (5, 9, 3)]
    kw = dict(batch_size=2, seq_len=16, dtype="float32", progress=False)
    cache_features(params, cfg, dc, examples, tmp_path, **kw)
    meta = json.loads((tmp_path / "index.json").read_text())
    del meta["digests"]
    (tmp_path / "index.json").write_text(json.dumps(meta))
    other = [dict(e) for e in examples]
    other[1] = {"input_ids": (examples[1]["input_ids"] + 1) % cfg.vocab_size}
    cache_features(params, cfg, dc, other, tmp_path, **kw)  # same lengths: accepted
    shorter = [examples[0], {"input_ids": examples[1]["input_ids"][:4]}, examples[2]]
    with pytest.raises(ValueError, match="cached example 1 does not match.*9 cached tokens, 4 given"):
        cache_features(params, cfg, dc, shorter, tmp_path, **kw)
    with pytest.raises(ValueError, match="more than the 2 given"):
        cache_features(params, cfg, dc, examples[:2], tmp_path, **kw)
    cache_features(params, cfg, dc, examples + examples[:1], tmp_path, **kw)  # extended at its end
    with pytest.raises(ValueError, match="more than the 2 given"):  # the rule holds on the next run too
        cache_features(params, cfg, dc, examples[:2], tmp_path, **kw)
    store = FeatureStore(tmp_path)
    assert len(store) == 4 and store.meta["digests"] is None
    assert store.slots(examples + examples[:1], 16).tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(store[3][2], store[0][2])


def test_resume_refuses_another_target_dtype(tmp_path, rng):
    """Features the target computed in one dtype are not extended by another's (model.dtype changed
    between runs); a store from before the dtype was recorded is extended as before."""
    cfg, params = twin(make_hf_model("llama"))
    dc = DraftConfig.for_target("eagle3", cfg, draft_vocab_size=50, target_layers=(0, 1, 2))
    examples = [{"input_ids": rng.integers(0, cfg.vocab_size, n)} for n in (5, 9, 3)]
    kw = dict(batch_size=2, seq_len=16, dtype="float32", progress=False)
    cache_features(params, cfg, dc, examples[:2], tmp_path, **kw)
    assert json.loads((tmp_path / "index.json").read_text())["target_dtype"] == "float32"
    bcfg = dataclasses.replace(cfg, dtype="bfloat16")
    bparams = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(ValueError, match="computed in float32, not bfloat16"):
        cache_features(bparams, bcfg, dc, examples, tmp_path, **kw)
    meta = json.loads((tmp_path / "index.json").read_text())
    del meta["target_dtype"]
    (tmp_path / "index.json").write_text(json.dumps(meta))
    cache_features(params, cfg, dc, examples, tmp_path, **kw)
    assert len(FeatureStore(tmp_path)) == 3

def test_pack_batch_layout():
    """Consecutive examples, as many as fit, placed longest first into the first row with room (so
    a later short one fills an earlier gap); spans in example order; each example its own segment
    id and positions from 0; an over-long example cut to the row; unpacked: one per row."""
    examples = [{"input_ids": np.arange(100 * k, 100 * k + n)} for k, n in enumerate((5, 9, 3, 12, 2, 20, 1))]
    ids, seg, pos, spans = _pack_batch(examples, 0, 2, 16, True)
    # 12 → row 0, 9 → row 1, 5 → row 1, 3 → row 0, 2 → row 1 (16 tokens each); the 20 does not fit
    assert spans == [(1, 9, 5), (1, 0, 9), (0, 12, 3), (0, 0, 12), (1, 14, 2)]
    np.testing.assert_array_equal(ids[1], np.concatenate([np.arange(100, 109), np.arange(0, 5), [400, 401]]))
    np.testing.assert_array_equal(seg[0], [4] * 12 + [3] * 3 + [0])
    np.testing.assert_array_equal(pos[0, :15], list(range(12)) + list(range(3)))
    ids, seg, pos, spans = _pack_batch(examples, 5, 2, 16, True)
    assert spans == [(0, 0, 16), (1, 0, 1)]
    np.testing.assert_array_equal(ids[0], np.arange(500, 516))
    _, _, _, spans = _pack_batch(examples, 0, 3, 16, False)
    assert spans == [(0, 0, 5), (1, 0, 9), (2, 0, 3)]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("shard", [(0, 1), (1, 2)])
def test_feature_loader_lines_up_with_tokens(tmp_path, rng, pack, shard):
    """The offline pipeline (make_dataset + the store's loader) puts each example's cached features
    under its own tokens: packed side by side, sharded by process, zeros on padding."""
    cfg, params = twin(make_hf_model("llama"))
    dc = DraftConfig.for_target("eagle3", cfg, draft_vocab_size=50, target_layers=(0, 1, 2))
    examples = [{"input_ids": rng.integers(0, cfg.vocab_size, n), "loss_mask": np.ones(n)}
                for n in (5, 9, 3, 12, 7, 4, 20)]
    seq = 16
    cache_features(params, cfg, dc, examples, tmp_path, batch_size=4, seq_len=seq, dtype="float32", progress=False)
    store = FeatureStore(tmp_path)
    stats = {}
    it = make_dataset(examples, 2, seq, seed=3, num_epochs=1, shard_index=shard[0], shard_count=shard[1],
                      drop_remainder=False, pack=pack, attach=_feature_loader(store, seq, store.slots(examples, seq)),
                      stats=stats)
    mine = list(range(len(examples)))[shard[0]::shard[1]]
    assert stats["examples"] == len(mine) and (stats["rows"] < len(mine)) == pack
    seen = []
    for b in it:
        assert b["features"].shape == (2, seq, 3 * cfg.hidden_size) and b["hidden"].shape == (2, seq, cfg.hidden_size)
        for r in range(2):
            seg = b["segment_ids"][r] if pack else (np.arange(seq) < b["lengths"][r]).astype(int)
            for k in range(1, int(seg.max()) + 1):
                at = np.flatnonzero(seg == k)
                j = next(j for j in mine if len(examples[j]["input_ids"][:seq]) == len(at)
                         and np.array_equal(examples[j]["input_ids"][:seq], b["input_ids"][r, at]))
                f, h, a = store[j]
                np.testing.assert_array_equal(b["features"][r, at], f[:seq])
                np.testing.assert_array_equal(b["hidden"][r, at], h[:seq])
                np.testing.assert_array_equal(b["target_argmax"][r, at], a[:seq])
                seen.append(j)
            pad = seg == 0
            assert not b["features"][r, pad].any() and not b["hidden"][r, pad].any()
    assert sorted(seen) == mine
