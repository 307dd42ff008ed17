"""`python -m eagle_jax.train --config configs/train/X.json [--set section.key=value ...]`

A training config is one JSON object:
  {"job": "toy" | ..., "train": {TrainConfig fields}, "data": {...}, "model": {...}}
`train` goes to the generic `Trainer`; `build_job(config)` turns the other sections into what the
trainer trains: `(params, aux, loss_fn, train_iter, eval_fn)`. `--set` edits any key before the
config is used (`--set train.total_steps=50 --set train.mesh=[2,2,2]`; values are JSON, anything
else is a string). The last stdout line is a JSON summary of the run; progress goes to stderr.

The `toy` job is a tiny self-contained problem in the shape of an EAGLE head's training (frozen
embedding in `aux`, fc → residual SwiGLU block rolled out n steps → norm → lm_head, `acc_i` per
rollout step) used by the tests and the CPU recipe to exercise the trainer end to end.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .training.sharding import take_embedding, with_logical_constraint
from .training.trainer import TrainConfig, Trainer, maybe_initialize_distributed

SECTIONS = ("job", "train", "data", "model", "objective", "export", "description")


# ------------------------------------------------------------------------------ config
def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    """`["train.total_steps=50", "model.hidden_size=64"]` applied to a copy of `config`."""
    config = json.loads(json.dumps(config))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set wants KEY=VALUE, got {item!r}")
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {key}: {p!r} is not a section")
        node[leaf] = _parse_value(value)
    return config


def load_config(path: Optional[str], overrides: list[str] = ()) -> dict:
    config = json.loads(Path(path).read_text()) if path else {}
    config = apply_overrides(config, list(overrides))
    unknown = sorted(set(config) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config sections {unknown}; known: {list(SECTIONS)}")
    if "job" not in config:
        raise ValueError('the config needs a "job" (e.g. "toy")')
    TrainConfig.from_dict(config.get("train", {}))  # fail on a bad train section before any work
    return config


def _section(config: dict, name: str, defaults: Mapping[str, Any]) -> dict:
    got = dict(config.get(name, {}))
    unknown = sorted(set(got) - set(defaults))
    if unknown:
        raise ValueError(f"unknown {name} keys for job {config['job']!r}: {unknown}; known: {sorted(defaults)}")
    return {**defaults, **got}


# ------------------------------------------------------------------------------ the toy job
TOY_MODEL = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 64, "rollout_steps": 3, "noise": 0.05}
TOY_DATA = {"num_sequences": 512, "multiplier": 5, "offset": 3, "eval_batches": 1}


def _rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def toy_params(model: Mapping[str, Any], key) -> tuple[dict, dict]:
    """(trainable params named like a draft head's, frozen aux with a target embedding)."""
    v, d, m = model["vocab_size"], model["hidden_size"], model["intermediate_size"]
    k = jax.random.split(key, 6)
    w = lambda kk, *s: np.asarray(jax.random.normal(kk, s, jnp.float32) / np.sqrt(s[0]))
    params = {
        "fc": {"kernel": w(k[0], d, d), "bias": np.zeros((d,), np.float32)},
        "mlp": {"gate_proj": {"kernel": w(k[1], d, m)}, "up_proj": {"kernel": w(k[2], d, m)},
                "down_proj": {"kernel": 0.1 * w(k[3], m, d)}},
        "norm": {"scale": np.ones((d,), np.float32)},
        "lm_head": {"kernel": w(k[4], d, v)},
    }
    aux = {"target": {"embed_tokens": {"embedding": w(k[5], v, d)}}}
    return params, aux


def make_toy_loss(model: Mapping[str, Any]) -> Callable:
    """Roll a residual SwiGLU block n steps from fc(embed(t_k)); step j predicts t_{k+1+j}."""
    n, noise = model["rollout_steps"], model["noise"]

    def loss_fn(params, aux, batch, rng):
        ids_bl, mask_bl, lengths_b = batch["input_ids"], batch["loss_mask"], batch["lengths"]
        b, l = ids_bl.shape
        emb_bld = take_embedding(aux["target"]["embed_tokens"]["embedding"], ids_bl)
        h_bld = emb_bld @ params["fc"]["kernel"] + params["fc"]["bias"]
        h_bld = h_bld + noise * jax.random.uniform(rng, h_bld.shape, minval=-1.0, maxval=1.0)
        pos_l = jnp.arange(l)
        mlp, scale = params["mlp"], params["norm"]["scale"]
        total, metrics = 0.0, {}
        for j in range(n):
            x = _rms_norm(h_bld, scale)
            h_bld = h_bld + (jax.nn.silu(x @ mlp["gate_proj"]["kernel"]) * (x @ mlp["up_proj"]["kernel"])) \
                @ mlp["down_proj"]["kernel"]
            h_bld = with_logical_constraint(h_bld, ("batch", "seq", "act_embed"))
            logits_blv = _rms_norm(h_bld, scale) @ params["lm_head"]["kernel"]
            tgt_bl = jnp.roll(ids_bl, -(j + 1), axis=1)
            valid_bl = (pos_l[None] + j + 1 < lengths_b[:, None]) * jnp.roll(mask_bl, -(j + 1), axis=1)
            denom = jnp.maximum(valid_bl.sum(), 1.0)
            ce_bl = -jnp.take_along_axis(jax.nn.log_softmax(logits_blv), tgt_bl[..., None], axis=-1)[..., 0]
            ploss = (ce_bl * valid_bl).sum() / denom
            metrics[f"ploss_{j}"] = ploss
            metrics[f"acc_{j}"] = ((logits_blv.argmax(-1) == tgt_bl) * valid_bl).sum() / denom
            total = total + ploss / n
        return total, metrics

    return loss_fn


class _ToySequences:
    """Example i: a start token from an index-seeded generator, then t_{k+1} = (a·t_k + c) mod V,
    padded to seq_len after a length in [L/2, L]."""

    def __init__(self, vocab: int, seq_len: int, a: int, c: int, seed: int):
        self.v, self.l, self.a, self.c, self.seed = vocab, seq_len, a, c, seed

    def __call__(self, i: int) -> dict:
        g = np.random.default_rng([self.seed, int(i)])
        length = int(g.integers(self.l // 2, self.l + 1))
        ids = np.zeros(self.l, np.int32)
        ids[0] = g.integers(self.v)
        for k in range(1, length):
            ids[k] = (self.a * ids[k - 1] + self.c) % self.v
        mask = (np.arange(self.l) < length).astype(np.float32)
        return {"input_ids": ids, "loss_mask": mask, "lengths": np.int32(length)}


def toy_dataset(data: Mapping[str, Any], vocab: int, batch_size: int, seq_len: int, seed: int,
                per_process: bool = True):
    """A grain pipeline: shuffled, repeated, batched examples; with `per_process` this process's
    share of the examples in batches of its share of the rows."""
    import grain

    make = _ToySequences(vocab, seq_len, data["multiplier"], data["offset"], seed)
    ds = grain.MapDataset.range(data["num_sequences"])
    n = jax.process_count() if per_process else 1
    if per_process:
        ds = ds[jax.process_index()::n]
    return iter(ds.shuffle(seed=seed).repeat().map(make).batch(batch_size // n, drop_remainder=True))


def toy_job(config: dict):
    train = TrainConfig.from_dict(config.get("train", {}))
    model, data = _section(config, "model", TOY_MODEL), _section(config, "data", TOY_DATA)
    params, aux = toy_params(model, jax.random.key(train.seed))
    loss_fn = make_toy_loss(model)
    train_iter = toy_dataset(data, model["vocab_size"], train.batch_size, train.seq_len, train.seed)
    # held-out sequences: another generator seed, so no training example repeats
    if not data["eval_batches"]:
        return params, aux, loss_fn, train_iter, None
    held = toy_dataset(data, model["vocab_size"], train.batch_size, train.seq_len, train.seed + 7919,
                       per_process=False)
    eval_batches = [next(held) for _ in range(data["eval_batches"])]
    eval_loss = jax.jit(loss_fn)

    def eval_fn(params, aux):
        # whole batches, the same on every process (jit treats host arrays as replicated values)
        outs = [eval_loss(params, aux, b, jax.random.key(0)) for b in eval_batches]
        return {k: float(np.mean([jax.device_get(o[1][k]) for o in outs])) for k in outs[0][1]} | {
            "loss": float(np.mean([jax.device_get(o[0]) for o in outs]))}

    return params, aux, loss_fn, train_iter, eval_fn


# ------------------------------------------------------------------------------ the hook
def _eagle_job(config: dict):
    from .training.eagle_job import eagle_job

    return eagle_job(config)


JOBS: dict[str, Callable[[dict], tuple]] = {"toy": toy_job, "eagle1": _eagle_job, "eagle3": _eagle_job}


def build_job(config: dict):
    """`(params, aux, loss_fn, train_iter, eval_fn)` for the config's `job`.

    params: trainable pytree; aux: frozen pytree handed to the loss; loss_fn(params, aux, batch,
    rng) -> (loss, metrics); train_iter: this process's numpy batches (with get_state/set_state to
    resume exactly); eval_fn(params, aux) -> metrics, or None.
    """
    job = config.get("job")
    if job not in JOBS:
        raise ValueError(f"unknown job {job!r}; known jobs: {sorted(JOBS)}")
    return JOBS[job](config)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_jax.train", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="training config JSON (configs/train/*.json)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. train.total_steps=100 (repeatable; JSON values)")
    ap.add_argument("--output-dir", help="shortcut for --set train.output_dir=DIR")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("-v", "--verbose", action="store_true", help="log sharding and checkpoint decisions")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    overrides = args.overrides + ([f"train.output_dir={json.dumps(args.output_dir)}"] if args.output_dir else [])
    try:
        config = load_config(args.config, overrides)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    if args.print_config:
        print(json.dumps(config, indent=2))
        return 0
    maybe_initialize_distributed()
    train_cfg = TrainConfig.from_dict(config.get("train", {}))
    params, aux, loss_fn, train_iter, eval_fn = build_job(config)
    # EAGLE-3's lm_head columns mean the tokens of its draft vocabulary: a resume must use the same one
    trainer = Trainer(train_cfg, params, aux, loss_fn, train_iter, eval_fn, pinned_aux=("d2t",))
    if trainer.restored_step:
        print(f"resumed from step {trainer.restored_step}", file=sys.stderr)
    trainer.run()
    trainer.close()
    export = config.get("export") if config["job"] in ("eagle1", "eagle3") else None
    if export:
        from jax.experimental import multihost_utils

        from .training.eagle_job import eagle_job, export_head

        # every process joins: params sharded over other hosts' devices (FSDP across hosts) are gathered
        # whole onto each host, which process 0 alone could not do (jax.device_get refuses them)
        host_params = multihost_utils.process_allgather(trainer.params, tiled=True)
        if trainer.is_main:
            out = export_head(host_params, aux, eagle_job.last_head_cfg, config.get("model", {}).get(
                "target", "smollm2-135m-instruct"), export.get("dtype", "float16"), export["path"])
            print(f"exported the head to {out}", file=sys.stderr)
    summary = {"step": trainer.step_count, "stopped_early": trainer.stopped_early,
               "output_dir": str(Path(train_cfg.output_dir).absolute()), "mesh": dict(trainer.mesh.shape),
               "devices": jax.device_count(), "processes": jax.process_count()}
    last = {}
    if trainer.metrics.path.exists():
        for line in trainer.metrics.path.read_text().splitlines():
            rec = json.loads(line)
            last[rec["split"]] = {k: v for k, v in rec.items() if k not in ("split", "time")}
    if trainer.is_main:
        print(json.dumps({**summary, **last}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
