"""The one-shot CLI: decode one prompt (`--prompt`) or a JSONL file of prompts (`--prompts`).

Without `--json`, the text goes to stdout and statistics to stderr. With `--json`, stdout carries
exactly one JSON object per prompt (fields in DESIGN.md) and nothing else; progress and logs go
to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METHODS = ("vanilla", "eagle1", "eagle2", "eagle3")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_jax.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (the chat template is applied unless --raw)")
    src.add_argument("--prompts", type=Path, help='JSONL file with lines {"id": ..., "prompt": "..."}')
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="alias, Hugging Face directory or .gguf file (default: %(default)s)")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="decoding method (default: eagle3 when --drafter is given, else vanilla). "
                        "eagle1 = EAGLE-1 head + static tree; eagle2 = EAGLE-1 head + dynamic tree; "
                        "eagle3 = EAGLE-3 head + dynamic tree")
    p.add_argument("--drafter", default="default",
                   help="draft head: 'default' (packaged), a directory in the released EAGLE layouts, "
                        "'random' (seeded random head) or 'oracle' (the target drafts for itself)")
    p.add_argument("--total-tokens", type=int, default=None, help="dynamic tree: nodes verified per step (root incl.)")
    p.add_argument("--depth", type=int, default=None, help="dynamic tree: expansion steps")
    p.add_argument("--tree-top-k", type=int, default=None, help="dynamic tree: children per node and frontier width")
    p.add_argument("--attention", default="reference", choices=("reference",),
                   help="attention implementation (the Pallas kernel is not implemented yet)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter/activation dtype (float32 is fastest on CPU)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="largest prompt + new tokens accepted (default: the model's context length)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout, nothing else")
    return p


def read_prompts(path: Path) -> list[tuple[object, str]]:
    """(id, prompt) pairs from a JSONL file; a bad line raises ValueError with its line number."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f'{path}:{n}: expected an object with a string "prompt"')
            out.append((obj.get("id", len(out)), obj["prompt"]))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from ..sampling import validate_sampling

        validate_sampling(args.temperature, args.top_p, args.top_k)
        if args.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
        prompts = read_prompts(args.prompts) if args.prompts else [(0, args.prompt)]
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from ..engine import Engine, default_budget

    try:
        # The packaged SmolLM2 heads are lossless but do not yet beat plain decoding on a CPU, so
        # plain decoding stays the default unless a drafter is named.
        method = args.method or ("eagle3" if args.drafter != "default" else "vanilla")
        budget = None if method == "vanilla" else default_budget(method, args.total_tokens, args.depth, args.tree_top_k)
        engine = Engine(args.model, dtype=args.dtype, attention=args.attention, max_cache_len=args.max_cache_len,
                        method=method, drafter=args.drafter, budget=budget)
    except (ValueError, OSError, RuntimeError) as e:  # unknown model, bad checkpoint, failed download
        print(f"error: {e}", file=sys.stderr)
        return 2
    status = 0
    for pid, prompt in prompts:
        try:
            g = engine.generate(prompt, args.max_new_tokens, raw=args.raw, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, id=pid)
        except ValueError as e:
            print(f"error: prompt {pid!r}: {e}", file=sys.stderr)
            status = 2
            continue
        if args.json:
            print(json.dumps(g.to_json()), flush=True)
        else:
            print(g.text, flush=True)
            print(f"[{g.new_tokens} tokens in {g.seconds:.2f}s = {g.new_tokens / max(g.seconds, 1e-9):.1f} tok/s, "
                  f"{g.target_calls} target calls, tau {g.tau:.2f}]", file=sys.stderr)
    return status
