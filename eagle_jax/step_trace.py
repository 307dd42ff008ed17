"""`python -m eagle_jax.bench trace`: where a decoding step's time goes, operation by operation.

A decoding step is one jitted program, so `step_profile` can only split it into drafting,
verification and the rest. This traces `--steps` steps with `jax.profiler` (a Perfetto trace,
no TensorBoard needed) after one prompt's prefill, plain decoding (`decode_advance`) and, with
`--method`, a speculative method's steps (`spec_advance`), and sums XLA:CPU's events per step:

- the custom calls (`ffi_call`: the CPU kernels' weight products, cache attention, top-k), each
  call site's own time (a site runs once a step, or once per draft level), the sites sorted by
  time, and how many sites fall in each duration bucket;
- XLA's own operations by kind (fusions, scatters, copies, loops; a name's numeric suffix dropped);
- both by where in the model they come from (`by_scope`): each event matched by its name to the
  compiled program's instruction and that instruction's JAX name scope (`DecoderLayer/mlp`,
  `Eagle3Module/midlayer/self_attn`, `while/body/...` for drafting's levels), custom calls marked
  `kernel:`. Stop 71 found with it the two copies of the draft head's cache that XLA made every
  step, and the loops of 6 scatters (`speculative.propose_tree_and_cache`, `_commit_path`).

A program's sites have no layer names, but the durations tell them apart: on SmolLM2 the largest
is the LM head (49152 × 576), then gate / up / down (576 × 1536), then q / o, then k / v and the
norms. The events nest (a `while` holds its body), so the kinds' times overlap; the per-step wall
time is measured on its own, without the profiler.

    python -m eagle_jax.bench trace --steps 20
    python -m eagle_jax.bench trace --method eagle3 --json
    python -m eagle_jax.bench trace --method eagle3 --tree 8/3/4   # a tree other than serve's

The profiler adds its own cost to every event, which dwarfs the smallest operations: at stop 59 a
trace put 1.5 ms of an EAGLE-3 step in the `while` loops of its 60 KV-cache scatters, yet writing
those keys with one `dynamic_update_slice` a row instead changed the untraced step by nothing
measurable (timed in turns in one process: 0.997× at the 3-token tree, 1.000× at 16 tokens). So
check any saving a trace suggests with untraced timings.

Stop 52 found with it that the weight products of a plain step on the Xeon VM took 9.0 of its
9.9 ms while streaming the blocks at 7-8 GB/s a core; prefetching them made the step 7.0 ms.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from typing import Optional

import jax
import jax.numpy as jnp

CUSTOM_CALL = re.compile(r"^(ffi_call|custom-call|custom_call)")
SKIP = re.compile(r"^(\$|ThunkExecutor|PjitFunction|CommonPjRt|ParseArguments|end: )")
BUCKETS_MS = (1.0, 0.3, 0.1, 0.05, 0.02, 0.01, 0.0)  # lower edges of the duration buckets


def traced_events(run, trace_dir: str) -> list[tuple[str, float]]:
    """(name, microseconds) of every complete event while `run()` executes under the profiler."""
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(run())
    files = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[0]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [(e["name"], float(e.get("dur", 0.0))) for e in events if e.get("ph") == "X" and "name" in e]


INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name="([^"]*)"')
PROGRAM_PREFIX = re.compile(r"^jit\([^)]*\)/(call_exported/)?(jit\(flat\)/)?(while/body/)?")


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> JAX name scope in a compiled program's text (`Compiled.as_text()`): the
    op_name metadata without the program's own prefix (`jit(spec_advance)/.../while/body/`, the
    advance loop) and without the primitive's name (`DecoderLayer/mlp/mul` -> `DecoderLayer/mlp`;
    an operation outside every scope, such as the target's LM head: "(top level)")."""
    out = {}
    for line in hlo_text.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            scope = PROGRAM_PREFIX.sub("", m.group(2))
            out[m.group(1)] = scope.rpartition("/")[0] or "(top level)"
    return out


def summarize(events: list[tuple[str, float]], steps: int, top: int = 12,
              scopes: Optional[dict[str, str]] = None) -> dict:
    """Per-step sums of `traced_events` over `steps` steps: custom calls by site and bucket, and
    XLA's other operations by kind (milliseconds a step, calls a step); with `scopes`
    (`hlo_scopes`), everything by name scope too (`by_scope`, the `2 * top` largest)."""
    sites = collections.defaultdict(lambda: [0, 0.0])
    kinds = collections.defaultdict(lambda: [0, 0.0])
    by_scope = collections.defaultdict(lambda: [0, 0.0])
    for name, dur in events:
        if SKIP.match(name):
            continue
        table = sites if CUSTOM_CALL.match(name) else kinds
        key = name if table is sites else re.sub(r"[.\d]+$", "", name)
        table[key][0] += 1
        table[key][1] += dur
        if scopes is not None:
            scope = ("kernel: " if table is sites else "") + scopes.get(name, "(unnamed)")
            by_scope[scope][0] += 1
            by_scope[scope][1] += dur
    per_step = lambda n, us: {"calls": n / steps, "ms": us / 1e3 / steps}
    site_rows = sorted((per_step(n, us) for n, us in sites.values()), key=lambda r: -r["ms"])
    buckets = []
    for i, lo in enumerate(BUCKETS_MS):
        hi = BUCKETS_MS[i - 1] if i else float("inf")
        inside = [r for r in site_rows if lo <= r["ms"] / max(r["calls"], 1e-9) < hi]
        buckets.append({"from_ms": lo, "to_ms": hi, "sites": len(inside),
                        "ms": sum(r["ms"] for r in inside), "calls": sum(r["calls"] for r in inside)})
    return {
        "custom_calls": {"ms": sum(r["ms"] for r in site_rows), "calls": sum(r["calls"] for r in site_rows),
                         "top_sites": site_rows[:top], "buckets": [b for b in buckets if b["sites"]]},
        "xla_ops": dict(sorted(((k, per_step(n, us)) for k, (n, us) in kinds.items()),
                               key=lambda kv: -kv[1]["ms"])[:top]),
        **({"by_scope": dict(sorted(((k, per_step(n, us)) for k, (n, us) in by_scope.items()),
                                    key=lambda kv: -kv[1]["ms"])[:2 * top])} if scopes is not None else {}),
    }


def trace_method(engine, method: str, prompt_ids: list[int], steps: int, by_scope: bool = True) -> dict:
    """Wall time a step (no profiler) and `summarize` of a traced run of `steps` steps of `method`
    ("vanilla" or one set up on `engine`) after `prompt_ids`' prefill; `by_scope` compiles the
    program's text once more (from XLA's cache) for the name scopes."""
    from .bench_turns import tree_label
    from .decoding import decode_advance, decode_start
    from .speculative import spec_advance, spec_start

    # room for every step to accept a whole path of any tree (60-token trees: depth 7, chains of 8)
    _, args = engine._request(prompt_ids, steps * 16 + 16, 0.0, 1.0, 0, 0, None, method)
    if method == "vanilla":
        start = decode_start(engine.params, engine.cfg, *args, prefill_chunk=engine.prefill_chunk)
        program, static = decode_advance, {}
        call = lambda fn, s: fn(engine.params, engine.cfg, s, *args[2:], n_steps=jnp.int32(steps), **static)
    else:
        head, budget = engine.heads[method], engine.budgets[method]
        start = spec_start(engine.params, engine.cfg, head, *args, budget=budget, prefill_chunk=engine.prefill_chunk)
        program, static = spec_advance, {"budget": budget}
        call = lambda fn, s: fn(engine.params, engine.cfg, head, s, *args[2:], n_steps=jnp.int32(steps), **static)
    advance = lambda s: call(program, s)
    states = [jax.tree.map(jnp.copy, start) for _ in range(3)]  # the advances donate their state
    jax.block_until_ready(states)
    jax.block_until_ready(advance(states.pop()))  # compile and warm up
    t0 = time.perf_counter()
    jax.block_until_ready(advance(states.pop()))
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    with tempfile.TemporaryDirectory() as d:
        events = traced_events(lambda: advance(states.pop()), d)
    scopes = hlo_scopes(call(program.lower, start).compile().as_text()) if by_scope else None
    out = summarize(events, steps, scopes=scopes)
    tree = None if method == "vanilla" else tree_label(engine.budgets[method])
    return {"method": method, "tree": tree, "steps": steps, "wall_ms_per_step": wall_ms, **out}


def markdown(res: dict) -> str:
    cc = res["custom_calls"]
    tree = f" (tree {res['tree']})" if res.get("tree") else ""
    lines = [f"{res['method']}{tree}: {res['wall_ms_per_step']:.2f} ms a step (untraced); custom calls "
             f"{cc['ms']:.2f} ms in {cc['calls']:.0f} calls a step", "",
             "| call duration | sites | calls a step | ms a step |", "|---|---|---|---|"]
    for b in cc["buckets"]:
        hi = "" if b["to_ms"] == float("inf") else f"{b['to_ms']:g}"
        lines.append(f"| {b['from_ms']:g}–{hi} ms | {b['sites']} | {b['calls']:.0f} | {b['ms']:.3f} |")
    lines += ["", "| custom-call site (largest) | calls a step | ms a step |", "|---|---|---|"]
    lines += [f"| {i + 1} | {r['calls']:g} | {r['ms']:.3f} |" for i, r in enumerate(cc["top_sites"])]
    lines += ["", "| XLA operation | calls a step | ms a step |", "|---|---|---|"]
    lines += [f"| {k} | {v['calls']:.1f} | {v['ms']:.3f} |" for k, v in res["xla_ops"].items()]
    if "by_scope" in res:
        lines += ["", "| name scope (kernel: custom calls) | calls a step | ms a step |", "|---|---|---|"]
        lines += [f"| {k} | {v['calls']:.1f} | {v['ms']:.3f} |" for k, v in res["by_scope"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    from .models.quantized import ACTIVATIONS

    p = argparse.ArgumentParser(prog="python -m eagle_jax.bench trace", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="vanilla", help="vanilla, eagle1, eagle2 or eagle3 (with its serve tree)")
    p.add_argument("--tree", default="serve", help="the speculative method's tree, as `bench turns` takes it: "
                   "N/D/K or N/D/K/L (eagle2, eagle3), sN or sN/L (eagle1), a budget .json, or serve")
    p.add_argument("--drafter", default="default")
    p.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                   help="the target's few-row products on float32 or int8 rows of x (Engine's `activations`)")
    p.add_argument("--json", action="store_true", help="print the result JSON as the last stdout line")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    from .bench_turns import parse_tree
    from .engine import Engine

    budget = None
    if args.method != "vanilla":
        try:
            budget = parse_tree(args.tree, args.method)
        except ValueError as e:
            p.error(str(e))
    elif args.tree != "serve":
        p.error("--tree is the tree of a speculative --method")
    engine = Engine(args.model, activations=args.activations)
    methods = ["vanilla"]
    if args.method != "vanilla":
        engine.add_method(args.method, args.drafter, budget=budget)
        methods.append(args.method)
    ids = engine.encode(args.prompt)
    results = [trace_method(engine, m, ids, args.steps) for m in methods]
    print("\n\n".join(markdown(r) for r in results), file=sys.stderr)
    if args.json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
