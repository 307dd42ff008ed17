"""End to end on the tiny target: conversations → `python -m eagle_jax.train` (eagle1 and eagle3,
online and offline features, padded or packed rows) → exported head in the released layout →
lossless speculative decoding with it."""

import json

import numpy as np
import pytest

from eagle_jax import train
from eagle_jax.draft import load_drafter
from eagle_jax.engine import Engine
from eagle_jax.training.data import load_examples
from eagle_jax.training.vocab import count_tokens


def _conversations(path, rng, n=24):
    with open(path, "w") as f:
        for i in range(n):
            q = " ".join(f"w{t}" for t in rng.integers(5, 60, 4))
            a = " ".join(f"w{t}" for t in rng.integers(5, 60, 12))
            f.write(json.dumps({"id": i, "conversations": [{"from": "human", "value": q},
                                                             {"from": "gpt", "value": a}]}) + "\n")
        f.write("{not json\n")  # reported with its line number and skipped


@pytest.mark.parametrize("kind,features,pack", [("eagle1", "online", False), ("eagle3", "offline", False),
                                                ("eagle3", "online", True), ("eagle1", "offline", True)])
def test_train_export_and_decode(tiny_hf_dir, tmp_path, rng, kind, features, pack, capsys):
    data = tmp_path / "train.jsonl"
    _conversations(data, rng)
    cfg = {
        "job": kind,
        "model": {"target": str(tiny_hf_dir), "draft_vocab_size": 48},
        "data": {"train": str(data), "eval": str(data), "max_len": 40, "features": features,
                 "feature_dir": str(tmp_path / "feats"), "eval_batches": 1, "pack": pack},
        "objective": {"ttt_length": 2} if kind == "eagle3" else {"noise": 0.1},
        "train": {"learning_rate": 1e-3, "warmup_steps": 1, "total_steps": 3, "batch_size": 4, "seq_len": 40,
                  "output_dir": str(tmp_path / "run"), "save_every": 2, "log_every": 1, "eval_every": 3,
                  "progress": False},
        "export": {"path": str(tmp_path / "head"), "dtype": "float32"},
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert train.main(["--config", str(tmp_path / "cfg.json")]) == 0
    out = capsys.readouterr()
    assert "train.jsonl:25" in out.err  # the malformed line, by number
    assert ("packing: 24 conversations in" in out.err) == pack
    summary = json.loads(out.out.splitlines()[-1])
    assert summary["step"] == 3 and np.isfinite(summary["train"]["loss"])
    assert "acc_0" in summary["eval"]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["split"] == "train"] == [1, 2, 3]

    engine = Engine(str(tiny_hf_dir), progress=False)
    head = load_drafter(tmp_path / "head", engine.cfg)
    assert head.cfg.kind == kind
    method = "eagle3" if kind == "eagle3" else "eagle2"
    engine.add_method(method, head)
    prompt = engine.encode("w7 w8 w9")
    assert engine.generate_ids(prompt, 16, method=method).tokens == engine.generate_ids(prompt, 16).tokens


@pytest.mark.parametrize("rebuild", [False, True])
def test_warm_start_keeps_or_rebuilds_draft_vocab(tiny_hf_dir, tmp_path, rng, capsys, rebuild):
    """`init_from` keeps the head's draft vocabulary (and builds none: the log gives the kept one's
    coverage of the run's data); with `rebuild_vocab` the run's data builds a new one (of
    draft_vocab_size) and the trained LM-head columns of shared tokens carry over."""
    import jax

    from eagle_jax.draft import DraftConfig, init_head, save_drafter
    from eagle_jax.training.eagle_job import eagle_job

    engine = Engine(str(tiny_hf_dir), progress=False)
    old_ids = np.sort(rng.choice(np.arange(engine.cfg.vocab_size), 48, replace=False))
    old = init_head(DraftConfig.for_target("eagle3", engine.cfg, draft_vocab_size=48), jax.random.PRNGKey(1),
                    d2t=old_ids - np.arange(48))
    save_drafter(tmp_path / "old", old, engine.cfg, dtype="float32")
    data = tmp_path / "train.jsonl"
    _conversations(data, rng)
    cfg = {"job": "eagle3",
           "model": {"target": str(tiny_hf_dir), "draft_vocab_size": 40, "init_from": str(tmp_path / "old"),
                     "rebuild_vocab": rebuild},
           "data": {"train": str(data), "max_len": 40},
           "train": {"batch_size": 4, "seq_len": 40, "output_dir": str(tmp_path / "run")}}
    params, aux, *_ = eagle_job(cfg)
    log = capsys.readouterr().err
    old_w = np.asarray(old.params["lm_head"]["kernel"])
    if not rebuild:
        np.testing.assert_array_equal(np.asarray(aux["d2t"]), np.asarray(old.d2t))
        np.testing.assert_array_equal(np.asarray(params["lm_head"]["kernel"]), old_w)
        assert not (tmp_path / "run" / "draft_vocab.npz").exists()
        counts = count_tokens(load_examples(str(data), engine.tokenizer, 40), engine.cfg.vocab_size,
                              assistant_only=True)
        share = counts[old_ids].sum() / counts.sum()
        assert 0 < share < 1
        assert f"the 48 tokens of {tmp_path / 'old'} kept; they cover {share:.1%} of this data's" in log
        return
    assert "tokens kept; they cover" not in log
    built = np.load(tmp_path / "run" / "draft_vocab.npz")["d2t"]
    np.testing.assert_array_equal(np.asarray(aux["d2t"]), built)
    new_ids = np.arange(40) + built
    w = np.asarray(params["lm_head"]["kernel"])
    assert w.shape == (engine.cfg.hidden_size, 40)
    shared = np.flatnonzero(np.isin(new_ids, old_ids))
    assert 0 < len(shared) < 40
    for j in shared:
        np.testing.assert_array_equal(w[:, j], old_w[:, int(np.flatnonzero(old_ids == new_ids[j])[0])])
    assert np.all(np.linalg.norm(w, axis=0) > 0)
    np.testing.assert_array_equal(np.asarray(params["fc"]["kernel"]), np.asarray(old.params["fc"]["kernel"]))


def test_eagle1_eval_has_no_training_noise(tiny_hf_dir, tmp_path, rng):
    """The held-out loss and accuracy measure the head, not the head under the training feature
    noise: with noise 0.5 the eval gives exactly the numbers of a run without noise, while the
    training loss does see the noise."""
    import jax

    from eagle_jax.training.eagle_job import eagle_job

    data = tmp_path / "train.jsonl"
    _conversations(data, rng, n=8)

    def job(noise):
        cfg = {"job": "eagle1", "model": {"target": str(tiny_hf_dir)},
               "data": {"train": str(data), "eval": str(data), "max_len": 40, "eval_batches": 1},
               "objective": {"noise": noise},
               "train": {"batch_size": 4, "seq_len": 40, "output_dir": str(tmp_path / f"run{noise}")}}
        return eagle_job(cfg)

    params, aux, noisy_loss, train_iter, noisy_eval = job(0.5)
    params0, _, clean_loss, _, clean_eval = job(0.0)
    batch, key = next(train_iter), jax.random.PRNGKey(0)
    assert float(noisy_loss(params, aux, batch, key)[0]) != float(clean_loss(params, aux, batch, key)[0])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, params0))  # same init
    got = noisy_eval(params, aux)
    assert set(got) >= {"loss", "acc_0", "vloss"} and got == clean_eval(params, aux)
