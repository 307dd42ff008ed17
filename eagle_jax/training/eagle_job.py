"""The `eagle1` / `eagle3` training jobs: target + conversations → head params, loss, data, eval.

Config sections (defaults in MODEL / DATA / OBJECTIVE below):
  model:     the target (alias, HF dir or GGUF), dtype, EAGLE-3 draft vocabulary size and fused layers,
             optional warm start from a drafter directory (`init_from`; EAGLE-3 keeps that head's
             draft vocabulary unless `rebuild_vocab`: then this run's data builds it and the head's
             LM head is carried over, see `vocab.remap_draft_vocab`; an `intermediate_size` above
             that head's widens its MLP without changing its outputs, see `heads.widen_mlp`)
  data:      train/eval JSONL conversations (ShareGPT or messages layout; `.gz` files are read
             compressed; `train` may be a list of files, e.g. datasets from several sessions), max_len, how to treat bad
             lines, target features "online" (the frozen target runs inside the step) or "offline"
             (cached once under feature_dir, then streamed), `pack` (several conversations per row,
             kept apart by segment ids: no step computes padding it could fill)
  objective: ObjectiveConfig fields (ttt_length, step_decay, noise, v_weight, p_weight, compute_dtype,
             greedy_weight); `noise` is for training only: the held-out eval runs with none
  export:    where the finished head is written in the released EAGLE layout (and its dtype)

The draft vocabulary (EAGLE-3) is built from the training data's assistant-token frequencies and
saved next to the run (`draft_vocab.npz`), so a resumed run keeps the same vocabulary (its sha256 is saved
with each checkpoint: a resume with another vocabulary is refused, see `Trainer(pinned_aux=...)`). A warm start
that keeps its head's vocabulary builds none; the log says how much of this data's assistant tokens
the kept one covers.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np

from ..draft import DraftConfig, DraftHead, init_head, load_drafter, save_drafter
from ..draft.heads import widen_mlp
from ..models.checkpoint import load_hf_dir
from ..models.decoder import with_layer_layout
from ..models.registry import resolve_model
from .data import load_examples, make_dataset
from .features import FeatureStore, cache_features
from .objectives import ObjectiveConfig, make_loss_fn
from .trainer import TrainConfig
from .vocab import build_draft_vocab, count_tokens, remap_draft_vocab
from ..train import _section  # one reader of config sections for every job

MODEL = {"target": "smollm2-135m-instruct", "dtype": "float32", "draft_vocab_size": 8192, "target_layers": None,
         "intermediate_size": None, "init_from": None,
         "rebuild_vocab": False}
DATA = {"train": None, "eval": None, "max_len": 512, "on_error": "skip", "features": "online", "feature_dir": None,
        "eval_batches": 4, "pack": False}
OBJECTIVE = {"ttt_length": 7, "step_decay": 0.8, "noise": 0.2, "v_weight": 1.0, "p_weight": 0.1,
             "compute_dtype": "float32", "greedy_weight": 0.0}


def _log(msg: str):
    print(f"[train] {msg}", file=sys.stderr, flush=True)


def _draft_vocab(examples, tcfg, size: int, eos_ids, path: Path):
    if path.exists():
        d2t = np.load(path)["d2t"]
        if len(d2t) != size:
            raise ValueError(f"{path} holds a draft vocabulary of {len(d2t)} tokens, but model.draft_vocab_size is "
                             f"{size}: set draft_vocab_size to {len(d2t)} to resume that run, or delete {path} (and "
                             "train into a new output_dir) to build a new vocabulary")
        return d2t
    counts = count_tokens(examples, tcfg.vocab_size, assistant_only=True)
    d2t, _ = build_draft_vocab(counts, size, always_include=tuple(eos_ids))
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, d2t=d2t, counts=counts)
    _log(f"draft vocabulary: {size} tokens cover {_coverage(counts, d2t):.1%} of the assistant tokens")
    return d2t


def _coverage(counts, d2t) -> float:
    """The share of the counted tokens that the draft vocabulary `d2t` (draft id + d2t = target id) holds."""
    d2t = np.asarray(d2t)
    return float(counts[np.arange(len(d2t)) + d2t].sum() / max(counts.sum(), 1))


def _with_vocab(head: DraftHead, d2t, tparams) -> DraftHead:
    """A warm-start EAGLE-3 head moved onto this run's draft vocabulary (`model.rebuild_vocab`)."""
    lm, st = remap_draft_vocab(np.asarray(head.params["lm_head"]["kernel"]), np.asarray(head.d2t), d2t,
                               np.asarray(tparams["embed_tokens"]["embedding"]))
    _log(f"draft vocabulary rebuilt: {st['kept']} tokens kept, {st['new']} new, {st['dropped']} dropped")
    params = dict(head.params, lm_head={"kernel": jax.numpy.asarray(lm, head.params["lm_head"]["kernel"].dtype)})
    cfg = dataclasses.replace(head.cfg, draft_vocab_size=len(d2t))
    return DraftHead(params, jax.numpy.asarray(d2t, jax.numpy.int32), cfg)


def _feature_loader(store: FeatureStore, seq_len: int, slots=None):
    """`attach` for make_dataset: a row's cached target features, laid out like its tokens (examples
    side by side in a packed row, zeros on padding). slots[j]: the store entry of example j
    (`FeatureStore.slots`; None: entry j)."""

    def attach(idx: list, row: dict) -> dict:
        out = {"features": np.zeros((seq_len, store.meta["feature_size"]), np.float32),
               "hidden": np.zeros((seq_len, store.meta["hidden_size"]), np.float32),
               "target_argmax": np.zeros((seq_len,), np.int32)}
        at = 0
        for j in idx:
            f, h, a = store[j if slots is None else int(slots[j])]
            n = min(len(f), seq_len)
            out["features"][at:at + n], out["hidden"][at:at + n], out["target_argmax"][at:at + n] = f[:n], h[:n], a[:n]
            at += n
        return out

    return attach


def eagle_job(config: dict):
    """`(params, aux, loss_fn, train_iter, eval_fn)` for an EAGLE-1 or EAGLE-3 head."""
    from transformers import AutoTokenizer

    kind = config["job"]
    train = TrainConfig.from_dict(config.get("train", {}))
    model, data = _section(config, "model", MODEL), _section(config, "data", DATA)
    ocfg = ObjectiveConfig(kind=kind, **_section(config, "objective", OBJECTIVE))
    if not data["train"]:
        raise ValueError("data.train (a JSONL file of conversations, or a list of them) is required")
    if data["features"] not in ("online", "offline"):
        raise ValueError(f"data.features must be 'online' or 'offline', got {data['features']!r}")
    path = resolve_model(model["target"])
    tcfg, tparams = load_hf_dir(path, dtype=model["dtype"])
    tok = AutoTokenizer.from_pretrained(str(path))
    eos = [i for i in {tok.eos_token_id} if i is not None]
    stats: dict = {}
    examples = load_examples(data["train"], tok, data["max_len"], on_error=data["on_error"], stats=stats)
    _log(f"train data: {stats}")
    out_dir = Path(train.output_dir)
    d2t = None
    keep_vocab = bool(model["init_from"]) and not model["rebuild_vocab"]
    if kind == "eagle3" and not keep_vocab:
        d2t = _draft_vocab(examples, tcfg, model["draft_vocab_size"], eos, out_dir / "draft_vocab.npz")
    if model["init_from"]:
        head = load_drafter(model["init_from"], tcfg)
        if head.cfg.kind != kind:
            raise ValueError(f"init_from holds an {head.cfg.kind} head, not {kind}")
        if kind == "eagle3" and model["rebuild_vocab"]:
            head = _with_vocab(head, d2t, tparams)
        if model["intermediate_size"] and model["intermediate_size"] != head.cfg.layer.intermediate_size:
            old = head.cfg.layer.intermediate_size
            head = widen_mlp(head, model["intermediate_size"], jax.random.PRNGKey(train.seed))
            _log(f"MLP widened from {old} to {model['intermediate_size']} units (new units start at zero output)")
        d2t = head.d2t if kind == "eagle3" else None
        if kind == "eagle3" and keep_vocab:
            counts = count_tokens(examples, tcfg.vocab_size, assistant_only=True)
            _log(f"draft vocabulary: the {len(d2t)} tokens of {model['init_from']} kept; they cover "
                 f"{_coverage(counts, d2t):.1%} of this data's assistant tokens")
    else:
        hcfg = DraftConfig.for_target(kind, tcfg, draft_vocab_size=model["draft_vocab_size"],
                                      target_layers=tuple(model["target_layers"]) if model["target_layers"] else None,
                                      intermediate_size=model["intermediate_size"])
        head = init_head(hcfg, jax.random.PRNGKey(train.seed), d2t=d2t)
    aux = {"target": tparams}
    if head.d2t is not None:
        aux["d2t"] = head.d2t
    loss_fn = make_loss_fn(ocfg, head.cfg, tcfg)
    per_process = train.batch_size // jax.process_count()
    attach, read_options = None, None
    if data["features"] == "offline":
        import grain

        fdir = Path(data["feature_dir"] or out_dir / "features")
        # Unrolled target layers are ≈ 1.3× faster on CPU (decoder.with_layer_layout); same numbers.
        feat_params = with_layer_layout(tparams)
        cache_features(feat_params, tcfg, head.cfg, examples, fdir, seq_len=train.seq_len)
        store = FeatureStore(fdir)
        attach = _feature_loader(store, train.seq_len, store.slots(examples, train.seq_len))
        # Feature batches are tens of MB: read a couple of batches ahead only.
        read_options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)
    ds_stats: dict = {}
    train_iter = make_dataset(examples, per_process, train.seq_len, seed=train.seed, pack=data["pack"],
                              attach=attach, read_options=read_options, stats=ds_stats)
    if data["pack"]:
        _log(f"packing: {ds_stats['examples']} conversations in {ds_stats['rows']} rows of {train.seq_len} tokens")
    eval_fn = None
    if data["eval"] and data["eval_batches"]:
        held = load_examples(data["eval"], tok, data["max_len"], on_error=data["on_error"])
        it = make_dataset(held, train.batch_size, train.seq_len, seed=0, shuffle=False, num_epochs=1,
                          shard_index=0, shard_count=1, drop_remainder=False)
        batches = [b for _, b in zip(range(data["eval_batches"]), it)]
        # held-out metrics measure the head itself: no EAGLE-1 training noise on the target features
        eval_loss = jax.jit(make_loss_fn(dataclasses.replace(ocfg, noise=0.0), head.cfg, tcfg))

        def eval_fn(params, aux):
            outs = [jax.device_get(eval_loss(params, aux, b, jax.random.PRNGKey(0))[1]) for b in batches]
            return {k: float(np.mean([o[k] for o in outs])) for k in outs[0]}

    eagle_job.last_head_cfg = head.cfg  # for export after training
    return head.params, aux, loss_fn, train_iter, eval_fn


def export_head(params, aux, head_cfg, target: str, dtype: str, out: str | Path) -> Path:
    """Write a trained head in the released EAGLE layout (loadable by eagle_jax, vLLM, SGLang)."""
    tcfg, _ = load_hf_dir(resolve_model(target))
    head = DraftHead(jax.device_get(params), None if aux.get("d2t") is None else np.asarray(aux["d2t"]), head_cfg)
    return save_drafter(out, head, tcfg, dtype=dtype)
