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


def _eagle3_config(tiny_hf_dir, tmp_path, data, **train):
    return {"job": "eagle3", "model": {"target": str(tiny_hf_dir), "draft_vocab_size": 48},
            "data": {"train": str(data), "max_len": 40}, "objective": {"ttt_length": 1},
            "train": {"learning_rate": 1e-3, "warmup_steps": 1, "total_steps": 2, "batch_size": 4, "seq_len": 40,
                      "output_dir": str(tmp_path / "run"), "save_every": 1, "log_every": 1, "progress": False,
                      "plot": False, **train}}


def test_stale_draft_vocab_npz_is_refused(tiny_hf_dir, tmp_path, rng):
    """A draft_vocab.npz of another size than model.draft_vocab_size (left by a run with another size)
    is an error naming the file, not a shape error later."""
    from eagle_jax.training.eagle_job import eagle_job

    data = tmp_path / "train.jsonl"
    _conversations(data, rng, n=8)
    (tmp_path / "run").mkdir()
    np.savez(tmp_path / "run" / "draft_vocab.npz", d2t=np.zeros(30, np.int64), counts=np.ones(101))
    with pytest.raises(ValueError, match=r"draft_vocab\.npz holds a draft vocabulary of 30 tokens, but "
                                         r"model\.draft_vocab_size is 48"):
        eagle_job(_eagle3_config(tiny_hf_dir, tmp_path, data))


def test_resume_refuses_another_draft_vocab(tiny_hf_dir, tmp_path, rng, capsys):
    """The checkpoint pins the draft vocabulary it was trained with: a resume whose draft_vocab.npz
    maps the LM-head columns to other tokens (rebuilt from changed data, replaced) is refused; with
    the original one it resumes."""
    data = tmp_path / "train.jsonl"
    _conversations(data, rng, n=8)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(_eagle3_config(tiny_hf_dir, tmp_path, data, stop_at_step=1)))
    assert train.main(["--config", str(cfg_path)]) == 0
    npz = tmp_path / "run" / "draft_vocab.npz"
    saved = dict(np.load(npz))
    ids = np.arange(48) + saved["d2t"]
    ids[[0, 1]] = ids[[1, 0]]  # two columns now mean each other's token: same size, other vocabulary
    np.savez(npz, **{**saved, "d2t": ids - np.arange(48)})
    cfg_path.write_text(json.dumps(_eagle3_config(tiny_hf_dir, tmp_path, data)))
    with pytest.raises(ValueError, match=r"checkpoint step 1 .* trained with other values of aux \['d2t'\]"):
        train.main(["--config", str(cfg_path)])
    np.savez(npz, **saved)
    capsys.readouterr()
    assert train.main(["--config", str(cfg_path)]) == 0
    out = capsys.readouterr()
    assert "resumed from step 1" in out.err and json.loads(out.out.splitlines()[-1])["step"] == 2


_FSDP_EXPORT = """
import json, sys
import jax, numpy as np
from eagle_jax import train
from eagle_jax.training import eagle_job as ej

seen, trainers = {}, []
export_head = ej.export_head

def spy(params, aux, *args, **kwargs):
    seen["params"] = params
    return export_head(params, aux, *args, **kwargs)

class Recording(train.Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        trainers.append(self)

ej.export_head, train.Trainer = spy, Recording
assert train.main(["--config", sys.argv[1]]) == 0
leaves = jax.tree_util.tree_leaves(trainers[0].params)
got = jax.tree_util.tree_leaves(seen["params"])
from eagle_jax.draft import load_drafter
from eagle_jax.models.checkpoint import load_hf_dir
cfg = json.load(open(sys.argv[1]))
head = load_drafter(cfg["export"]["path"], load_hf_dir(cfg["model"]["target"])[0])


def flat(tree):
    leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(tree))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


trained, exported = flat(trainers[0].params), flat(head.params)
print(json.dumps({"devices": jax.device_count(), "split": sum(not x.sharding.is_fully_replicated for x in leaves),
                  "host": all(type(x) is np.ndarray for x in got),
                  "same": len(got) == len(leaves) and all(np.array_equal(np.asarray(a), jax.device_get(b))
                                                          for a, b in zip(got, leaves)),
                  "exported": sorted(k for k in trained if k in exported and np.array_equal(trained[k], exported[k])),
                  "trained": sorted(trained)}))
"""


def test_export_gathers_fsdp_sharded_params(tiny_hf_dir, tmp_path, rng):
    """With the params split over 8 devices (FSDP), the export gets them gathered to whole host arrays
    (on a pod, process 0 cannot read shards on other hosts' devices: every process joins the gather)
    with the trained values, and the exported head holds them."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "train.jsonl"
    _conversations(data, rng, n=16)
    cfg = _eagle3_config(tiny_hf_dir, tmp_path, data, batch_size=8, mesh=[1, 8, 1])
    cfg["export"] = {"path": str(tmp_path / "head"), "dtype": "float32"}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "run_export.py").write_text(_FSDP_EXPORT)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
    proc = subprocess.run([sys.executable, str(tmp_path / "run_export.py"), str(tmp_path / "cfg.json")],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["devices"] == 8 and got["split"] > 0, got  # the export path really met split params
    assert got["host"] and got["same"], got
    assert got["exported"] == got["trained"], got  # the exported file holds the trained weights
