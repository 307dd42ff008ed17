"""`python -m eagle_jax.bench kernel`: the tree-attention kernel against the reference path.

    python -m eagle_jax.bench kernel --tree-sizes 1,16,32,64,128 --lengths 0,500,2000 --cache 2048 --json

For each (tree size T, committed length L) the attention of one layer is timed three ways, in one
process, interleaved after warm-up (median of --reps runs each):

- `reference`: what the decoder does with attention_impl="reference" — the dense [B, T, S] mask
  built from the committed length and the block mask, then softmax attention over all S slots;
- `pallas`: pack the block mask into bits and run the kernel on this platform's backend
  (interpreter on CPU, so CPU figures say little about a TPU or GPU);
- any extra backends given with --backends (e.g. gpu-interpret to compare the two kernel styles).

Shapes default to SmolLM2-135M's attention (9 query heads, 3 kv heads, head_dim 64). Trees are
random (each node's parent drawn among earlier nodes). Reported: milliseconds and the ratio
reference / kernel (> 1: the kernel is faster). No figure is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from .tree_attention import BACKENDS, default_backend, pack_bits, tree_attention


def random_tree_mask(rng, b: int, t: int) -> np.ndarray:
    """bool [B, T, T] ancestor-or-self masks of random trees (node i's parent is drawn from 0..i-1)."""
    mask = np.zeros((b, t, t), bool)
    for bi in range(b):
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        for i in range(t):
            j = i
            while j >= 0:
                mask[bi, i, j] = True
                j = parent[j]
    return mask


def _reference_layer(q, k_cache, v_cache, length, k_new, v_new, mask_btt, pos):
    """The decoder's reference path for one layer: scatter the block's keys, dense mask, dense attention."""
    from ..models.config import ModelConfig
    from ..models.decoder import attention_mask
    from ..models.layers import dense_attention

    b, t = q.shape[:2]
    s = k_cache.shape[1]
    rows = jnp.arange(b)[:, None]
    slots = length[:, None] + jnp.arange(t)[None, :]
    k_all = k_cache.at[rows, slots].set(k_new, mode="drop")
    v_all = v_cache.at[rows, slots].set(v_new, mode="drop")
    mask = attention_mask(ModelConfig(num_heads=1, num_kv_heads=1), pos, length, mask_btt, s)
    return dense_attention(q, k_all, v_all, mask)


def _kernel_layer(backend, block_k):
    def run(q, k_cache, v_cache, length, k_new, v_new, mask_btt, pos):
        return tree_attention(q, k_cache, v_cache, length, k_new, v_new, pack_bits(mask_btt), pos, impl="pallas",
                              backend=backend, block_k=block_k)
    return run


def bench_case(t: int, length: int, *, cache: int, heads: int, kv_heads: int, head_dim: int, batch: int, dtype,
               backends, block_k, reps: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    q = normal(batch, t, heads, head_dim)
    k_cache, v_cache = normal(batch, cache, kv_heads, head_dim), normal(batch, cache, kv_heads, head_dim)
    k_new, v_new = normal(batch, t, kv_heads, head_dim), normal(batch, t, kv_heads, head_dim)
    mask = jnp.asarray(random_tree_mask(rng, batch, t))
    lengths = jnp.full((batch,), length, jnp.int32)
    pos = lengths[:, None] + jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
    args = (q, k_cache, v_cache, lengths, k_new, v_new, mask, pos)
    fns = {"reference": jax.jit(_reference_layer)}
    for be in backends:
        fns[be] = jax.jit(_kernel_layer(be, block_k))
    ref = None
    for name, fn in fns.items():  # warm-up (compile) and a parity check
        out = np.asarray(fn(*args).astype(jnp.float32))
        ref = out if ref is None else ref
        err = float(np.max(np.abs(out - ref)))
        if err > (1e-4 if dtype == jnp.float32 else 5e-2):
            raise AssertionError(f"{name} differs from the reference by {err} (T={t}, L={length})")
    times = {name: [] for name in fns}
    for r in range(reps):
        order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
        for name in order:
            t0 = time.perf_counter()
            fns[name](*args).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    return {"tree_size": t, "length": length, "ms": ms,
            "speedup": {name: ms["reference"] / ms[name] for name in fns if name != "reference"}}


def markdown(rows: list[dict]) -> str:
    names = list(rows[0]["ms"])
    kern = [n for n in names if n != "reference"]
    head = "| T | length | " + " | ".join(f"{n} ms" for n in names) + " | " + " | ".join(
        f"reference/{n}" for n in kern) + " |"
    lines = [head, "|---" * (2 + len(names) + len(kern)) + "|"]
    for r in rows:
        cells = [f"{r['ms'][n]:.3f}" for n in names] + [f"{r['speedup'][n]:.2f}" for n in kern]
        lines.append(f"| {r['tree_size']} | {r['length']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle_jax.bench kernel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    p.add_argument("--tree-sizes", type=ints, default=[1, 16, 32, 64, 128])
    p.add_argument("--lengths", type=ints, default=[0, 500, 1900])
    p.add_argument("--cache", type=int, default=2048, help="cache slots S")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--backends", default=None,
                   help=f"comma-separated kernel backends from {BACKENDS} (default: this platform's)")
    p.add_argument("--block-k", type=int, default=None, help="KV block size (default per backend)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print the result JSON as the last stdout line")
    args = p.parse_args(argv)
    backends = [b.strip() for b in (args.backends or default_backend()).split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; available: {', '.join(BACKENDS)}")
    rows = []
    for t in args.tree_sizes:
        for length in args.lengths:
            if length + t > args.cache:
                print(f"[kernel-bench] skip T={t} L={length}: exceeds the cache ({args.cache})", file=sys.stderr)
                continue
            rows.append(bench_case(t, length, cache=args.cache, heads=args.heads, kv_heads=args.kv_heads,
                                   head_dim=args.head_dim, batch=args.batch, dtype=jnp.dtype(args.dtype),
                                   backends=backends, block_k=args.block_k, reps=args.reps))
            times = ", ".join(f"{k} {v:.3f} ms" for k, v in rows[-1]["ms"].items())
            print(f"[kernel-bench] T={t} L={length}: " + times, file=sys.stderr, flush=True)
    table = markdown(rows)
    from ..bench import machine_info

    result = {"kernel": rows, "machine": machine_info(),
              "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"backends": backends}}
    print(table, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0
