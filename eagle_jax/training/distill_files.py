"""The self-distillation run's files: appending replies safely, reading them back, the ids already
stored elsewhere, and the train/eval split files written from `generated.jsonl`."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from .data import load_conversations
from ..atomic_file import write_atomic


def _log(msg: str) -> None:
    print(f"[selfdistill] {msg}", file=sys.stderr, flush=True)


def _repair_tail(path: Path) -> None:
    """Cut a torn last line (a run killed mid-write) so appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    _log(f"{path}: cutting a torn last line ({len(data) - cut} bytes) left by an interrupted run")
    with open(path, "r+b") as f:
        f.truncate(cut)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                _log(f"{path}:{lineno}: skipped: bad JSON ({e.msg})")
    return out


def append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def stored_ids(patterns: Sequence[str]) -> set:
    """The ids of every conversation in the JSONL files (plain or .gz) matching the glob patterns,
    read by the training loader (a malformed line is an error naming its file and line)."""
    ids = set()
    for pat in patterns:
        paths = sorted(glob.glob(pat))
        if not paths:
            raise FileNotFoundError(f"--exclude-ids-from {pat!r} matches no file")
        for path in paths:
            ids.update(c["id"] for c in load_conversations(path, on_error="raise"))
    return ids


def write_splits(out_dir: Path) -> dict:
    """train.jsonl / eval.jsonl from generated.jsonl (by each line's split); counts per source."""
    rows = read_jsonl(out_dir / "generated.jsonl")
    seen, counts = set(), {}
    files = {s: open(out_dir / f"{s}.jsonl.tmp", "w", encoding="utf-8") for s in ("train", "eval")}
    try:
        for r in rows:
            if r["id"] in seen:
                continue
            seen.add(r["id"])
            s = r.get("split", "train")
            files[s].write(json.dumps({k: r[k] for k in ("id", "conversations", "source", "finish") if k in r},
                                      ensure_ascii=False) + "\n")
            c = counts.setdefault(s, {}).setdefault(r["source"], {"conversations": 0, "reply_tokens": 0, "stop": 0})
            c["conversations"] += 1
            c["reply_tokens"] += int(r.get("new_tokens", 0))
            c["stop"] += r.get("finish") == "stop"
    finally:
        for f in files.values():
            f.close()
    for s in files:
        os.replace(out_dir / f"{s}.jsonl.tmp", out_dir / f"{s}.jsonl")
    return counts


def update_summary(out_dir: Path, **fields) -> dict:
    """Merge `fields` into `<out_dir>/summary.json` (created if missing; written atomically). A run
    writes its prompt counts before generating (`complete: false`), so a run stopped by a time box
    still leaves its record; `--splits-only` adds the files' counts; a finished run sets `complete`."""
    path = Path(out_dir) / "summary.json"
    summary = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    summary.update(fields)
    write_atomic(path, json.dumps(summary, indent=2))
    return summary
