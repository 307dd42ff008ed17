"""Tree-budget autotuning (`--total-tokens auto`): pick the dynamic tree's size and shape for this
device and this drafter by measurement, as the reference's `total_token=-1` does for the size (for
eagle1, the static tree's size: `search_static_budgets` over `tree.static_tree_of_size`).

A candidate is a dynamic tree: N nodes verified per step (root included), `depth` expansion
steps and `top_k` children per expanded node. For each one measured:

- acceptance: greedy generation of 128 tokens over the calibration prompts (3 chat and 2 code
  prompts of the training data, `eagle_jax/data/calibration_prompts.jsonl`: never the held-out
  prompts the benchmark reports) gives tau = new tokens per target pass (the drafter's measured
  acceptance with that tree);
- cost: `step_profile.profile_spec_step` times one step with it on this device (drafting,
  verification of N tokens, and the rest), and a plain decoding step, all in turns and each as it
  costs inside the decoding loop (since stop 59; before, every timing also held a call's own cost,
  which understated the step ÷ plain ratio, larger trees' most);
- expected speedup = tau ÷ (step time ÷ plain step time), that ratio the median over the rounds
  of back-to-back timings (`step_over_plain`; expected tokens/s = tau / step time). A ratio of two
  times taken side by side holds while a shared machine's speed drifts between candidates, which
  expected tokens/s alone does not (stops 37 and 40 saw that noise pick trees); a ratio per pair
  also holds when the speed changes while one candidate is timed (stop 45).

The search is coordinate-wise (`search_budgets`): every candidate size with the starting depth and
top-k; then, at the best size, every shape (depth, top-k) of `shapes`; then every length of the
prompt-lookup chain (`lookups`, `TreeBudget.lookup`) at the best tree (grown by the chain's length
where the chain would not fit it), and every shortest n-gram it may be found by (`lookup_ngrams`,
`TreeBudget.lookup_min_ngram`) if the best tree has a chain; then every size again with the best
shape and chain. Where a step costs much more per verified token than per expansion (a CPU) small,
shallow, narrow trees win; where verification is nearly free (an accelerator) deep, wide ones do.
Trees that are the same after `TreeBudget`'s clamping are measured once. The `confirm` (3)
candidates with the highest expected speedup are then timed again (`confirm_finalists`: each
ratio becomes the mean of its two timings) and the best of them wins: the maximum of many noisy
estimates tends to be one that came out too high (stop 50: a 4-token tree's plain steps timed 13.0
ms against 10.9–12.4 for every other candidate, which made it the winner at 1.72× expected while
it measured 114.7 tok/s on the calibration prompts against 123.6 for the runner-up). Last, the
finalists and plain decoding decode the calibration prompts in turns (`turns` rounds, each prompt
by every setting back to back: `bench_turns.settle_in_turns`), and the fastest finalist wins: the
profile times one state's steps, and its ranking of close trees changed from run to run on the
Zen 3 VM at stop 77 (`_settle`). Plain decoding is also timed on the same prompts before the
search, so every candidate gets a measured speedup (same run, same prompts; measured one after
another, so a drifting machine moves it). The result is a small JSON config (`save_budget` /
`load_budget`) that `python -m eagle_jax.serve --budget-config FILE` uses;
`python -m eagle_jax.bench --total-tokens auto` writes it, by default to
`~/.cache/eagle_jax/budgets/<model>.<method>.<drafter>.<device>.json`, where serve and the CLI
find it by themselves (no tree flags, or `--total-tokens auto`, which tunes when nothing is saved);
one tuned with other CPU-kernel flags than the defaults (`--activations`, `--draft-rows`,
`--matmul`) gets their `kernel_tag` before `.json`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from pathlib import Path
from typing import Callable, Optional

import jax

from .draft.drafting import TreeBudget
from .step_profile import profile_spec_step
from .atomic_file import write_atomic

DEFAULT_CANDIDATES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # 2-3: a CPU's best, where a third row costs
DEFAULT_SHAPES = ((1, 2), (1, 4), (2, 2), (2, 3), (3, 2), (3, 4), (5, 4), (5, 8))  # (depth, top_k)
DEFAULT_LOOKUPS = (0, 2, 3, 4, 6)  # prompt-lookup chain lengths
DEFAULT_LOOKUP_NGRAMS = (1, 2, 3)  # the shortest n-gram a chain may be found by
RANK_KEY = "expected_speedup"  # tau ÷ (step ms ÷ plain step ms), the ratio per pair of runs side by side
TURNS_TIE = 0.01  # finalists this close in turns (relative) are a tie, which the cheaper tree takes


def budget_dir() -> Path:
    from .models.registry import default_cache_dir

    return default_cache_dir() / "budgets"


def device_tag() -> str:
    d = jax.devices()[0]
    return re.sub(r"[^A-Za-z0-9_-]+", "-", f"{d.platform}-{getattr(d, 'device_kind', '') or ''}").strip("-").lower()


def kernel_tag(matmul: str = "auto", activations: str = "auto", draft_rows: str = "auto") -> str:
    """"" for this machine's default CPU kernels (and off the CPU kernel path), else a suffix naming
    the settings that differ from them, e.g. ".act-float32.rows-q4_1": a tree's cost depends on
    how the products are computed (float32 rows of x cost about 1.5x int8 rows a step on the EPYC
    VM), so a budget tuned with other kernels is kept apart from the default one. Settings this
    machine cannot run are left for `Engine` to reject and tagged as given."""
    from .kernels.cpu_matmul import resolve_matmul_impl
    from .models.quantized import resolve_activations, resolve_draft_rows

    def resolved(fn, value):
        try:
            return fn(value)
        except (ValueError, RuntimeError):
            return value

    impl = resolved(resolve_matmul_impl, matmul)
    if impl != resolve_matmul_impl("auto"):
        return f".matmul-{impl}"
    if impl != "cpu_kernel":
        return ""
    parts = [f".{name}-{got}" for name, fn, value in (("act", resolve_activations, activations),
                                                      ("rows", resolve_draft_rows, draft_rows))
             if (got := resolved(fn, value)) != fn("auto")]
    return "".join(parts)


def default_budget_path(model: str, method: str, drafter: str, kernels: str = "") -> Path:
    """Where a budget tuned on this device is saved: `kernels` is `kernel_tag(...)` of the settings
    it was tuned with ("" for the defaults)."""
    tag = lambda s: re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(str(s)).name or str(s))
    return budget_dir() / f"{tag(model)}.{method}.{tag(drafter)}.{device_tag()}{kernels}.json"


def packaged_budget_path(model: str, method: str, drafter: str) -> Path:
    """A budget tuned for this platform (cpu / gpu / tpu) that ships with eagle_jax, if any. On a CPU,
    first one tuned for its instruction set and core (`.cpu-avx512-zen5.json`: on Zen 5, whose
    512-bit vectors run whole, a verified row costs less than on Zen 4) where it ships; then, for
    the AVX2 kernels (`cpu_matmul.cpu_isa()`), where each tree token costs more than with AVX-512,
    one tuned on an AVX2 CPU (`.cpu-avx2.json`); else the CPU's (`.cpu.json`, tuned with AVX-512)."""
    base = Path(__file__).parent / "assets" / "budgets"
    stem = f"{Path(str(model)).name}.{method}.{Path(str(drafter)).name}"
    platform = jax.devices()[0].platform
    if platform == "cpu":
        from .kernels import cpu_matmul

        isa, core = cpu_matmul.cpu_isa_or_none(), cpu_matmul.cpu_core()
        names = ([f"{stem}.cpu-{isa}-{core}.json"] if isa and core else []) + (
            [f"{stem}.cpu-{isa}.json"] if isa not in (None, "avx512") else [])
        for name in names:
            if (base / name).exists():
                return base / name
    return base / f"{stem}.{platform}.json"


def release_programs() -> None:
    """Drop the compiled speculative programs (every tree's): on XLA:CPU each compiled tree holds
    thousands of memory maps (≈ 3600 for SmolLM2's unrolled layers, with its profile), and a
    process may hold 65530 (Linux's vm.max_map_count), so a search over many trees would abort with
    "LLVM compilation error: Cannot allocate memory". The tree that is kept compiles again on first
    use (from the persistent compile cache where it is on)."""
    from . import speculative, step_profile

    for fn in (speculative.speculative_generate, speculative.spec_start, speculative.spec_advance,
               step_profile._draft, step_profile._verify):
        fn.clear_cache()


def parse_shapes(spec: str) -> tuple:
    """"1:2,2:4" → ((1, 2), (2, 4)) (DEPTH:TOP_K pairs); "none" or "" → () (sizes only)."""
    spec = (spec or "").strip()
    if spec.lower() in ("", "none"):
        return ()
    out = []
    for part in spec.split(","):
        try:
            depth, top_k = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"tree shape {part!r} is not DEPTH:TOP_K (e.g. 2:4)") from None
        if depth < 0 or top_k < 1:
            raise ValueError(f"tree shape {part!r}: depth must be >= 0 and top-k >= 1")
        out.append((depth, top_k))
    return tuple(out)


def parse_lookups(spec: str) -> tuple:
    """"0,3,6" → (0, 3, 6) (prompt-lookup chain lengths); "none" or "" → () (the start's only)."""
    spec = (spec or "").strip()
    if spec.lower() in ("", "none"):
        return ()
    try:
        out = tuple(int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"lookup lengths {spec!r} are not comma-separated integers (e.g. 0,3,6)") from None
    if any(x < 0 for x in out):
        raise ValueError(f"lookup lengths must be >= 0, got {spec!r}")
    return out


def _valid(n: int, depth: int, top_k: int, lookup: int = 0, min_ngram: int = 1) -> Optional[TreeBudget]:
    try:
        return TreeBudget("dynamic", total_tokens=n, depth=depth, top_k=top_k, lookup=lookup,
                          lookup_min_ngram=min_ngram)
    except ValueError:  # more nodes than this depth and top-k can offer, or a chain that leaves no head node
        return None


def budget_fields(b: TreeBudget) -> dict:
    """The JSON fields of a budget (what `load_budget` reads back); a static tree's with its paths."""
    out = {"kind": b.kind, "total_tokens": b.total_tokens, "depth": b.depth, "top_k": b.top_k, "lookup": b.lookup,
           "lookup_min_ngram": b.lookup_min_ngram}
    if b.kind == "static":
        out["paths"] = b.static_tree.to_json()
    return out


def search_static_budgets(sizes, base: TreeBudget, measure: Callable[[TreeBudget], dict],
                          lookups=()) -> tuple[TreeBudget, list]:
    """EAGLE-1's search: the static tree of every size in `sizes` (`static_tree_of_size`: 2 to 20
    nodes; others are skipped) with base's chain, then every chain length of `lookups` on the best
    one (a static tree gets the chain's rows on top). Returns (the best budget, the rows)."""
    from .tree import PRIORITY_PATHS, static_tree_of_size

    rows, budgets = [], []

    def run(n, lookup):
        budget = TreeBudget("static", static_tree=static_tree_of_size(n), lookup=lookup,
                            lookup_min_ngram=base.lookup_min_ngram)
        if budget in budgets:
            return
        budgets.append(budget)
        rows.append(dict(measure(budget), **budget_fields(budget)))

    for n in sizes:
        if 2 <= n <= len(PRIORITY_PATHS) + 1:
            run(n, base.lookup)
    if not rows:
        raise ValueError(f"no candidate size makes a static tree (2 to {len(PRIORITY_PATHS) + 1} nodes): {sizes}")
    best = lambda: max(range(len(rows)), key=lambda i: rows[i][RANK_KEY])
    n_best = budgets[best()].static_tree.num_nodes
    for lookup in lookups:
        run(n_best, lookup)
    return budgets[best()], rows


def search_budgets(sizes, shapes, base: TreeBudget, measure: Callable[[TreeBudget], dict],
                   lookups=(), lookup_ngrams=()) -> tuple[TreeBudget, list]:
    """Coordinate search over dynamic trees: every size with base's (depth, top_k, lookup; a chain
    longer than a size's N - 2 cut to N - 2, as `engine.default_budget` cuts it), then
    every shape of `shapes` at the best size (the best above 2 tokens if 2 won), then every chain
    length of `lookups` at the best tree (N tokens; a chain of L > N - 2 tokens, which would leave
    the head no node, at N + L), then, if the best tree has a chain, every shortest n-gram of
    `lookup_ngrams` for it, then every size with the best shape and chain. `measure(budget)`
    returns a row with `RANK_KEY` ("expected_speedup"); each distinct tree (after TreeBudget's
    clamping) is measured once.
    Returns (the best budget, the rows in measurement order)."""
    rows, seen = [], set()

    def run(n, depth, top_k, lookup, min_ngram):  # a size too small for the chain gets what fits of it
        budget = _valid(n, depth, top_k, min(lookup, max(n - 2, 0)), min_ngram)
        if budget is None or budget in seen:
            return
        seen.add(budget)
        rows.append(dict(measure(budget), **budget_fields(budget)))

    best = lambda: max(rows, key=lambda r: r[RANK_KEY])
    for n in sizes:
        run(n, base.depth, base.top_k, base.lookup, base.lookup_min_ngram)
    if not rows:
        raise ValueError(f"no candidate tree size fits depth {base.depth}, top-k {base.top_k}")
    chain = lambda r: (r["lookup"], r["lookup_min_ngram"])
    if shapes or lookups or lookup_ngrams:
        # shapes at the best size, or at the best size above 2 where 2 tokens won: every shape of a
        # 2-token tree is the same tree (the root's first choice), which would leave no shape measured
        b = best()
        wider = [r for r in rows if r["total_tokens"] > 2]
        at = b if b["total_tokens"] > 2 or not wider else max(wider, key=lambda r: r[RANK_KEY])
        for depth, top_k in shapes:
            run(at["total_tokens"], depth, top_k, *chain(at))
        b = best()
        for lookup in lookups:  # a chain too long for the best tree gets rows of its own on top of it
            n = b["total_tokens"]
            run(n if lookup <= n - 2 else n + lookup, b["depth"], b["top_k"], lookup, b["lookup_min_ngram"])
        b = best()
        for min_ngram in lookup_ngrams if b["lookup"] else ():
            run(b["total_tokens"], b["depth"], b["top_k"], b["lookup"], min_ngram)
        b = best()
        for n in sizes:
            run(n, b["depth"], b["top_k"], *chain(b))
    b = best()
    return _valid(b["total_tokens"], b["depth"], b["top_k"], *chain(b)), rows


def confirm_finalists(rows: list, retime: Callable[[int], dict], n: int,
                      say: Callable[[str], None] = lambda s: None,
                      name: Callable[[int], str] = str) -> int:
    """Time the `n` rows of highest `RANK_KEY` again (`retime(i)` gives a profile of row i's tree:
    step_ms, plain_ms, step_over_plain; draft_ms and verify_ms where it has them), set each one's
    ratio and times to the mean of its two timings (`step_over_plain_runs` keeps both) and its
    expected speedup and tokens/s to match; return the index of the best of them. With fewer than
    two rows nothing is timed again; `name(i)` labels row i in what `say` is told."""
    order = sorted(range(len(rows)), key=lambda i: rows[i][RANK_KEY], reverse=True)
    if len(order) < 2 or n < 2:
        return order[0]
    finalists = order[:n]
    for i in finalists:
        row, prof = rows[i], retime(i)
        row["step_over_plain_runs"] = [row["step_over_plain"], prof["step_over_plain"]]
        row["step_over_plain"] = sum(row["step_over_plain_runs"]) / 2
        row["step_ms"] = (row["step_ms"] + prof["step_ms"]) / 2
        row["plain_step_ms"] = (row["plain_step_ms"] + prof["plain_ms"]) / 2
        for key in ("draft_ms", "verify_ms"):
            if key in row and key in prof:
                row[key] = (row[key] + prof[key]) / 2
        row["expected_speedup"] = row["tau"] / row["step_over_plain"]
        row["expected_tokens_per_s"] = 1e3 * row["tau"] / row["step_ms"]
        say(f"{name(i)}: step/plain {row['step_over_plain_runs'][0]:.3f}, "
            f"again {prof['step_over_plain']:.3f} → expected {row['expected_speedup']:.2f}×")
    return max(finalists, key=lambda i: rows[i][RANK_KEY])


def autotune_budget(engine, method: str, prompts: list[list[int]], *, candidates=DEFAULT_CANDIDATES,
                    shapes=DEFAULT_SHAPES, lookups=DEFAULT_LOOKUPS, lookup_ngrams=DEFAULT_LOOKUP_NGRAMS,
                    max_new_tokens: int = 128, reps: int = 20, confirm: int = 3, turns: int = 2,
                    log: Optional[Callable[[str], None]] = None) -> dict:
    """Measure candidate trees (`search_budgets`: sizes `candidates`, shapes (depth, top_k) `shapes`,
    prompt-lookup chains `lookups`, the first of them while sizes and shapes are searched, and the
    chain's shortest n-grams `lookup_ngrams`; empty: not searched, the engine's budget's), time the
    best `confirm` again (`confirm_finalists`; below 2: not), decode the prompts with those
    finalists and plain decoding in turns, `turns` rounds (`bench_turns.settle_in_turns`; 0: the
    finalists' expected speedup decides), set the fastest as `engine.budgets[method]`; return the
    record."""
    if method not in ("eagle1", "eagle2", "eagle3"):
        raise ValueError(f"autotuning sizes a draft tree (eagle1, eagle2, eagle3), not {method!r}")
    base = engine.budgets[method]
    if lookups:  # sizes and shapes are searched with the first chain length listed (the default: none)
        base = dataclasses.replace(base, lookup=tuple(lookups)[0])
    cache_len = max(len(p) for p in prompts) + max_new_tokens + 64
    say = log or (lambda s: None)

    def run(m):  # one warm-up generation (compile), then the calibration prompts
        engine.generate_ids(prompts[0], max_new_tokens, method=m, cache_len=cache_len)
        gens = [engine.generate_ids(p, max_new_tokens, method=m, cache_len=cache_len) for p in prompts]
        new, calls = sum(g.new_tokens for g in gens), sum(g.target_calls for g in gens)
        return new / sum(g.seconds for g in gens), new / calls

    vanilla_tps, _ = run("vanilla")
    say(f"autotune {method}: vanilla {vanilla_tps:.1f} tok/s on {len(prompts)} prompts")

    budgets = []  # measurement order = the searches' row order (one row per call of measure)

    def profile(budget: TreeBudget) -> dict:
        engine.budgets[method] = budget
        prof = profile_spec_step(engine, method, prompts[0], budget=budget, reps=reps, cache_len=cache_len)
        release_programs()
        return prof

    def measure(budget: TreeBudget) -> dict:
        budgets.append(budget)
        engine.budgets[method] = budget
        tps, tau = run(method)
        prof = profile(budget)
        ratio = prof["step_over_plain"]
        row = {"tau": tau, "step_ms": prof["step_ms"], "draft_ms": prof["draft_ms"],
               "verify_ms": prof["verify_ms"], "plain_step_ms": prof["plain_ms"], "step_over_plain": ratio,
               "expected_speedup": tau / ratio,
               "expected_tokens_per_s": 1e3 * tau / prof["step_ms"],
               "measured_tokens_per_s": tps, "measured_speedup": tps / vanilla_tps}
        say(f"autotune {method}: {describe_budget(budget)}: tau {tau:.2f}, "
            f"step {prof['step_ms']:.1f} ms (verify {prof['verify_ms']:.1f}; plain {prof['plain_ms']:.1f}), "
            f"expected {row['expected_speedup']:.2f}× ({row['expected_tokens_per_s']:.1f} tok/s), "
            f"measured {tps:.1f} tok/s")
        return row

    sizes = sorted({int(n) for n in candidates})
    if method == "eagle1":  # a static tree: its size and chain (shapes and n-grams are dynamic trees' settings)
        chosen, rows = search_static_budgets(sizes, base, measure, tuple(lookups or ()))
    else:
        chosen, rows = search_budgets(sizes, tuple(shapes or ()), base, measure, tuple(lookups or ()),
                                      tuple(lookup_ngrams or ()))
    if confirm >= 2 and len(rows) >= 2:
        say(f"autotune {method}: timing the best {min(confirm, len(rows))} again")
        best = confirm_finalists(rows, lambda i: profile(budgets[i]), confirm, say,
                                 lambda i: f"autotune {method}: again {describe_budget(budgets[i])}")
        chosen = budgets[best]
    finalists = [i for i, r in enumerate(rows) if "step_over_plain_runs" in r]
    if turns >= 1 and len(finalists) >= 2:
        chosen = budgets[_settle(engine, method, rows, budgets, finalists, prompts, max_new_tokens, turns,
                                 cache_len, say)]
    engine.budgets[method] = chosen
    say(f"autotune {method}: chose {describe_budget(chosen)}")
    slower = slower_than_plain(method, _row_of(rows, chosen))
    if slower:
        say(f"autotune {method}: {slower}")
    kernels = {"matmul": engine.cfg.matmul_impl, "activations": engine.activations, "draft_rows": engine.draft_rows}
    return {"method": method, "model": engine.name, "device": device_tag(), "kernels": kernels,
            "budget": budget_fields(chosen),
            "vanilla_tokens_per_s": vanilla_tps, "candidates": rows, "max_new_tokens": max_new_tokens,
            "prompts": len(prompts), "created": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def _settle(engine, method, rows, budgets, finalists, prompts, max_new_tokens, rounds, cache_len, say) -> int:
    """The finalist that decodes `prompts` fastest against plain decoding, decoded in turns; each
    finalist's row gets `turns_speedup` and `turns_tokens_per_s`. On the Zen 3 VM at stop 77 the
    step profile ranked the 2-token tree first in one of three runs (3 tokens, depth 1, top-k 2 in
    the others), while in turns on the held-out prompts the 3-token tree decoded 1.26x as fast as
    plain decoding and 2 tokens 1.19x."""
    from .bench_turns import settle_in_turns

    label = lambda i: f"#{i} {describe_budget(budgets[i])}"
    say(f"autotune {method}: decoding the calibration prompts with the {len(finalists)} finalists and plain "
        f"decoding in turns, {rounds} round(s)")
    got = settle_in_turns(engine, method, {label(i): budgets[i] for i in finalists}, prompts, max_new_tokens,
                          rounds, cache_len=cache_len)
    release_programs()
    for i in finalists:
        rows[i]["turns_speedup"] = got[label(i)]["speedup_vs_vanilla"]
        rows[i]["turns_tokens_per_s"] = got[label(i)]["tokens_per_s"]
        say(f"autotune {method}: in turns {describe_budget(budgets[i])}: {rows[i]['turns_speedup']:.3f}x plain "
            f"decoding (expected {rows[i][RANK_KEY]:.2f}x)")
    pick = pick_in_turns(rows, budgets, finalists)
    fastest = max(finalists, key=lambda i: rows[i]["turns_speedup"])
    if pick != fastest:
        say(f"autotune {method}: {describe_budget(budgets[pick])} is within {TURNS_TIE:.0%} of the fastest "
            f"({describe_budget(budgets[fastest])}) and computes less: a tie, the cheaper tree wins")
    return pick


def draft_cost(b: TreeBudget) -> tuple:
    """Orders trees by what a step computes: the rows verified (a static tree's chain adds rows),
    then the head's passes (depth) and rows (top-k), then the prompt-lookup chain."""
    rows = b.total_tokens + (b.lookup if b.kind == "static" else 0)
    return (rows, b.depth, b.top_k, b.lookup)


def pick_in_turns(rows, budgets, finalists, tie: float = TURNS_TIE) -> int:
    """The fastest finalist in turns, or, among the finalists within `tie` (relative) of it, the one
    that computes least (`draft_cost`): at stop 77 3 tokens, depth 1, top-k 3 won by 0.3% over the
    same tree drafted with top-k 2 (the same tau), and on the held-out prompts it was the slower."""
    best = max(rows[i]["turns_speedup"] for i in finalists)
    close = [i for i in finalists if rows[i]["turns_speedup"] >= best * (1.0 - tie)]
    return min(close, key=lambda i: (draft_cost(budgets[i]), -rows[i]["turns_speedup"]))


def save_budget(record: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, json.dumps(record, indent=1) + "\n")


def load_budget(path: Path, method: Optional[str] = None) -> TreeBudget:
    """The TreeBudget of a saved autotune record (or of a hand-written {"budget": {...}} file)."""
    try:
        rec = json.loads(Path(path).read_text())
        b = rec["budget"]
        if method is not None and rec.get("method", method) != method:
            raise ValueError(f"{path} was tuned for {rec['method']}, not {method}")
        chain = {"lookup": int(b.get("lookup", 0)), "lookup_min_ngram": int(b.get("lookup_min_ngram", 1))}
        if b.get("kind", "dynamic") == "static":
            from .tree import StaticTree

            return TreeBudget("static", static_tree=StaticTree.from_json(b["paths"]), **chain)
        return TreeBudget(b.get("kind", "dynamic"), total_tokens=int(b["total_tokens"]), depth=int(b["depth"]),
                          top_k=int(b["top_k"]), **chain)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"cannot read a tree budget from {path}: {type(e).__name__}: {e}") from e


def calibration_prompts(engine) -> list[list[int]]:
    """The packaged calibration prompts (training prompts, chat and code; none held out), tokenised."""
    from .training.prompts import CALIBRATION_FILE, load_prompt_file

    return [engine.encode(p["prompt"]) for p in load_prompt_file(CALIBRATION_FILE)]


def tune_and_save(engine, method: str, path: Path, log: Optional[Callable[[str], None]] = None,
                  drafter: str = "", candidates=DEFAULT_CANDIDATES, shapes=DEFAULT_SHAPES,
                  lookups=None, lookup_ngrams=None, max_new_tokens: int = 128, turns: int = 2) -> dict:
    """Autotune `method` on the calibration prompts (`max_new_tokens` each), set it on the engine and
    save it to `path` (lookups, lookup_ngrams: the chain lengths and shortest n-grams to try; None:
    `DEFAULT_LOOKUPS`, `DEFAULT_LOOKUP_NGRAMS`; () keeps the engine's)."""
    lookups = DEFAULT_LOOKUPS if lookups is None else lookups
    lookup_ngrams = DEFAULT_LOOKUP_NGRAMS if lookup_ngrams is None else lookup_ngrams
    rec = autotune_budget(engine, method, calibration_prompts(engine), candidates=candidates, shapes=shapes,
                          lookups=lookups, lookup_ngrams=lookup_ngrams, max_new_tokens=max_new_tokens,
                          turns=turns, log=log)
    rec["drafter"] = drafter
    rec["saved_to"] = str(save_budget(rec, path))
    if log:
        log(f"saved the tuned {method} budget to {path}")
    return rec


def slower_than_plain(method: str, row: dict) -> Optional[str]:
    """What to tell a user of `method` whose tuned tree (`row`: its autotune candidate) was expected
    to decode slower than plain decoding (no tree beat it: the head accepts too little for what a
    step costs on that device); None where it was expected faster, or the row has no measurement."""
    speedup = row.get("expected_speedup")
    if not isinstance(speedup, (int, float)) or not speedup < 1:  # NaN (a timing lost in noise): unknown
        return None
    return (f"on the device it was tuned on, {method} with this tree was expected at {speedup:.2f}× the "
            f"tokens/s of plain decoding (no tree beat it there); --method vanilla decodes faster on such a device")


def _row_of(rows, budget: TreeBudget) -> dict:
    """The first autotune candidate row measured with `budget`'s fields; {} if none was."""
    fields = budget_fields(budget)
    return next((r for r in rows if isinstance(r, dict) and all(r.get(k) == v for k, v in fields.items())), {})


def _tuned_row(path: Path, budget: TreeBudget) -> dict:
    """The candidate row of a saved autotune record that `budget` (loaded from it) came from; {} for
    a hand-written budget file or a record without that row."""
    try:
        rows = json.loads(Path(path).read_text()).get("candidates", [])
        return _row_of(rows if isinstance(rows, list) else [], budget)
    except (OSError, ValueError, AttributeError):
        return {}


def _loaded(path: Path, method: str, log, suffix: str = "") -> TreeBudget:
    """The budget saved at `path`, told to `log` with a note if it was tuned slower than plain decoding."""
    budget = load_budget(path, method)
    if log:
        log(f"tuned tree budget from {path}: {describe_budget(budget)}{suffix}")
        slower = slower_than_plain(method, _tuned_row(path, budget))
        if slower:
            log(f"note: {slower}")
    return budget


def describe_budget(budget: TreeBudget) -> str:
    chain = f" (n-grams >= {budget.lookup_min_ngram})" if budget.lookup and budget.lookup_min_ngram > 1 else ""
    kind = "static tree: " if budget.kind == "static" else ""
    return (f"{kind}{budget.total_tokens} tokens, depth {budget.depth}, top-k {budget.top_k}, "
            f"lookup {budget.lookup}{chain}")


def resolve_budget(model: str, method: str, drafter: str, total_tokens, depth=None, top_k=None,
                   budget_config=None, log: Optional[Callable[[str], None]] = None, lookup: Optional[int] = None,
                   lookup_min_ngram: Optional[int] = None, kernels: str = ""):
    """The tree budget the CLI flags ask for: (TreeBudget or None for vanilla, path to tune into or None).

    lookup (--lookup N) replaces the prompt-lookup chain of whichever budget the other flags pick, and
    lookup_min_ngram (--lookup-min-ngram M) the shortest n-gram it may be found by. kernels:
    `kernel_tag` of the CPU-kernel flags; a budget tuned on this device is looked for (and tuned
    into) under them, the packaged one serves them all.

    --budget-config FILE loads a saved budget; --total-tokens auto loads the one tuned for this
    model / method / drafter / device if it was saved before, else asks the caller to tune it
    (and save it to the returned path); no tree flag at all picks up a budget saved for this device,
    else one packaged for this platform (eagle_jax/assets/budgets/), else `engine.default_budget`."""
    if method == "vanilla":
        return None, None
    budget, path = _resolve_tree(model, method, drafter, total_tokens, depth, top_k, budget_config, log, kernels)
    if lookup is not None:
        budget = dataclasses.replace(budget, lookup=lookup)
        if log:
            log(f"prompt-lookup chain of {lookup} tokens (--lookup)")
    if lookup_min_ngram is not None:
        budget = dataclasses.replace(budget, lookup_min_ngram=lookup_min_ngram)
        if log:
            log(f"prompt-lookup chains found by n-grams of at least {lookup_min_ngram} tokens (--lookup-min-ngram)")
    return budget, path


def _resolve_tree(model, method, drafter, total_tokens, depth, top_k, budget_config, log, kernels):
    from .engine import default_budget

    if budget_config is not None:
        if total_tokens is not None:
            raise ValueError("give either --budget-config or --total-tokens, not both")
        budget = load_budget(budget_config, method)
        if log:
            log(f"tree budget from {budget_config}: {describe_budget(budget)}")
        return budget, None
    if total_tokens == "auto":
        path = default_budget_path(model, method, drafter, kernels)
        if path.exists():
            return _loaded(path, method, log), None
        if log:
            log(f"no tuned tree budget at {path} yet: tuning it once at start-up (minutes: each candidate tree "
                f"is compiled, timed and run on the calibration prompts)")
        return default_budget(method, None, depth, top_k), path
    if total_tokens is None and depth is None and top_k is None:
        tuned = default_budget_path(model, method, drafter, kernels)
        for path in (tuned, packaged_budget_path(model, method, drafter)):
            if path.exists():  # tuned before on this device, else shipped for this platform: the default
                return _loaded(path, method, log, " (--total-tokens N overrides)"), None
    n = None if total_tokens is None else int(total_tokens)
    return default_budget(method, n, depth, top_k), None
