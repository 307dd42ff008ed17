"""How sure a benchmark's speedups are: 95% intervals from a paired bootstrap over its prompts.

Every method decodes the same prompts, in turns (`bench.run_rows`), so prompt i's rows of two
methods form a pair. A speedup is a ratio of two pooled rates, (Σ tokens_a / Σ seconds_a) ÷
(Σ tokens_b / Σ seconds_b) over the prompts; the bootstrap draws the prompts with replacement,
`BOOT_REPS` times, computes that ratio on each draw from the drawn pairs, and reports the 2.5th and
97.5th percentiles. The interval shows how much the figure owes to which prompts were drawn: with
eight prompts a set, one long reply that the drafter predicts well moves a speedup by several
hundredths. A drift of the machine's speed hits every method of a prompt alike (the turns), so
most of it cancels inside a pair; a drift between two runs of the benchmark is not in it.

Rows pooled from several prompt sets are drawn within each set (a stratified bootstrap), so each
draw keeps the run's mix of, say, 8 chat and 8 code prompts. The draws come from a fixed seed: the
same rows give the same interval.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

BOOT_REPS = 4000
LEVEL = 0.95


def _end_to_end(r: dict) -> tuple[float, float]:
    return float(r["new_tokens"]), float(r["seconds"])


def loop_part(r: dict) -> tuple[float, float]:
    """A row's decoding-loop tokens and seconds: the tokens after the first, and the time beyond its
    1-token run (never below 0: that run can take longer than a short full run). `bench.summarize`'s
    loop figures and their intervals here both come from it."""
    return float(max(r["new_tokens"] - 1, 0)), float(max(r["seconds"] - r["first_token_seconds"], 0.0))


def ratio_interval(rows: list, ref_rows: list, part: Callable[[dict], tuple[float, float]] = _end_to_end,
                   reps: int = BOOT_REPS, level: float = LEVEL, seed: int = 0,
                   groups: Optional[list] = None) -> Optional[list]:
    """[low, high]: the `level` interval of (Σ tokens / Σ seconds of `rows`) ÷ (the same of `ref_rows`)
    over bootstrap draws of the prompts, row i of both lists being prompt i; with `groups` (row i's
    prompt set), each draw takes as many prompts of each set as there are, from that set. None where
    there are fewer than two prompts, the lists (or groups) differ in length, or no draw has time in
    both."""
    n = len(rows)
    if n < 2 or len(ref_rows) != n or (groups is not None and len(groups) != n):
        return None
    a = np.array([part(r) for r in rows])  # [n, 2] tokens, seconds
    b = np.array([part(r) for r in ref_rows])
    rng = np.random.default_rng(seed)
    labels = np.asarray(groups) if groups is not None else np.zeros(n)
    members = [np.flatnonzero(labels == key) for key in dict.fromkeys(labels.tolist())]  # each set's rows
    pick = np.concatenate([m[rng.integers(0, len(m), size=(reps, len(m)))] for m in members], axis=1)  # [reps, n]
    sums_a, sums_b = a[pick].sum(axis=1), b[pick].sum(axis=1)  # [reps, 2]
    ok = (sums_a[:, 1] > 0) & (sums_b[:, 1] > 0) & (sums_b[:, 0] > 0)
    if not ok.any():
        return None
    ratio = (sums_a[ok, 0] / sums_a[ok, 1]) / (sums_b[ok, 0] / sums_b[ok, 1])
    tail = 50.0 * (1.0 - level)
    low, high = np.percentile(ratio, [tail, 100.0 - tail])
    return [float(low), float(high)]


def add_intervals(out: dict, rows: dict, ref: str = "vanilla", groups: Optional[list] = None) -> None:
    """Put `speedup_vs_vanilla_ci95` (and, where every row has its first token's time,
    `loop_speedup_vs_vanilla_ci95`) into each method's summary in `out` (`bench.summarize`); groups:
    each row's prompt set, for `ratio_interval`."""
    if ref not in rows:
        return
    for m, rs in rows.items():
        if m == ref or m not in out:
            continue
        ci = ratio_interval(rs, rows[ref], groups=groups)
        if ci is not None:
            out[m]["speedup_vs_vanilla_ci95"] = ci
        if all("first_token_seconds" in r for r in rs + rows[ref]):
            ci = ratio_interval(rs, rows[ref], loop_part, groups=groups)
            if ci is not None:
                out[m]["loop_speedup_vs_vanilla_ci95"] = ci


def format_interval(ci) -> str:
    """"1.42–1.58" for a table cell, "" without an interval."""
    return f"{ci[0]:.2f}–{ci[1]:.2f}" if ci else ""
