"""Offline target features: run the frozen target once over the training set, keep what the head
needs on disk, and stream it back during training (no target forward in the training step).

Layout of a store directory:
  index.json            {"num_examples", "feature_size", "hidden_size", "dtype", "offsets", "lengths",
                        "digests", ...} — digests: a short hash of each example's stored tokens
  features.bin          [total_tokens, F] memmap (EAGLE-3: the fused target layers; EAGLE-1: final norm)
  hidden.bin            [total_tokens, D] memmap (final-norm output: the target's logits are its LM head
                        of this, so soft labels need no [V]-wide storage)
  argmax.bin            [total_tokens] int32 memmap: the target's greedy token at each position (lets
                        the EAGLE-3 loss skip the full-vocabulary LM head)
Examples are keyed by their tokens (the digests): a run computes only the examples whose tokens
the store does not hold yet and appends them, so a store serves any list that draws on it — a
data set extended anywhere, reordered, or a subset — and an interrupted caching run resumes after
its last finished batch. `FeatureStore.slots` maps a list's examples to their stored entries.
A store written before digests keeps the older rule: only a list that starts with its examples
(checked by length) extends it, and the first one that differs is named.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..models.config import ModelConfig
from .objectives import target_argmax, teacher
from ..atomic_file import write_atomic


class FeatureStore:
    """Read side: `store[i] -> (features [L_i, F], hidden [L_i, D], argmax [L_i])` (float32, int32)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        meta = json.loads((self.path / "index.json").read_text())
        self.meta = meta
        self.offsets = np.asarray(meta["offsets"], np.int64)
        self.lengths = np.asarray(meta["lengths"], np.int64)
        total = int(self.offsets[-1] + self.lengths[-1]) if len(self.lengths) else 0
        dt = np.dtype(meta["dtype"])
        self.features = np.memmap(self.path / "features.bin", dt, "r", shape=(total, meta["feature_size"]))
        self.hidden = np.memmap(self.path / "hidden.bin", dt, "r", shape=(total, meta["hidden_size"]))
        self.argmax = np.memmap(self.path / "argmax.bin", np.int32, "r", shape=(total,))

    def __len__(self) -> int:
        return len(self.lengths)

    def slots(self, examples: Sequence[dict], seq_len: int) -> np.ndarray:
        """[len(examples)] the store entry holding each example's features (its first seq_len
        tokens, found by digest); raises naming the first example the store does not hold."""
        digests = self.meta.get("digests")
        if digests is None:  # written before digests: example i is entry i (cache_features checked the prefix)
            if len(examples) > len(self):
                raise ValueError(f"{self.path} holds features of {len(self)} examples, not the {len(examples)} given")
            return np.arange(len(examples))
        where: dict = {}
        for k, d in enumerate(digests):
            where.setdefault(d, k)
        out = np.empty(len(examples), np.int64)
        for i, ex in enumerate(examples):
            k = where.get(example_digest(np.asarray(ex["input_ids"])[:seq_len]))
            if k is None:
                raise ValueError(f"{self.path} holds no features for example {i} "
                                 f"({min(len(ex['input_ids']), seq_len)} tokens): run cache_features on this list")
            out[i] = k
        return out

    def __getitem__(self, i: int):
        a, n = int(self.offsets[i]), int(self.lengths[i])
        return (np.asarray(self.features[a:a + n], np.float32), np.asarray(self.hidden[a:a + n], np.float32),
                np.asarray(self.argmax[a:a + n], np.int32))


def example_digest(ids) -> str:
    """A short hash of the tokens an example's features were computed from."""
    return hashlib.blake2b(np.ascontiguousarray(ids, np.int32).tobytes(), digest_size=8).hexdigest()


def _check_prefix(meta: dict, examples: Sequence[dict], seq_len: int, out: Path) -> None:
    done = meta["num_examples"]
    if done > len(examples):
        raise ValueError(f"{out} holds features of {done} examples, more than the {len(examples)} given: "
                         f"it was written for another data set")
    digests = meta.get("digests")
    for i in range(done):
        ids = np.asarray(examples[i]["input_ids"])[:seq_len]
        if len(ids) != meta["lengths"][i] or (digests is not None and example_digest(ids) != digests[i]):
            raise ValueError(f"{out} was written for another data set: cached example {i} does not match "
                             f"example {i} of this one ({meta['lengths'][i]} cached tokens, {len(ids)} given"
                             f"{'' if len(ids) != meta['lengths'][i] else ', different tokens'}); "
                             f"use a new feature_dir")


def _first_fit(lengths: Sequence[int], rows: int, seq_len: int):
    """Columns [(row, first column)] placing `lengths` into `rows` rows of seq_len, first fit in
    decreasing length (longest first); None when they do not fit."""
    free = [seq_len] * rows
    place: list = [None] * len(lengths)
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        r = next((r for r in range(rows) if free[r] >= lengths[j]), None)
        if r is None:
            return None
        place[j] = (r, seq_len - free[r])
        free[r] -= lengths[j]
    return place


def _pack_batch(examples: Sequence[dict], start: int, rows: int, seq_len: int, pack: bool):
    """Rows [rows, seq_len] of ids, segment ids (0 = padding) and positions holding examples
    start, start + 1, … (as many as fit; packed: first fit in decreasing length, so a short example
    fills the gap an earlier long one left), and spans [(row, first column, length)], one per
    example, in example order."""
    toks = []
    place = []
    for i in range(start, min(len(examples), start + (rows * seq_len if pack else rows))):
        t = np.asarray(examples[i]["input_ids"])[:seq_len]
        if pack:
            trial = _first_fit([len(x) for x in toks] + [len(t)], rows, seq_len)
            if trial is None:
                break
            place = trial
        else:
            place.append((len(toks), 0))
        toks.append(t)
    ids = np.zeros((rows, seq_len), np.int32)
    seg = np.zeros((rows, seq_len), np.int32)
    pos = np.zeros((rows, seq_len), np.int32)
    spans = []
    for k, (t, (r, col)) in enumerate(zip(toks, place)):
        ids[r, col:col + len(t)] = t
        seg[r, col:col + len(t)] = k + 1
        pos[r, col:col + len(t)] = np.arange(len(t))
        spans.append((r, col, len(t)))
    return ids, seg, pos, spans


def cache_features(target_params, tcfg: ModelConfig, head_cfg, examples: Sequence[dict], out_dir, *,
                   batch_size: int = 8, seq_len: int = 512, dtype: str = "float16", progress: bool = True,
                   pack: bool = True) -> Path:
    """Compute and store the teacher features of those `examples` (dicts with "input_ids") whose
    tokens the store does not hold yet, in list order (`FeatureStore.slots` finds them afterwards).

    `pack`: consecutive examples share a row (each attends only to itself, positions restart at 0),
    so a batch holds about seq_len / mean length examples per row instead of one; the stored
    features are the same as one example per row (up to float summation order)."""
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = out / "index.json"
    capture = tuple(head_cfg.target_layers) if head_cfg.kind == "eagle3" else (tcfg.num_layers,)
    meta = {"num_examples": 0, "feature_size": tcfg.hidden_size * len(capture), "hidden_size": tcfg.hidden_size,
            "dtype": dtype, "offsets": [], "lengths": [], "digests": [], "capture": list(capture),
            "kind": head_cfg.kind, "target_dtype": tcfg.dtype}
    if index.exists():
        old = json.loads(index.read_text())
        if old["capture"] != meta["capture"] or old["dtype"] != dtype:
            raise ValueError(f"{out} holds features of another configuration ({old['capture']}, {old['dtype']})")
        if old.get("target_dtype", tcfg.dtype) != tcfg.dtype:  # stores written before the key: not checked
            raise ValueError(f"{out} holds features the target computed in {old['target_dtype']}, not "
                             f"{tcfg.dtype} (model.dtype): use another feature_dir or the same dtype")
        meta = old
        if meta.get("digests") is None:  # written before digests: the prefix rule, and no digests from here on
            _check_prefix(meta, examples, seq_len, out)
            meta["digests"] = None
    if meta["digests"] is None:
        todo = list(range(meta["num_examples"], len(examples)))
    else:
        known = set(meta["digests"])
        todo = []
        for i, ex in enumerate(examples):
            d = example_digest(np.asarray(ex["input_ids"])[:seq_len])
            if d not in known:  # new tokens (a repeat within the list is computed once)
                known.add(d)
                todo.append(i)
    new = [examples[i] for i in todo]
    if progress and meta["num_examples"]:
        print(f"target features: {len(examples) - len(todo)} of {len(examples)} examples already in {out}, "
              f"{len(todo)} to compute", file=sys.stderr)

    def fn_(ids, seg, pos):
        feats, hidden = teacher(target_params, tcfg, head_cfg, ids, seg, pos)
        return feats, hidden, target_argmax(target_params, tcfg, hidden)

    fn = jax.jit(fn_)
    bar = tqdm(total=len(new), desc="target features", unit="ex", file=sys.stderr, disable=not progress)
    with open(out / "features.bin", "ab") as ff, open(out / "hidden.bin", "ab") as fh, \
            open(out / "argmax.bin", "ab") as fa:
        # Drop anything past the last finished batch (a killed run may have written part of one).
        total = (meta["offsets"][-1] + meta["lengths"][-1]) if meta["lengths"] else 0
        item = np.dtype(dtype).itemsize
        ff.truncate(total * meta["feature_size"] * item)
        fh.truncate(total * meta["hidden_size"] * item)
        fa.truncate(total * 4)
        start = 0
        while start < len(new):
            ids, seg, pos, spans = _pack_batch(new, start, batch_size, seq_len, pack)
            feats, hidden, amax = jax.device_get(fn(jnp.asarray(ids), jnp.asarray(seg), jnp.asarray(pos)))
            for r, a, n in spans:  # the examples in order: row r, columns a … a + n
                ff.write(np.ascontiguousarray(feats[r, a:a + n], dtype).tobytes())
                fh.write(np.ascontiguousarray(hidden[r, a:a + n], dtype).tobytes())
                fa.write(np.ascontiguousarray(amax[r, a:a + n], np.int32).tobytes())
                meta["offsets"].append(int(total))
                meta["lengths"].append(int(n))
                if meta["digests"] is not None:
                    meta["digests"].append(example_digest(ids[r, a:a + n]))
                total += n
            ff.flush()
            fh.flush()
            fa.flush()
            start += len(spans)
            meta["num_examples"] += len(spans)
            write_atomic(index, json.dumps(meta))  # the index only ever names fully written examples
            bar.update(len(spans))
    bar.close()
    return out
