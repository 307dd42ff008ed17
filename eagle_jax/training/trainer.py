"""A generic trainer: mesh → optimizer → checkpoint manager → data, then one jitted step in a loop.

The trainer knows nothing about EAGLE. It trains a pytree of float `params` on
`loss_fn(params, aux, batch, rng) -> (loss, metrics)`, where `aux` is a frozen pytree (the target
model's params, the draft-vocabulary maps) that is sharded like parameters and passed to every
step but never differentiated or saved, and `batch` is a dict of numpy arrays whose leading dim
is this process's rows of the global batch.

Resuming is exact: a checkpoint holds the full `TrainState` (step, params, optimizer state, the
run's base RNG key) and every process's data-iterator state, and step i always draws its
randomness from `fold_in(base_key, i)`, so a run killed after checkpoint s and restarted replays
steps s+1… on the same batches with the same keys and ends with bit-identical params.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from tqdm.auto import tqdm

from .metrics import MetricsLog, plot_metrics
from .sharding import batch_sharding, make_mesh, path_names, put_batch, put_global, replicated, tree_shardings

log = logging.getLogger(__name__)

DECAYS = ("cosine", "linear", "constant")
_PLOT_EVERY_S = 300.0
# TrainConfig fields that do not change the computed params (free to change on resume)
_BOOKKEEPING = frozenset({"output_dir", "checkpoint_dir", "save_every", "keep_checkpoints", "async_checkpointing",
                          "max_seconds", "log_every", "eval_every", "eval_at_start", "progress", "plot"})
LossFn = Callable[[Any, Any, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, Mapping[str, jax.Array]]]
EvalFn = Callable[[Any, Any], Mapping[str, float]]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, parallelism and bookkeeping of one training run (the `train` config section)."""

    # optimisation: AdamW, linear warm-up to `learning_rate`, then `decay` to end_lr_ratio × peak
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    stop_at_step: Optional[int] = None  # end this run early (the schedule still spans total_steps)
    # end this run once it has trained this long (seconds from its first step, compiling included;
    # checked every log_every steps): a time box on a lent or preemptible machine. It saves, evaluates
    # and exports as at its end; the schedule still spans total_steps, and a rerun resumes.
    max_seconds: Optional[float] = None
    decay: str = "cosine"  # "cosine" | "linear" | "constant"
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.0  # decoupled; never applied to biases and norm scales
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 0.5  # max global gradient norm (0 = no clipping)
    # data
    batch_size: int = 8  # global: summed over all processes
    seq_len: int = 2048
    seed: int = 0
    # parallelism: (data, fsdp, tensor) mesh sizes, one of them may be -1 ("the rest")
    mesh: tuple[int, int, int] = (-1, 1, 1)
    # bookkeeping
    output_dir: str = "runs/train"  # metrics.jsonl, plots/, config.json
    checkpoint_dir: Optional[str] = None  # default <output_dir>/checkpoints
    save_every: int = 500  # 0 = never save (and never resume)
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    log_every: int = 10
    eval_every: int = 0  # 0 = only after the last step (when an eval_fn is given)
    eval_at_start: bool = False  # also evaluate before step 1 (a warm start's baseline on the same data)
    progress: bool = True
    plot: bool = True

    def __post_init__(self):
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if self.total_steps < 1 or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"need 0 <= warmup_steps ({self.warmup_steps}) <= total_steps ({self.total_steps}), "
                             "total_steps >= 1")
        if self.stop_at_step is not None and not 1 <= self.stop_at_step <= self.total_steps:
            raise ValueError(f"stop_at_step must be in [1, total_steps={self.total_steps}], got {self.stop_at_step}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 (or null: no time limit), got {self.max_seconds}")
        if self.learning_rate <= 0 or not 0 <= self.end_lr_ratio <= 1:
            raise ValueError("learning_rate must be > 0 and end_lr_ratio in [0, 1]")
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError("batch_size and seq_len must be >= 1")
        if min(self.save_every, self.eval_every, self.grad_clip, self.weight_decay) < 0 or self.log_every < 1:
            raise ValueError("save_every, eval_every, grad_clip, weight_decay must be >= 0 and log_every >= 1")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be >= 1")
        object.__setattr__(self, "mesh", tuple(int(s) for s in self.mesh))
        if len(self.mesh) != 3:
            raise ValueError(f"mesh is (data, fsdp, tensor), got {self.mesh}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        """From a JSON object; unknown keys are an error (a typo must not train with a default)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown train config keys {unknown}; known keys: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("mesh"), Mapping):
            m = d["mesh"]
            bad = sorted(set(m) - {"data", "fsdp", "tensor"})
            if bad:
                raise ValueError(f"unknown mesh axes {bad}; the mesh axes are data, fsdp, tensor")
            d["mesh"] = (m.get("data", 1), m.get("fsdp", 1), m.get("tensor", 1))
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mesh"] = list(self.mesh)
        return d

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    @property
    def checkpoint_path(self):
        """Where checkpoints go: a local directory or a bucket URI (gs://…, which a pod needs: every
        host writes its own shards), or None when saving is off."""
        if self.save_every == 0:
            return None
        path = self.checkpoint_dir or os.path.join(self.output_dir, "checkpoints")
        return epath.Path(path) if "://" in path else Path(path).absolute()


# ------------------------------------------------------------------------------ optimisation
def make_schedule(cfg: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """Learning rate of the update that follows `count` completed updates.

    Warm-up: update i < W uses peak·(i+1)/W (the first update already moves, the W-th reaches the
    peak); then cosine/linear decay over the remaining total−W updates to end_lr_ratio·peak, or a
    constant peak.
    """
    peak, w, total, end = cfg.learning_rate, cfg.warmup_steps, cfg.total_steps, cfg.end_lr_ratio
    decay = cfg.decay

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = peak * jnp.minimum(1.0, (count + 1.0) / max(w, 1))
        t = jnp.clip((count - w) / max(total - w, 1), 0.0, 1.0)
        if decay == "cosine":
            frac = end + (1.0 - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        elif decay == "linear":
            frac = 1.0 - (1.0 - end) * t
        else:
            frac = jnp.ones_like(t)
        return jnp.where(count < w, warm, peak * frac)

    return schedule


def _decays(names: Sequence[str]) -> bool:
    """Weight decay applies to matrices and embeddings, not to biases or norm scales."""
    if names and names[-1] in ("bias", "scale"):
        return False
    return not any("norm" in n for n in names[-2:-1])


def weight_decay_mask(params):
    """A pytree of bools like `params`: True where weight decay applies."""
    return jax.tree_util.tree_map_with_path(lambda p, _: _decays(path_names(p)), params)


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, Callable]:
    """(clip by global norm → AdamW with the warm-up/decay schedule, the schedule)."""
    schedule = make_schedule(cfg)
    clip = optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity()
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=weight_decay_mask)
    return optax.chain(clip, adamw), schedule


# ------------------------------------------------------------------------------ state and step
@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []: updates done
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 [2]: the run's base key; step i uses fold_in(rng, i)


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, schedule: Callable):
    """The pure step `(state, aux, batch) -> (state, metrics)`; metrics add loss, grad_norm, lr."""

    def train_step(state: TrainState, aux, batch):
        rng = jax.random.fold_in(state.rng, state.step)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, aux, batch, rng)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads), "lr": schedule(state.step)}
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    return train_step


def state_shardings(mesh, params, optimizer, params_axes=None) -> TrainState:
    """NamedShardings of a TrainState: params by the rules table, optimizer moments like their
    params, counters and the key replicated."""
    p_sh = tree_shardings(params, mesh, params_axes)
    opt_shape = jax.eval_shape(optimizer.init, params)
    o_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, p_sh,
                                 transform_non_params=lambda _: replicated(mesh))
    return TrainState(replicated(mesh), p_sh, o_sh, replicated(mesh))


def maybe_initialize_distributed(environ: Mapping[str, str] = os.environ) -> bool:
    """Join a multi-process JAX job when the environment describes one; call before any JAX work.

    * `EAGLE_JAX_DISTRIBUTED=0`: never. `EAGLE_JAX_DISTRIBUTED=1`: always, with JAX's cluster
      auto-detection (Cloud TPU VM pods through the metadata server, GKE TPU, SLURM, Open MPI).
    * `JAX_COORDINATOR_ADDRESS` (+ `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`): an explicit cluster.
    * otherwise a multi-host environment is recognised by `TPU_WORKER_HOSTNAMES` or
      `TPU_PROCESS_ADDRESSES` listing several hosts, `MEGASCALE_COORDINATOR_ADDRESS`,
      `SLURM_NTASKS` > 1 or `OMPI_COMM_WORLD_SIZE` > 1.
    Returns whether `jax.distributed.initialize` was called.
    """
    flag = environ.get("EAGLE_JAX_DISTRIBUTED")
    if flag == "0" or jax.distributed.is_initialized():
        return False
    if flag == "1":
        jax.distributed.initialize()
        return True
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        n, i = environ.get("JAX_NUM_PROCESSES"), environ.get("JAX_PROCESS_ID")
        jax.distributed.initialize(environ["JAX_COORDINATOR_ADDRESS"], None if n is None else int(n),
                                   None if i is None else int(i))
        return True
    hosts = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES") or ""
    if ("," in hosts or environ.get("MEGASCALE_COORDINATOR_ADDRESS")
            or int(environ.get("SLURM_NTASKS", "1")) > 1 or int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1):
        jax.distributed.initialize()
        return True
    return False


def _gather_json(obj) -> list:
    """`obj` (JSON-able) of every process, in process order (orbax writes JSON from process 0)."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([raw.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[:raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(bytes(rows[i, :sizes[i]]).decode()) for i in range(len(sizes))]


def _aux_digests(aux, keys: Sequence[str]) -> dict[str, str]:
    """{key: sha256 of aux[key]'s leaves (dtype, shape, bytes)} for the `keys` present in `aux`."""
    import hashlib

    out = {}
    for k in keys:
        if not isinstance(aux, Mapping) or aux.get(k) is None:
            continue
        h = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves(jax.device_get(aux[k])):
            a = np.ascontiguousarray(np.asarray(leaf))
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        out[k] = h.hexdigest()
    return out


# ------------------------------------------------------------------------------ the trainer
class Trainer:
    """Builds mesh → optimizer → sharded state → checkpoint manager (resuming the latest
    checkpoint) → data, and runs the loop.

    params: trainable pytree (host or device arrays); aux: frozen pytree for the loss.
    train_iter: yields this process's batches; with `get_state()`/`set_state()` (grain iterators)
      its position is checkpointed and restored, otherwise a resumed run restarts the data.
    eval_fn: `eval_fn(params, aux) -> {name: scalar}`, run every `eval_every` steps and at the end.
    params_axes / aux_axes: logical-axes pytrees overriding the name-based rules.
    pinned_aux: top-level `aux` keys whose values the trained params depend on (e.g. EAGLE-3's
      draft vocabulary `d2t`: which token each LM-head column is); their sha256 is saved with every
      checkpoint, and resuming one with different values is refused.
    hooks: `hook(trainer, step, metrics)` after every step (metrics still on device).
    """

    def __init__(self, cfg: TrainConfig, params, aux, loss_fn: LossFn, train_iter: Optional[Iterator] = None,
                 eval_fn: Optional[EvalFn] = None, *, mesh=None, params_axes=None, aux_axes=None,
                 hooks: Sequence[Callable[["Trainer", int, Mapping], None]] = (), pinned_aux: Sequence[str] = ()):
        self.cfg, self.loss_fn, self.train_iter, self.eval_fn, self.hooks = cfg, loss_fn, train_iter, eval_fn, hooks
        self.aux_digests = _aux_digests(aux, pinned_aux)  # before `aux` goes onto the mesh: host values
        self.is_main = jax.process_index() == 0
        # mesh
        self.mesh = mesh if mesh is not None else make_mesh(*cfg.mesh)
        rows = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if cfg.batch_size % rows or cfg.batch_size % jax.process_count():
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by data×fsdp = {rows} and by the "
                             f"process count {jax.process_count()}")
        # optimizer and sharded state
        self.optimizer, self.schedule = make_optimizer(cfg)
        self.state_sharding = state_shardings(self.mesh, params, self.optimizer, params_axes)
        self.aux = put_global(aux, tree_shardings(aux, self.mesh, aux_axes))
        self.aux_sharding = jax.tree_util.tree_map(lambda x: x.sharding, self.aux)
        params = put_global(params, self.state_sharding.params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.state_sharding.opt_state)(params)
        key = np.asarray(jax.random.key_data(jax.random.key(cfg.seed)), np.uint32)
        self.state = TrainState(put_global(np.int32(0), self.state_sharding.step), params, opt_state,
                                put_global(key, self.state_sharding.rng))
        self._step_fn = make_train_step(loss_fn, self.optimizer, self.schedule)
        self._compiled: dict = {}
        self._last_plot = time.monotonic()
        self.stopped_early = False  # set when max_seconds ends a run
        # outputs, checkpoints, resume
        self.metrics = MetricsLog(cfg.output_dir, enabled=self.is_main)
        self.checkpoints = None
        if cfg.checkpoint_path is not None:
            options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep_checkpoints, create=True,
                                                   enable_async_checkpointing=cfg.async_checkpointing)
            self.checkpoints = ocp.CheckpointManager(cfg.checkpoint_path, options=options)
        self.restored_step = self.restore()
        if self.is_main:
            (Path(cfg.output_dir) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")

    @property
    def step_count(self) -> int:
        return int(jax.device_get(self.state.step))

    @property
    def params(self):
        return self.state.params

    # -- one step
    def _jitted(self, batch):
        key = jax.tree_util.tree_structure(batch), tuple((np.shape(x), np.asarray(x).dtype.str)
                                                         for x in jax.tree_util.tree_leaves(batch))
        if key not in self._compiled:
            shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
                (np.shape(x)[0] * jax.process_count(),) + np.shape(x)[1:], np.asarray(x).dtype), batch)
            b_sh = batch_sharding(self.mesh, shapes)
            fn = jax.jit(self._step_fn, in_shardings=(self.state_sharding, self.aux_sharding, b_sh),
                         out_shardings=(self.state_sharding, replicated(self.mesh)), donate_argnums=0)
            self._compiled[key] = (fn, b_sh)
        return self._compiled[key]

    def train_step(self, batch) -> dict:
        """One update on this process's rows of a global batch; returns the step's (device) metrics."""
        fn, b_sh = self._jitted(batch)
        with jax.set_mesh(self.mesh):
            self.state, metrics = fn(self.state, self.aux, put_batch(batch, b_sh))
        return metrics

    # -- checkpoints
    def save(self, force: bool = False) -> bool:
        """Checkpoint the current state and data position (all processes must call it)."""
        if self.checkpoints is None:
            return False
        step = self.step_count
        if step in self.checkpoints.all_steps():
            return False
        it_state = self.train_iter.get_state() if hasattr(self.train_iter, "get_state") else None
        data = {"process_count": jax.process_count(), "states": _gather_json(it_state)}
        meta = {"step": step, "config": self.cfg.to_dict(), "mesh": dict(self.mesh.shape),
                "aux_sha256": self.aux_digests, "time": round(time.time(), 3)}
        saved = self.checkpoints.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self.state), data=ocp.args.JsonSave(data), meta=ocp.args.JsonSave(meta)),
            force=force)
        if saved and self.cfg.plot and time.monotonic() - self._last_plot > _PLOT_EVERY_S:
            self.plot()  # keep the plots of a long run fresh without redrawing at every save
        return saved

    def restore(self, step: Optional[int] = None) -> int:
        """Load checkpoint `step` (default: the latest) into the state and the data iterator;
        returns the restored step (0 when there is nothing to restore)."""
        if self.checkpoints is None:
            return 0
        step = self.checkpoints.latest_step() if step is None else step
        if step is None:
            return 0
        target = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state,
                                        self.state_sharding)
        got = self.checkpoints.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        self._check_aux_digests(step, got["meta"].get("aux_sha256") or {})
        self.state = got["state"]
        self._restore_data(got["data"])
        old = got["meta"].get("config", {})
        changed = {k: (old.get(k), v) for k, v in self.cfg.to_dict().items()
                   if old.get(k) != v and k not in _BOOKKEEPING}
        if changed:
            log.warning("resuming step %d with a changed train config (old, new): %s", step, changed)
        self.metrics.truncate_after(step)
        log.info("restored checkpoint step %d from %s", step, self.cfg.checkpoint_path)
        return step

    def _check_aux_digests(self, step: int, saved: Mapping[str, str]) -> None:
        bad = sorted(k for k in set(saved) & set(self.aux_digests) if saved[k] != self.aux_digests[k])
        if bad:
            raise ValueError(
                f"checkpoint step {step} in {self.cfg.checkpoint_path} was trained with other values of aux "
                f"{bad} than this run has (sha256 {[saved[k][:12] for k in bad]} there, "
                f"{[self.aux_digests[k][:12] for k in bad]} here): its params would mean something else (e.g. "
                "an EAGLE-3 draft vocabulary rebuilt from changed data or a replaced draft_vocab.npz). Restore "
                "the values it was trained with, or train into a new checkpoint directory")
        missing = sorted(set(self.aux_digests) - set(saved))
        if missing:
            log.warning("checkpoint step %d holds no digest of aux %s: not checked", step, missing)

    def _restore_data(self, data: Mapping) -> None:
        states = data.get("states") or [None]
        if not hasattr(self.train_iter, "set_state"):
            if self.train_iter is not None:
                log.warning("the data iterator has no set_state: a resumed run restarts its data from the beginning")
            return
        if data.get("process_count") != jax.process_count():
            raise ValueError(f"checkpoint was written by {data.get('process_count')} processes, this run has "
                             f"{jax.process_count()}: the data positions cannot be mapped")
        mine = states[jax.process_index()]
        if mine is None:
            log.warning("the checkpoint holds no data-iterator state: the data restarts from the beginning")
        else:
            self.train_iter.set_state(mine)

    # -- metrics
    def _log_train(self, step: int, window: list, t_start: float) -> dict:
        host = jax.device_get(window)  # waits for the steps: dispatch is asynchronous
        seconds = time.perf_counter() - t_start
        keys = host[-1].keys()
        avg = {k: float(np.mean([m[k] for m in host])) for k in keys}
        avg["lr"] = float(host[-1]["lr"])  # the current rate, not a window average
        avg["steps_per_s"] = len(window) / max(seconds, 1e-9)
        return self.metrics.write(step, "train", avg)

    def evaluate(self) -> Optional[dict]:
        if self.eval_fn is None:
            return None
        with jax.set_mesh(self.mesh):
            out = self.eval_fn(self.state.params, self.aux)
        return self.metrics.write(self.step_count, "eval", jax.device_get(dict(out)))

    def plot(self) -> list:
        """Redraw `<output_dir>/plots/*.png` from metrics.jsonl (process 0)."""
        self._last_plot = time.monotonic()
        if not (self.is_main and self.metrics.path.exists()):
            return []
        return plot_metrics(self.metrics.path, Path(self.cfg.output_dir) / "plots")

    def _out_of_time(self, t_run: float) -> bool:
        """Whether max_seconds has passed; process 0's clock decides for every process."""
        late = time.monotonic() - t_run > self.cfg.max_seconds
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            late = bool(multihost_utils.broadcast_one_to_all(np.int32(late)))
        return late

    # -- the loop
    def run(self) -> TrainState:
        """Train to `total_steps` (or `stop_at_step`, or until `max_seconds` pass) from the restored step,
        logging, evaluating and saving."""
        cfg = self.cfg
        step = start = self.step_count
        end = cfg.total_steps if cfg.stop_at_step is None else cfg.stop_at_step
        if self.train_iter is None and step < end:
            raise ValueError("Trainer.run needs a train_iter")
        bar = tqdm(total=end, initial=step, desc="train", file=sys.stderr, dynamic_ncols=True,
                   disable=not (cfg.progress and self.is_main))
        window, t_log, last_eval = [], time.perf_counter(), -1
        if cfg.eval_at_start and step == 0 and self.eval_fn is not None:
            self.evaluate()
        t_run = time.monotonic()
        try:
            while step < end:
                try:
                    batch = next(self.train_iter)
                except StopIteration:
                    log.warning("the data iterator ended at step %d of %d", step, end)
                    break
                metrics = self.train_step(batch)
                step += 1
                window.append(metrics)
                bar.update(1)
                if step % cfg.log_every == 0 or step == end:
                    rec = self._log_train(step, window, t_log)
                    window, t_log = [], time.perf_counter()
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", **{k: f"{rec[k]:.3f}" for k in ("acc_0",) if k in rec})
                if cfg.eval_every and step % cfg.eval_every == 0:
                    self.evaluate()
                    last_eval = step
                if cfg.save_every and step % cfg.save_every == 0:
                    self.save()
                for hook in self.hooks:
                    hook(self, step, metrics)
                if self.checkpoints is not None and self.checkpoints.reached_preemption(step):
                    log.warning("preemption notice at step %d: saving and stopping", step)
                    break  # all processes reach the same sync point; the save below is the last one
                if cfg.max_seconds is not None and step % cfg.log_every == 0 and step < end \
                        and self._out_of_time(t_run):
                    log.warning("max_seconds (%s) reached at step %d of %d: saving and stopping", cfg.max_seconds,
                                step, end)
                    self.stopped_early = True
                    break
            if window:
                self._log_train(step, window, t_log)
            # save first: a failing final eval (out of memory on a pod, say) must not lose the steps since
            # the last periodic save
            self.save(force=True)
            if self.eval_fn is not None and step > start and last_eval != step:
                self.evaluate()
        finally:  # an interrupt saves nothing: it may land between a batch and its step
            bar.close()
            if self.checkpoints is not None:
                self.checkpoints.wait_until_finished()
        if cfg.plot:
            self.plot()
        return self.state

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.wait_until_finished()
            self.checkpoints.close()
