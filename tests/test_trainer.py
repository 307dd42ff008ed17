"""Trainer: sharded step == single-device step, kill-and-resume == uninterrupted, config,
schedule, weight-decay mask, sharding rules, metrics and plots, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle_jax.train import build_job, load_config, main
from eagle_jax.training import sharding
from eagle_jax.training.metrics import plot_metrics, read_metrics
from eagle_jax.training.trainer import TrainConfig, Trainer, make_schedule, maybe_initialize_distributed, \
    weight_decay_mask

try:
    import matplotlib  # noqa: F401

    _HAVE_MPL = True
except ImportError:  # plots are skipped (with a warning) without it
    _HAVE_MPL = False

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "trainer_worker.py"
TOY = ROOT / "configs" / "train" / "toy.json"


def _run_worker(*args, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


# ------------------------------------------------------------------------------ sharded == single
def test_sharded_step_matches_single_device(tmp_path):
    out = tmp_path / "sharded.npz"
    proc = _run_worker("sharded", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    assert int(got["mesh/split_count"]) >= 9, "the 2×2×2 mesh should split most head params"
    np.testing.assert_allclose(got["mesh/loss"], got["single/loss"], rtol=1e-6)
    np.testing.assert_allclose(got["mesh/grad_norm"], got["single/grad_norm"], rtol=1e-6)
    names = [k[len("single/"):] for k in got.files if k.startswith("single/[")]
    assert len(names) == int(got["mesh/total_count"])
    for name in names:
        a, b = got[f"single/{name}"], got[f"mesh/{name}"]
        scale = np.max(np.abs(a))
        assert np.max(np.abs(a - b)) <= 1e-6 * scale, name


# ------------------------------------------------------------------------------ kill and resume
class Recorder:
    """Wraps a data iterator, remembering what each step consumed."""

    def __init__(self, it):
        self.it, self.seen = it, []

    def __next__(self):
        b = next(self.it)
        self.seen.append(b["input_ids"].copy())
        return b

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)


def _toy_config(out_dir, total=8, save_every=2):
    return load_config(str(TOY), [f"train.output_dir={json.dumps(str(out_dir))}", f"train.total_steps={total}",
                                  f"train.save_every={save_every}", "train.warmup_steps=2", "train.log_every=1",
                                  "train.eval_every=4", "train.progress=false", "train.batch_size=8",
                                  "train.seq_len=16", "data.num_sequences=64", "model.rollout_steps=2"])


def _trainer(config, hooks=()):
    params, aux, loss_fn, train_iter, eval_fn = build_job(config)
    rec = Recorder(train_iter)
    return Trainer(TrainConfig.from_dict(config["train"]), params, aux, loss_fn, rec, eval_fn, hooks=hooks), rec


def test_eval_at_start_logs_the_starting_params(tmp_path):
    cfg = _toy_config(tmp_path / "r", total=4)
    cfg["train"]["eval_at_start"] = True
    tr, _ = _trainer(cfg)
    before = tr.eval_fn(tr.state.params, tr.aux)
    tr.run()
    tr.close()
    evals = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4]
    assert evals[0]["loss"] == pytest.approx(float(before["loss"]), rel=1e-6) and evals[1]["loss"] < evals[0]["loss"]


def test_kill_and_resume_is_exact(tmp_path):
    # the run to be killed: a separate process that SIGKILLs itself after step 5 (checkpoint 4 on disk)
    killed_cfg = _toy_config(tmp_path / "killed")
    cfg_path = tmp_path / "killed.json"
    cfg_path.write_text(json.dumps(killed_cfg))
    proc = _run_worker("kill", cfg_path, 5)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"killed_at": 5, "saved": [2, 4]}

    # the uninterrupted reference run
    ref, ref_rec = _trainer(_toy_config(tmp_path / "ref"))
    assert ref.restored_step == 0
    ref.run()
    ref.close()

    resumed, rec = _trainer(killed_cfg)
    assert resumed.restored_step == 4
    resumed.run()
    resumed.close()

    assert resumed.step_count == ref.step_count == 8
    for a, b in zip(ref_rec.seen[4:], rec.seen, strict=True):  # same batches, in the same order
        np.testing.assert_array_equal(a, b)
    flat_ref = jax.tree_util.tree_leaves_with_path(jax.device_get(ref.params))
    flat_res = jax.tree_util.tree_leaves(jax.device_get(resumed.params))
    for (path, a), b in zip(flat_ref, flat_res, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    opt_ref = jax.tree_util.tree_leaves(jax.device_get(ref.state.opt_state))
    for a, b in zip(opt_ref, jax.tree_util.tree_leaves(jax.device_get(resumed.state.opt_state)), strict=True):
        np.testing.assert_array_equal(a, b)

    # the killed run's log is trimmed to the checkpoint, then continued: each step once
    steps = [r["step"] for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, 9))
    ref_train = [r for r in read_metrics(tmp_path / "ref" / "metrics.jsonl") if r["split"] == "train"]
    res_train = [r for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if r["split"] == "train"]
    assert [r["loss"] for r in ref_train] == [r["loss"] for r in res_train]

    # metrics and plots of the reference run
    records = read_metrics(tmp_path / "ref" / "metrics.jsonl")
    assert {"loss", "acc_0", "acc_1", "lr", "grad_norm"} <= set(records[0])
    assert [r["step"] for r in records if r["split"] == "eval"] == [4, 8]
    for name in ("loss.png", "accuracy.png", "lr.png") if _HAVE_MPL else ():
        png = tmp_path / "ref" / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000, name


def test_stop_at_step_then_continue_equals_one_run(tmp_path):
    ref, _ = _trainer(_toy_config(tmp_path / "ref", total=6, save_every=3))
    ref.run()
    ref.close()
    part_cfg = _toy_config(tmp_path / "part", total=6, save_every=3)
    part_cfg["train"]["stop_at_step"] = 3
    part, _ = _trainer(part_cfg)
    part.run()
    part.close()
    assert part.step_count == 3
    part_cfg["train"]["stop_at_step"] = None
    rest, _ = _trainer(part_cfg)
    assert rest.restored_step == 3
    rest.run()
    rest.close()
    assert rest.step_count == 6
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(ref.params)),
                    jax.tree_util.tree_leaves(jax.device_get(rest.params)), strict=True):
        np.testing.assert_array_equal(a, b)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "part" / "metrics.jsonl") if r["split"] == "train"]
    ref_lrs = [r["lr"] for r in read_metrics(tmp_path / "ref" / "metrics.jsonl") if r["split"] == "train"]
    assert lrs == ref_lrs  # the schedule spans total_steps whatever the stop
    steps_per_s = [r["steps_per_s"] for r in read_metrics(tmp_path / "ref" / "metrics.jsonl") if r["split"] == "train"]
    assert all(0 < v < 1e4 for v in steps_per_s)


def test_failing_final_eval_still_leaves_the_final_checkpoint(tmp_path):
    """The last save comes before the final eval: an eval that crashes at the end (out of memory on a
    pod, say) loses no steps; a rerun resumes at the last step."""
    cfg = _toy_config(tmp_path / "r", total=3, save_every=100)
    cfg["train"]["eval_every"] = 0  # evaluated only after the last step
    tr, _ = _trainer(cfg)

    def crash(params, aux):
        raise RuntimeError("eval ran out of memory")

    tr.eval_fn = crash
    with pytest.raises(RuntimeError, match="out of memory"):
        tr.run()
    tr.close()
    rest, _ = _trainer(cfg)
    assert rest.restored_step == 3
    rest.close()


def test_max_seconds_ends_the_run_saved_and_a_rerun_continues(tmp_path):
    cfg = _toy_config(tmp_path / "r", total=6, save_every=100)
    cfg["train"]["max_seconds"] = 1e-9  # out of time at the first check (step 1: log_every is 1)
    tr, _ = _trainer(cfg)
    tr.run()
    tr.close()
    assert tr.stopped_early and tr.step_count == 1
    evals = [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if r["split"] == "eval"]
    assert evals == [1]  # evaluated at the stop, as at an end
    cfg["train"]["max_seconds"] = None  # bookkeeping: changing it does not warn or restart
    rest, _ = _trainer(cfg)
    assert rest.restored_step == 1  # saved at the stop although save_every was never reached
    rest.run()
    rest.close()
    assert rest.step_count == 6 and not rest.stopped_early
    with pytest.raises(ValueError, match="max_seconds"):
        TrainConfig(max_seconds=0)


# ------------------------------------------------------------------------------ two processes
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_process_run(tmp_path, total_steps):
    """The CLI as two JAX processes (4 CPU devices each) joined through JAX_COORDINATOR_ADDRESS."""
    port = _free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
               "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
               "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip(),
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
        args = ["--config", str(TOY), "--output-dir", str(tmp_path / f"out{i}"), "--set", "train.mesh=[2,2,2]",
                "--set", f"train.checkpoint_dir={json.dumps(str(tmp_path / 'ckpt'))}", "--set", "train.save_every=2",
                "--set", f"train.total_steps={total_steps}", "--set", "train.warmup_steps=1", "--set",
                "train.progress=false", "--set", "train.plot=false", "--set", "model.rollout_steps=1",
                "--set", "data.eval_batches=0"]
        procs.append(subprocess.Popen([sys.executable, "-m", "eagle_jax.train", *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


@pytest.mark.slow  # two JAX processes over gloo, twice: the longest test here
def test_two_processes_train_save_and_resume(tmp_path):
    outs = _two_process_run(tmp_path, 2)
    summary = json.loads(outs[0][0].strip().splitlines()[-1])
    assert summary["processes"] == 2 and summary["devices"] == 8 and summary["step"] == 2
    assert not any(line.startswith("{") for line in outs[1][0].splitlines())  # process 0 reports,
    assert not (tmp_path / "out1" / "metrics.jsonl").exists()  # and writes the metrics
    data = json.loads((tmp_path / "ckpt" / "2" / "data" / "metadata").read_text())
    assert data == {"process_count": 2, "states": [{"next_index": 2}, {"next_index": 2}]}
    outs = _two_process_run(tmp_path, 4)
    assert all("resumed from step 2" in err for _, err in outs)
    assert json.loads(outs[0][0].strip().splitlines()[-1])["step"] == 4


# ------------------------------------------------------------------------------ config and optimizer
def test_config_rejects_unknown_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown train config keys.*learnig_rate"):
        TrainConfig.from_dict({"learnig_rate": 1e-3})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        TrainConfig.from_dict({"mesh": {"data": 2, "model": 2}})
    assert TrainConfig.from_dict({"mesh": {"fsdp": 4}}).mesh == (1, 4, 1)
    cfg = TrainConfig(decay="linear", mesh=[2, 2, 2])
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="decay"):
        TrainConfig(decay="exp")
    with pytest.raises(ValueError, match="unknown config sections"):
        load_config(str(TOY), ["optimizer.lr=1"])
    with pytest.raises(ValueError, match="unknown train config keys"):
        load_config(str(TOY), ["train.lr=1"])
    with pytest.raises(ValueError, match="unknown model keys"):
        build_job(load_config(str(TOY), ["model.depth=3"]))


def test_schedule_warmup_then_decay():
    base = dict(learning_rate=1.0, warmup_steps=4, total_steps=14, end_lr_ratio=0.1)
    lr = lambda decay, s: float(make_schedule(TrainConfig(decay=decay, **base))(s))
    for decay in ("cosine", "linear", "constant"):
        assert [lr(decay, s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
        assert lr(decay, 4) == pytest.approx(1.0)
    assert lr("cosine", 9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr("linear", 9) == pytest.approx(0.55)
    assert lr("cosine", 14) == pytest.approx(0.1) and lr("linear", 14) == pytest.approx(0.1)
    assert lr("cosine", 100) == pytest.approx(0.1)
    assert lr("constant", 14) == pytest.approx(1.0)
    no_warm = make_schedule(TrainConfig(learning_rate=2.0, warmup_steps=0, total_steps=10, decay="linear"))
    assert float(no_warm(0)) == pytest.approx(2.0) and float(no_warm(10)) == pytest.approx(0.0)


def test_weight_decay_mask_skips_norms_and_biases():
    params = {"fc": {"kernel": 1, "bias": 1}, "norm": {"scale": 1}, "lm_head": {"kernel": 1},
              "layers": {"input_layernorm": {"scale": 1}, "self_attn": {"q_norm": {"scale": 1},
                                                                        "q_proj": {"kernel": 1, "bias": 1}}},
              "embed_tokens": {"embedding": 1}}
    assert weight_decay_mask(params) == {
        "fc": {"kernel": True, "bias": False}, "norm": {"scale": False}, "lm_head": {"kernel": True},
        "layers": {"input_layernorm": {"scale": False}, "self_attn": {"q_norm": {"scale": False},
                                                                      "q_proj": {"kernel": True, "bias": False}}},
        "embed_tokens": {"embedding": True}}


# ------------------------------------------------------------------------------ sharding rules
def test_param_logical_axes_for_heads_and_target():
    from eagle_jax.draft import DraftConfig, init_head
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.decoder import init_params

    target = ModelConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=8, tie_word_embeddings=False, qkv_bias=True, qk_norm=True)
    shapes = jax.eval_shape(lambda k: init_params(target, k), jax.random.key(0))
    axes = sharding.param_logical_axes(shapes)
    assert axes["layers"]["self_attn"]["q_proj"]["kernel"] == ("layers", "embed", "heads")
    assert axes["layers"]["self_attn"]["k_proj"]["bias"] == ("layers", "kv_heads")
    assert axes["layers"]["self_attn"]["q_norm"]["scale"] == ("layers", "head_dim")
    assert axes["layers"]["mlp"]["down_proj"]["kernel"] == ("layers", "mlp", "embed")
    assert axes["embed_tokens"]["embedding"] == ("vocab", "embed")
    assert axes["lm_head"]["kernel"] == ("embed", "vocab")
    for kind in ("eagle1", "eagle3"):
        cfg = DraftConfig.for_target(kind, target, draft_vocab_size=64)
        head = jax.eval_shape(lambda k: init_head(cfg, k).params, jax.random.key(0))
        axes = sharding.param_logical_axes(head)
        assert axes["fc"]["kernel"] == ("features", "embed")
        mid = "midlayer" if kind == "eagle3" else "layer"
        assert axes[mid]["self_attn"]["o_proj"]["kernel"] == ("heads", "embed")
        assert axes[mid]["post_attention_layernorm"]["scale"] == ("norm",)
    assert sharding.param_logical_axes({"d2t": np.zeros(4)}) == {"d2t": ("vocab_map",)}
    with pytest.raises(ValueError, match="no logical-axis rule for parameter 'mlp/w1/kernel'"):
        sharding.param_logical_axes({"mlp": {"w1": {"kernel": np.zeros((2, 2))}}})
    with pytest.raises(ValueError, match="rank 3"):
        sharding.param_logical_axes({"fc": {"kernel": np.zeros((2, 2, 2))}})


def test_logical_to_spec_and_mesh_shapes():
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    P = jax.sharding.PartitionSpec
    assert sharding.logical_to_spec(("embed", "heads"), (64, 64), mesh) == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("batch", "seq"), (8, 16), mesh) == P(("data", "fsdp"), None)
    assert sharding.logical_to_spec(("vocab", "embed"), (101, 64), mesh) == P(None, "fsdp")  # 101 % 2: whole
    assert sharding.logical_to_spec(("batch", "seq"), (8, 16), {"data": 8, "fsdp": 1, "tensor": 1}) == P("data", None)
    with pytest.raises(KeyError, match="no rule"):
        sharding.logical_to_spec(("nope",), (4,), mesh)
    with pytest.raises(ValueError, match="twice"):
        sharding.logical_to_spec(("heads", "mlp"), (4, 4), mesh)
    assert sharding.resolve_mesh_shape((-1, 2, 2), 8) == (2, 2, 2)
    assert sharding.resolve_mesh_shape((1, -1, 1), 1) == (1, 1, 1)
    with pytest.raises(sharding.MeshConfigError, match="needs 8 devices, but 1"):
        sharding.resolve_mesh_shape((2, 2, 2), 1)
    with pytest.raises(sharding.MeshConfigError, match="at most one -1"):
        sharding.resolve_mesh_shape((-1, -1, 1), 4)
    with pytest.raises(sharding.MeshConfigError, match="not a multiple"):
        sharding.resolve_mesh_shape((-1, 3, 1), 4)


def test_distributed_init_only_when_asked():
    assert maybe_initialize_distributed({}) is False
    assert maybe_initialize_distributed({"EAGLE_JAX_DISTRIBUTED": "0", "SLURM_NTASKS": "4"}) is False
    assert maybe_initialize_distributed({"TPU_WORKER_HOSTNAMES": "localhost"}) is False  # one host


# ------------------------------------------------------------------------------ metrics, plots, CLI
def test_plots_from_metrics_jsonl(tmp_path):
    pytest.importorskip("matplotlib")
    lines = [{"step": s, "split": "train", "loss": 3.0 / s, "acc_0": 0.5, "acc_1": 0.3, "lr": 0.1} for s in (1, 2, 3)]
    lines.append({"step": 3, "split": "eval", "loss": 1.2, "acc_0": 0.45, "acc_1": 0.25})
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "spl')  # torn last line
    written = plot_metrics(path, tmp_path / "plots")
    assert sorted(p.name for p in written) == ["accuracy.png", "loss.png", "lr.png"]
    assert all(p.stat().st_size > 1000 for p in written)


def test_cli_runs_the_toy_job(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["--config", str(TOY), "--output-dir", str(out), "--set", "train.total_steps=3",
                 "--set", "train.warmup_steps=1", "--set", "train.save_every=0", "--set", "train.progress=false",
                 "--set", "train.plot=false", "--set", "train.eval_every=0"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 3 and summary["train"]["step"] == 3 and "acc_2" in summary["eval"]
    assert json.loads((out / "config.json").read_text())["total_steps"] == 3
    assert not (out / "checkpoints").exists()


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "train").glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    """A recipe's config must at least parse: known sections, a job, a valid train section, and data
    files that the repository ships (train/data/…) present."""
    config = load_config(str(path))
    train = config["data"].get("train", []) if "data" in config else []
    for f in [train] if isinstance(train, str) else train:
        if f.startswith("train/data/"):
            assert (ROOT / f).is_file(), f"{path.name}: {f} is not in the repository"
