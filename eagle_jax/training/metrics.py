"""Training metrics: one JSON object per line in `metrics.jsonl`, and PNG plots drawn from it.

A record is `{"step": int, "split": "train" | "eval", "time": unix seconds, <metric>: float, ...}`.
Train records average the metrics of the steps since the previous record; the EAGLE objectives
report `loss` and `acc_0 … acc_{n-1}` (top-1 accuracy of rollout step i: the n-α acceptance
proxies), plus whatever else they return. Plots are redrawn from the file, so they survive a
restart and can be regenerated offline with `plot_metrics(path, out_dir)`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..atomic_file import write_atomic
from ..png import save_figure

log = logging.getLogger(__name__)

_ACC = re.compile(r"^acc_(\d+)$")


def _jsonable(v):
    v = np.asarray(v)
    if v.size != 1:
        raise ValueError(f"metrics must be scalars, got shape {v.shape}")
    v = v.item()
    return v if isinstance(v, (int, bool)) or math.isfinite(v) else str(v)  # NaN/inf stay readable


class MetricsLog:
    """Appends records to `<dir>/metrics.jsonl`; a no-op writer on processes other than 0."""

    def __init__(self, out_dir: str | os.PathLike, enabled: bool = True):
        self.dir = Path(out_dir)
        self.path = self.dir / "metrics.jsonl"
        self.enabled = enabled
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, split: str, metrics: Mapping[str, object]) -> dict:
        rec = {"step": int(step), "split": split, "time": round(time.time(), 3),
               **{k: _jsonable(v) for k, v in metrics.items()}}
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return rec

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`: after a resume from step s, the steps a killed run logged
        beyond s are recomputed, and the log should hold them once."""
        if not (self.enabled and self.path.exists()):
            return
        keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics.jsonl; a torn last line (a run killed mid-write) is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("skipping a malformed line in %s", path)
    return out


def _series(records: Iterable[dict], split: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one metric; for a step logged twice the later record wins."""
    by_step = {}
    for r in records:
        if r.get("split") == split and isinstance(r.get(key), (int, float)):
            by_step[r["step"]] = float(r[key])
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def _acc_keys(records: Iterable[dict]) -> list[str]:
    keys = {k for r in records for k in r if _ACC.match(k)}
    return sorted(keys, key=lambda k: int(_ACC.match(k).group(1)))


def plot_metrics(metrics_path: str | os.PathLike, out_dir: str | os.PathLike,
                 extra: Iterable[str] = ("lr", "grad_norm")) -> list[Path]:
    """Draw `loss.png`, `accuracy.png` (every `acc_i`, train solid and eval dashed) and one PNG per
    metric in `extra` that is present. Returns the files written (none if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; skipping plots (pip install matplotlib)")
        return []
    records = read_metrics(metrics_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = out_dir / name
        save_figure(fig, path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)

    def draw(ax, key, split, **kw):
        steps, vals = _series(records, split, key)
        if len(steps):
            ax.plot(steps, vals, marker="o" if len(steps) < 30 else None, markersize=3, **kw)
        return len(steps)

    fig, ax = plt.subplots(figsize=(7, 4))
    n = draw(ax, "loss", "train", label="train") + draw(ax, "loss", "eval", label="eval", linestyle="--")
    if n:
        vals = np.concatenate([_series(records, sp, "loss")[1] for sp in ("train", "eval")])
        if vals.min() > 0 and vals.max() / vals.min() > 100:  # losses spanning decades read better on a log axis
            ax.set_yscale("log")
        ax.set(xlabel="step", ylabel="loss", title="loss")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "loss.png")
    else:
        plt.close(fig)

    acc = _acc_keys(records)
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, key in enumerate(acc):
            c = colors[i % len(colors)]
            draw(ax, key, "train", label=key, color=c)
            draw(ax, key, "eval", label=f"{key} (eval)", color=c, linestyle="--")
        ax.set(xlabel="step", ylabel="top-1 accuracy", title="accuracy per rollout step (acceptance proxy)",
               ylim=(0.0, 1.0))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=2)
        save(fig, "accuracy.png")

    for key in extra:
        fig, ax = plt.subplots(figsize=(7, 3))
        if draw(ax, key, "train"):
            ax.set(xlabel="step", ylabel=key, title=key)
            ax.grid(alpha=0.3)
            save(fig, f"{key}.png")
        else:
            plt.close(fig)
    return written
