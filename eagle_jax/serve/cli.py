"""`python -m eagle_jax.serve`: one-shot decoding, an OpenAI-compatible HTTP server, or a chat.

  --prompt TEXT | --prompts FILE.jsonl   decode and exit. Without `--json`, text to stdout and
                                         statistics to stderr; with `--json`, exactly one JSON object
                                         per prompt on stdout (fields in DESIGN.md) and nothing else.
  --host H --port P                      serve /v1/chat/completions, /v1/completions, /v1/models,
                                         /health, /metrics until SIGTERM/SIGINT.
  --chat                                 chat in the terminal (streams; tokens/s and tau per answer).

The default method is eagle3 with the drafter packaged for the model (SmolLM2-135M-Instruct has
one), else plain decoding; `--method vanilla` turns speculation off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..models.quantized import ACTIVATIONS, DRAFT_ROWS

METHODS = ("vanilla", "eagle1", "eagle2", "eagle3")


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """The CPU-kernel options serve and the benchmark share: --matmul, --draft-rows, --activations and
    --prefill-chunk (the Engine's `matmul`, `draft_rows`, `activations` and `prefill_chunk`)."""
    p.add_argument("--matmul", default="auto", choices=("auto", "cpu_kernel", "xla"),
                   help="weight products: the few-row CPU kernel (AVX-512 or AVX2; reads a GGUF model's Q4_1/Q8_0 "
                        "blocks; same float32 results), XLA's dot, or auto (the kernel on an x86-64 CPU where it "
                        "builds)")
    p.add_argument("--draft-rows", default="auto", choices=DRAFT_ROWS,
                   help="with the CPU kernel: the draft head rounded to bfloat16 for AVX512-BF16 products (b16), "
                        "to int8 for AVX512-VNNI products (i8), quantised to Q4_1 or Q8_0 and multiplied by int8 rows "
                        "of x as the target's int8 activations are (q4_1x8, q8_0x8) or by float32 rows (q4_1, q8_0), "
                        "or its float16 checkpoint values exactly; auto: q4_1x8 where the CPU has AVX512-VNNI or "
                        "AVX2, else b16 where it has AVX512-BF16, else q8_0 (the "
                        "output is the same whichever)")
    p.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                   help="with the CPU kernel and a GGUF model: the target's few-row products on float32 rows of x "
                        "(exactly the converted model, as transformers computes it) or on x rounded to int8 a "
                        "32-value block (as llama.cpp computes GGUF models; 1.5-2x as fast a step); auto: int8 "
                        "where the kernel has int8 products (AVX512-VNNI or AVX2). Speculative output equals plain "
                        "output either way")
    p.add_argument("--prefill-chunk", default="auto",
                   help="prompt tokens per prefill pass: N, or BIG,TAIL (chunks of BIG while 3/4 of one remains, "
                        "then of TAIL); auto: 128,8 with the CPU kernel, else 64")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_jax.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="one prompt (the chat template is applied unless --raw)")
    src.add_argument("--prompts", type=Path, help='JSONL file with lines {"id": ..., "prompt": "..."}')
    src.add_argument("--chat", action="store_true", help="interactive chat in the terminal")
    src.add_argument("--port", type=int, default=None, help="serve HTTP on this port (OpenAI-compatible)")
    p.add_argument("--host", default=None, help="address to serve on (default 127.0.0.1; implies serving)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="alias, Hugging Face directory or .gguf file (default: %(default)s)")
    p.add_argument("--method", default=None, choices=METHODS,
                   help="decoding method (default: eagle3 when a drafter is packaged for the model or "
                        "--drafter is given, else vanilla). "
                        "eagle1 = EAGLE-1 head + static tree; eagle2 = EAGLE-1 head + dynamic tree; "
                        "eagle3 = EAGLE-3 head + dynamic tree")
    p.add_argument("--drafter", default="default",
                   help="draft head: 'default' (packaged), a directory in the released EAGLE layouts, "
                        "'random' (seeded random head) or 'oracle' (the target drafts for itself)")
    p.add_argument("--total-tokens", type=_tokens_arg, default=None,
                   help="nodes verified per step (root incl.; eagle1: the static tree's first N nodes), or 'auto': "
                        "the tree (size, depth, top-k; eagle1: size) tuned for this model, drafter and device "
                        "(tuned once and saved if there is none yet)")
    p.add_argument("--budget-config", type=Path, default=None,
                   help="a tree budget saved by `python -m eagle_jax.bench --total-tokens auto` (JSON)")
    p.add_argument("--depth", type=int, default=None,
                   help="dynamic tree: expansion steps (0: the root's best children alone, no expansion)")
    p.add_argument("--tree-top-k", type=int, default=None, help="dynamic tree: children per node and frontier width")
    p.add_argument("--lookup", type=int, default=None,
                   help="graft a chain of up to N tokens copied from the context by n-gram lookup onto every draft "
                        "tree, in place of its N weakest nodes where a chain is found (more tokens a step where the "
                        "text repeats itself; lossless like the rest of the tree). 0: none; default: what the "
                        "tuned, packaged or default budget says")
    p.add_argument("--lookup-min-ngram", type=int, default=None,
                   help="find the lookup chain by n-grams of at least M tokens (1-3: larger finds fewer, surer "
                        "chains); default: what the budget says")
    p.add_argument("--attention", default="reference", choices=("reference", "pallas"),
                   help="target attention: the jnp reference or the Pallas tree-attention kernel (Mosaic on TPU, "
                        "Triton on GPU, Pallas' interpreter elsewhere)")
    add_kernel_arguments(p)
    p.add_argument("--layers", default="auto", choices=("auto", "unroll", "scan"),
                   help="target layers: unrolled (fastest on CPU), scanned over the stacked weights (faster compiles), "
                        "or auto (unroll on CPU, scan elsewhere); the same numbers either way")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter/activation dtype (float32 is fastest on CPU)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="largest prompt + new tokens accepted (default: the model's context length for "
                        "--prompt/--prompts, 2048 for --chat and the server)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout, nothing else")
    srv = p.add_argument_group("server (--host/--port)")
    srv.add_argument("--max-active", type=int, default=8, help="generations in flight at once (default 8)")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="queued requests beyond which new ones get 503 + Retry-After (default 256)")
    srv.add_argument("--cache-buckets", default=None,
                     help="comma-separated cache lengths compiled at start (default 512 and --max-cache-len)")
    srv.add_argument("--default-max-tokens", type=int, default=512,
                     help="max_tokens when a request gives none (capped by the context)")
    srv.add_argument("--steps-per-turn", type=int, default=1,
                     help="device steps per scheduling turn (higher: less overhead, coarser streaming)")
    srv.add_argument("--api-key", default=None,
                     help="require `Authorization: Bearer KEY` on /v1/* (default: $EAGLE_JAX_API_KEY, else open)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may take to finish after SIGTERM")
    srv.add_argument("--system", default=None, help="--chat: a system message")
    return p


def _tokens_arg(v: str):
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tree tokens or 'auto', got {v!r}") from None


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


def _fail(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # transformers (tokenizers, chat templates, configs) says on import that PyTorch was not found and
    # its models are unavailable: true and beside the point for serving, which never uses them
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    serving = args.port is not None or args.host is not None
    if not (args.prompt is not None or args.prompts or args.chat or serving):
        return _fail("give --prompt TEXT, --prompts FILE.jsonl, --chat, or --host/--port to serve")
    try:
        from ..sampling import validate_sampling

        validate_sampling(args.temperature, args.top_p, args.top_k)
        if args.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
        prompts = read_prompts(args.prompts) if args.prompts else [(0, args.prompt)]
    except (ValueError, OSError) as e:
        return _fail(str(e))

    from ..autotune import kernel_tag, resolve_budget
    from .server import pick_method

    say = lambda msg: print(f"[eagle_jax] {msg}", file=sys.stderr, flush=True)
    try:
        method = pick_method(args.model, args.method, args.drafter)
        budget, tune_path = resolve_budget(args.model, method, args.drafter, args.total_tokens, args.depth,
                                           args.tree_top_k, args.budget_config, log=say, lookup=args.lookup,
                                           lookup_min_ngram=args.lookup_min_ngram,
                                           kernels=kernel_tag(args.matmul, args.activations, args.draft_rows))
    except ValueError as e:
        return _fail(str(e))
    if serving:
        return _serve(args, method, budget, tune_path)

    from ..engine import Engine, parse_prefill_chunk

    try:
        from .server import SERVING_CACHE_LEN

        cache = args.max_cache_len or (SERVING_CACHE_LEN if args.chat else None)
        engine = Engine(args.model, dtype=args.dtype, attention=args.attention, max_cache_len=cache,
                        layers=args.layers, matmul=args.matmul, draft_rows=args.draft_rows,
                        activations=args.activations, method=method, drafter=args.drafter, budget=budget,
                        prefill_chunk=parse_prefill_chunk(args.prefill_chunk))
    except (ValueError, OSError, RuntimeError) as e:  # unknown model, bad checkpoint, failed download
        return _fail(str(e))
    if tune_path is not None:
        from ..autotune import tune_and_save

        tune_and_save(engine, method, tune_path, log=say, drafter=args.drafter,
                      lookups=None if args.lookup is None else (),
                      lookup_ngrams=None if args.lookup_min_ngram is None else ())
    if args.chat:
        from .chat import run_chat

        return run_chat(engine, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed, system=args.system)
    status = 0
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    for pid, prompt in prompts:
        try:
            ids = engine.encode(prompt, raw=args.raw)
            seconds = engine.compile_for(ids, args.max_new_tokens, **sampling)  # the speed below is decoding's
            if seconds is not None:  # a new cache size
                say(f"compiled {engine.method} decoding for a {engine.check_fits(len(ids), args.max_new_tokens)}-"
                    f"token cache in {seconds:.1f}s (once per cache size and process; the traced and compiled "
                    "programs are cached on disk)")
            g = engine.generate_ids(ids, args.max_new_tokens, seed=args.seed, id=pid, **sampling)
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


def _serve(args, method: str, budget, tune_path=None) -> int:
    from ..engine import parse_prefill_chunk
    from .server import SERVING_CACHE_LEN, ServeOptions, run_server

    try:
        buckets = tuple(int(x) for x in args.cache_buckets.split(",")) if args.cache_buckets else ()
        if min(args.max_active, args.steps_per_turn, args.default_max_tokens, args.max_waiting) < 1:
            raise ValueError("--max-active, --max-waiting, --steps-per-turn and --default-max-tokens must be "
                             "at least 1")
        opts = ServeOptions(model=args.model, method=method, drafter=args.drafter, budget=budget, tune_path=tune_path,
                            tune_lookups=None if args.lookup is None else (),
                            tune_lookup_ngrams=None if args.lookup_min_ngram is None else (),
                            dtype=args.dtype, layers=args.layers, matmul=args.matmul, draft_rows=args.draft_rows,
                            activations=args.activations,
                            prefill_chunk=parse_prefill_chunk(args.prefill_chunk), attention=args.attention,
                            max_cache_len=args.max_cache_len or SERVING_CACHE_LEN,
                            cache_buckets=buckets,
                            max_active=args.max_active, max_waiting=args.max_waiting,
                            steps_per_turn=args.steps_per_turn,
                            default_max_tokens=args.default_max_tokens, served_model_name=args.served_model_name,
                            shutdown_timeout=args.shutdown_timeout,
                            api_key=args.api_key or os.environ.get("EAGLE_JAX_API_KEY") or None)
        opts.buckets()
    except ValueError as e:
        return _fail(f"bad server option: {e}")
    return run_server(opts, host=args.host or "127.0.0.1", port=args.port if args.port is not None else 8000)
