"""PNG plots of a `python -m eagle_jax.bench` result (matplotlib, Agg backend; no display needed).

    speedup.png     tokens/s relative to eagle_jax vanilla, per method and prompt set
    acceptance.png  tau per method and prompt set; accept-length histograms of the eagle methods
    time_split.png  a speculative step's drafting / verification / rest, per eagle method
    budget.png      speedup against tree size (needs --total-tokens auto)

`write_plots(result, out_dir)` returns the paths it wrote; plots whose data is absent are skipped.
"""

from __future__ import annotations

from pathlib import Path

from .png import save_figure


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(result: dict) -> str:
    m = result.get("machine", {})
    s = result.get("settings", {})
    model = Path(str(s.get("model", ""))).name
    sp = s.get("sampling") or {}
    how = (f"sampled (T {sp['temperature']:g}, top-p {sp['top_p']:g}, top-k {sp['top_k']})"
           if sp.get("temperature", 0) > 0 else "greedy")
    return (f"{model}, {s.get('max_new_tokens', '')} new tokens, {how} — "
            f"{m.get('cpu', m.get('jax_backend', ''))} "
            f"({', '.join(filter(None, (m.get('cpu_isa'), m.get('jax_backend'))))})")


def _grouped_bars(ax, sets: dict, key: str, ylabel: str, legend_cols: int = 6, interval_key: str = ""):
    """A bar per method and set; with `interval_key`, whiskers over each bar from its interval
    [low, high] where the result has one (`bench_stats`: 95% over the prompts)."""
    names = list(sets)
    methods = list(next(iter(sets.values())))
    width = 0.8 / max(len(methods), 1)
    top = 0.0
    for j, m in enumerate(methods):
        vals = [sets[n][m].get(key) or 0.0 for n in names]
        cis = [sets[n][m].get(interval_key) if interval_key else None for n in names]
        top = max(top, *vals, *(ci[1] for ci in cis if ci))
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(names))]
        err = None
        if any(cis):  # no whisker (0, 0) where a bar has no interval, as the reference method's
            err = [[max(v - ci[0], 0.0) if ci else 0.0 for v, ci in zip(vals, cis)],
                   [max(ci[1] - v, 0.0) if ci else 0.0 for v, ci in zip(vals, cis)]]
        bars = ax.bar(xs, vals, width, label=m, yerr=err, capsize=2 if err else 0,
                      error_kw={"elinewidth": 0.8, "ecolor": "black"})
        if err is None:
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        else:  # the value above its whisker, not across it
            for x, v, up in zip(xs, vals, err[1]):
                ax.annotate(f"{v:.2f}", (x, v + up), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    cols = max(1, min(len(methods), legend_cols))
    legend_rows = -(-len(methods) // cols)
    # headroom above the tallest bar's label for the legend's rows
    ax.set_ylim(0, (1.15 + 0.12 * legend_rows) * top if top > 0 else 1.0)
    ax.legend(fontsize=8, ncols=cols, loc="upper center")


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    plt = _plt()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    sets = result.get("sets") or {"all": result["methods"]}

    if any("speedup_vs_vanilla" in r for res in sets.values() for r in res.values()):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        _grouped_bars(ax, sets, "speedup_vs_vanilla", "tokens/s ÷ eagle_jax vanilla",
                      interval_key="speedup_vs_vanilla_ci95")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title("Speedup per method and prompt set (whiskers: 95% over the prompts)\n" + _title(result),
                     fontsize=9)
        written.append(_save(fig, out_dir / "speedup.png"))

    spec = {m: r for m, r in result["methods"].items()
            if m.startswith("eagle") and r.get("accept_length_histogram")}
    if spec:
        fig, axes = plt.subplots(1, 1 + len(spec), figsize=(4 + 3.5 * len(spec), 4))
        tau_sets = {n: {m: res[m] for m in res if res[m].get("tau") is not None} for n, res in sets.items()}
        _grouped_bars(axes[0], tau_sets, "tau", "tau (tokens per target pass)", legend_cols=2)  # a narrow panel
        axes[0].set_title("Mean acceptance length", fontsize=9)
        for ax, (m, r) in zip(axes[1:], spec.items()):
            hist = {int(k): v for k, v in r["accept_length_histogram"].items()}
            total = sum(hist.values())
            ax.bar(list(hist), [v / total for v in hist.values()])
            ax.set_xticks(sorted(hist))  # whole numbers of tokens
            ax.set_xlabel("tokens accepted per step (drafts + bonus)")
            ax.set_ylabel("fraction of steps")
            ax.set_title(f"{m}: tau {r['tau']:.2f}, {total} steps", fontsize=9)
        fig.suptitle(_title(result), fontsize=9)
        written.append(_save(fig, out_dir / "acceptance.png"))

    splits = {m: r["time_split"] for m, r in result["methods"].items() if "time_split" in r}
    if splits:
        fig, ax = plt.subplots(figsize=(6, 4))
        bottom = [0.0] * len(splits)
        for part in ("draft_ms", "verify_ms", "other_ms"):
            vals = [max(s[part], 0.0) for s in splits.values()]
            ax.bar(list(splits), vals, bottom=bottom, label=part[:-3])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("ms per speculative step")
        ax.legend(fontsize=8)
        ax.set_title("Time per step: drafting, verification, the rest\n" + _title(result), fontsize=9)
        written.append(_save(fig, out_dir / "time_split.png"))

    tuned = result.get("autotune") or {}
    if tuned:  # one panel per tuned method, its legend beside it (three methods' shapes in one panel were unreadable)
        fig, axes = plt.subplots(len(tuned), 1, figsize=(9, 3.2 * len(tuned)), squeeze=False)
        for ax, (m, rec) in zip(axes[:, 0], tuned.items()):
            _budget_panel(ax, m, rec)
        axes[-1, 0].set_xlabel("tree tokens verified per step")
        fig.suptitle("Speedup against tree budget (autotune: o measured, x expected = tau ÷ (step ÷ plain "
                     "step); dotted: chosen)\n" + _title(result), fontsize=9)
        written.append(_save(fig, out_dir / "budget.png"))
    return written


def _budget_panel(ax, m: str, rec: dict):
    """One method's autotuning rows: a line per tree shape (depth, top-k, chain) over tree sizes."""
    shapes = {}
    for r in rec["candidates"]:
        shapes.setdefault((r.get("depth"), r.get("top_k"), r.get("lookup", 0), r.get("lookup_min_ngram", 1)),
                          []).append(r)
    for (depth, top_k, lookup, least), rows in shapes.items():  # a chain takes rows of the tree: same x
        rows = sorted(rows, key=lambda r: r["total_tokens"])
        xs = [r["total_tokens"] for r in rows]
        tag = ((f"depth {depth}, top-k {top_k}" if depth is not None else "static") + (f", chain {lookup}" if lookup
               else "") + (f" (n-gram ≥ {least})" if lookup and least > 1 else ""))
        line, = ax.plot(xs, [r["measured_speedup"] for r in rows], "o-", label=tag)
        ax.plot(xs, [r.get("expected_speedup", r["expected_tokens_per_s"] / rec["vanilla_tokens_per_s"])
                     for r in rows], "x--", color=line.get_color())
    ax.axvline(rec["budget"]["total_tokens"], color="gray", lw=0.8, ls=":")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_ylabel(f"{m}: tokens/s ÷ vanilla", fontsize=8)
    ax.set_xticks(sorted({r["total_tokens"] for r in rec["candidates"]}))  # whole numbers of tokens
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    _plt().close(fig)
    return path
