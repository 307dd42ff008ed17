"""`python -m eagle_jax.bench turns`: settings of one speculative method compared in one process.

    python -m eagle_jax.bench turns --method eagle3 --rows i8,q4_1x8 --trees 3/1/2,4/2/4 \
        --prompts chat,code --limit 8 --rounds 3

Process against process, this project's VMs drift more than most changes move (plain decoding
137-180 tok/s on one VM kind within a day), so a comparison of draft-row kinds or trees runs
them in one process: the target is loaded once, a head once per draft-row kind, and every prompt
is decoded by plain decoding and by each setting (the cross product of --rows and --trees) in
turns, the order reversed every other prompt, for --rounds rounds after one warm-up decode of
each. Each setting's greedy tokens are checked against plain decoding's.

A tree is N/D/K (total tokens, depth, top-k of a dynamic tree: eagle2, eagle3) or N/D/K/L (with a
lookup chain of up to L tokens); sN or sN/L the static tree of N nodes (eagle1:
`tree.static_tree_of_size`, with a chain of up to L); a path ending in .json a saved tree budget
(an autotune record, `autotune.load_budget`); `serve` the tree serve runs (tuned on this device,
else packaged). Rows are the
Engine's `draft_rows` kinds (only the CPU kernel reads them; `auto` is this machine's default).
After every round a line gives each setting's tokens/s over plain decoding's and its tau so far,
per prompt set and pooled; the last stdout line is the JSON of the final figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

from .draft.drafting import TreeBudget

# Every setting keeps its compiled program for the whole run; on XLA:CPU each of SmolLM2's holds
# thousands of memory maps (`autotune.release_programs`), of the 65530 a Linux process may hold.
MAX_SETTINGS = 12


def parse_tree(spec: str, method: str = "eagle3") -> Optional[TreeBudget]:
    """"N/D/K" or "N/D/K/L" → a dynamic TreeBudget (eagle2, eagle3); "sN" or "sN/L" → the static
    tree of N nodes (eagle1); "PATH.json" → the budget saved there; "serve" → None (the tree serve
    would run). A tree of the other kind than `method` drafts is refused."""
    if spec == "serve":
        return None
    if spec.endswith(".json"):
        from .autotune import load_budget

        b = load_budget(spec, method)
    else:
        static = spec.startswith("s")
        try:
            nums = [int(p) for p in spec[static:].split("/")]
        except ValueError:
            nums = []
        if len(nums) not in ((1, 2) if static else (3, 4)):
            raise ValueError(f"a tree is N/D/K or N/D/K/L (total tokens, depth, top-k, lookup), sN or sN/L (a static "
                             f"tree of N nodes), a budget .json or 'serve', got {spec!r}")
        lookup = nums[-1] if len(nums) in (2, 4) else 0
        if static:
            from .tree import static_tree_of_size

            b = TreeBudget("static", static_tree=static_tree_of_size(nums[0]), lookup=lookup)
        else:
            b = TreeBudget("dynamic", total_tokens=nums[0], depth=nums[1], top_k=nums[2], lookup=lookup)
    want = "static" if method == "eagle1" else "dynamic"
    if b.kind != want:
        raise ValueError(f"{method} drafts {want} trees ({'sN or sN/L' if want == 'static' else 'N/D/K or N/D/K/L'}), "
                         f"got the {b.kind} tree {spec!r}")
    return b


def tree_label(b: TreeBudget) -> str:
    chain = f"/{b.lookup}" if b.lookup else ""
    if b.kind == "static":
        return f"s{b.total_tokens}{chain}"
    return f"{b.total_tokens}/{b.depth}/{b.top_k}{chain}"


def run_turns(engine, method: str, heads: dict, budgets: dict, prompts: list[tuple[str, list[int]]],
              max_new_tokens: int, rounds: int, log=None, cache_len: Optional[int] = None) -> dict:
    """Decode every (set, prompt ids) with plain decoding and each setting in turns, `rounds` times.

    heads: {rows label: DraftHead}; budgets: {tree label: TreeBudget}; settings are their cross
    product, labelled "rows tree" (the tree's label alone where rows is ""). cache_len: the cache
    shape every decode shares (default: the longest prompt's, `Engine.check_fits`). Returns
    {"vanilla": {...}, "settings": {label: {..., "sets": {set: {...}}}}, "rounds": [...]}:
    `bench.summarize`'s figures (tokens_per_s, tau, speedup_vs_vanilla, ...) over every round so
    far, pooled and per prompt set."""
    from .bench import summarize

    settings = {f"{r} {t}".strip(): (heads[r], budgets[t]) for r in heads for t in budgets}
    if cache_len is None:  # one shape for all
        cache_len = engine.check_fits(max(len(ids) for _, ids in prompts), max_new_tokens)

    def decode(label, ids):
        if label != "vanilla":
            engine.heads[method], engine.budgets[method] = settings[label]
        g = engine.generate_ids(ids, max_new_tokens, cache_len=cache_len,
                                method="vanilla" if label == "vanilla" else method)
        return {"tokens": g.tokens, "new_tokens": g.new_tokens, "target_calls": g.target_calls,
                "seconds": g.seconds, "accept_lengths": g.accept_lengths}

    order = ["vanilla", *settings]
    for label in order:  # compile and warm every program before anything is counted
        decode(label, prompts[0][1])
    rows = {s: {label: [] for label in order} for s, _ in prompts}  # {set: {label: [row, ...]}}
    history = []
    for rnd in range(rounds):
        for k, (s, ids) in enumerate(prompts):
            got = {label: decode(label, ids) for label in (order if (rnd + k) % 2 == 0 else order[::-1])}
            for label, row in got.items():
                if row["tokens"] != got["vanilla"]["tokens"]:
                    raise AssertionError(f"{label} decoded prompt {k} ({s}) differently from plain decoding")
                rows[s][label].append(row)
        pooled = summarize({label: [r for by_label in rows.values() for r in by_label[label]] for label in order})
        per_set = {s: summarize(by_label) for s, by_label in rows.items()}
        summary = {label: pooled[label] | {"sets": {s: per_set[s][label] for s in rows}} for label in order}
        history.append({"vanilla": summary.pop("vanilla"), "settings": summary})
        if log:
            log(f"round {rnd + 1}/{rounds}: " + _line(history[-1]))
    return history[-1] | {"rounds": history}


def settle_in_turns(engine, method: str, budgets: dict, prompts: list[list[int]], max_new_tokens: int,
                    rounds: int, cache_len: Optional[int] = None, log=None) -> dict:
    """Autotuning's last word (`autotune.autotune_budget`): decode `prompts` with plain decoding and
    with each tree of `budgets` ({label: TreeBudget}: the finalists) in turns, `rounds` rounds of
    `run_turns` with the engine's head for `method`, and return {label: {"speedup_vs_vanilla",
    "tokens_per_s", "tau", ...}} over all rounds; the engine's head and tree for `method` are left
    as they were. A step profile times a step on one state; these are whole generations."""
    head, kept = engine.heads[method], engine.budgets[method]
    try:
        got = run_turns(engine, method, {"": head}, budgets, [("calibration", ids) for ids in prompts],
                        max_new_tokens, rounds, log, cache_len=cache_len)
    finally:
        engine.heads[method], engine.budgets[method] = head, kept
    return {label: got["settings"][label] for label in budgets}


def _line(summary: dict) -> str:
    parts = [f"vanilla {summary['vanilla']['tokens_per_s']:.1f} tok/s"]
    for label, f in summary["settings"].items():
        per = ", ".join(f"{s} {g['speedup_vs_vanilla']:.3f}x tau {g['tau']:.3f}" for s, g in f["sets"].items())
        parts.append(f"{label}: {f['speedup_vs_vanilla']:.3f}x tau {f['tau']:.3f} ({per})")
    return " | ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    from .serve.cli import add_kernel_arguments

    p = argparse.ArgumentParser(prog="python -m eagle_jax.bench turns", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="eagle3", choices=("eagle1", "eagle2", "eagle3"))
    p.add_argument("--drafter", default="default")
    p.add_argument("--rows", default="auto", help="comma-separated draft-row kinds (Engine's draft_rows)")
    p.add_argument("--trees", default="serve",
                   help="comma-separated trees: N/D/K or N/D/K/L (eagle2, eagle3), sN or sN/L (eagle1), "
                        "a budget .json, or serve")
    p.add_argument("--prompts", default="chat,code")
    p.add_argument("--limit", type=int, default=8, help="prompts per set")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_kernel_arguments(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .autotune import resolve_budget
    from .bench import machine_info, read_prompt_sets
    from .engine import Engine, parse_prefill_chunk
    from .models.quantized import DRAFT_ROWS

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    try:
        trees = {spec: parse_tree(spec, args.method) for spec in (t.strip() for t in args.trees.split(",")) if spec}
        texts = [(name, p) for name, ps in read_prompt_sets(args.prompts, args.limit) for p in ps]
        if args.rounds < 1 or args.max_new_tokens < 1 or not rows or not trees:
            raise ValueError("need --rounds and --max-new-tokens >= 1, and at least one row kind and one tree")
        if len(rows) * len(trees) > MAX_SETTINGS:
            raise ValueError(f"{len(rows)} row kinds x {len(trees)} trees are more than {MAX_SETTINGS} settings "
                             f"one process can hold compiled; split them over runs")
        if bad := [r for r in rows if r not in DRAFT_ROWS]:
            raise ValueError(f"unknown draft-row kind(s) {bad}; choose from {', '.join(DRAFT_ROWS)}")
    except (ValueError, OSError) as e:  # OSError: a prompt file that cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = lambda s: print(f"[turns] {s}", file=sys.stderr, flush=True)  # noqa: E731
    engine = Engine(args.model, matmul=args.matmul, activations=args.activations,
                    prefill_chunk=parse_prefill_chunk(args.prefill_chunk))
    try:
        heads = {r: engine.load_head(args.method, args.drafter, rows=r) for r in rows}
    except (ValueError, RuntimeError) as e:  # a row kind this machine cannot run, a drafter that is not there
        print(f"error: {e}", file=sys.stderr)
        return 2
    budgets = {}
    for spec, b in trees.items():
        b = b or resolve_budget(args.model, args.method, args.drafter, None, kernels=engine.kernel_tag)[0]
        budgets[tree_label(b) + (" (serve)" if spec == "serve" else f" ({Path(spec).name})" if spec.endswith(".json")
                                 else "")] = b
    engine.add_method(args.method, next(iter(heads.values())), next(iter(budgets.values())))
    prompts = [(name, engine.encode(p)) for name, p in texts]
    log(f"{len(prompts)} prompts, {args.rounds} rounds, settings: rows {rows} x trees {list(budgets)}")
    result = run_turns(engine, args.method, heads, budgets, prompts, args.max_new_tokens, args.rounds, log)
    result["machine"] = machine_info()
    result["args"] = vars(args)
    result["budgets"] = {k: dataclasses.asdict(b) for k, b in budgets.items()}
    print(json.dumps(result, default=str))
    return 0
