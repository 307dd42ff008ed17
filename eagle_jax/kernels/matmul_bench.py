"""`python -m eagle_jax.bench matmul`: the few-row products of a decoding step, several ways.

For each row count T, one jitted program multiplies [T, K] by `--matrices` different weight
matrices of shape [K, N] (default: SmolLM2's 60 MLP gate/up matrices, 576 × 1536), one after
another as a decoding step does (`_chained`), through (a) XLA's dot on float32 weights, (b) the
float32 CPU kernel (AVX-512 or AVX2) (`cpu_matmul.matmul`), (c) the kernel on Q4_1 blocks
(`cpu_matmul.qmatmul` with precomputed scales; random weights quantised with gguf), as the
target's layers use it, and the draft head's
row kinds: (d) Q8_0 blocks, where the kernel has AVX512-VNNI (e) int8 tiles (`cpu_matmul.imatmul`),
and where it has int8 rows of x (AVX512-VNNI or AVX2) (f) the Q4_1 blocks regrouped for them
(`cpu_qx.xmatmul`, the target's layers with `activations="int8"`) and (g) the Q8_0 blocks regrouped
(the tied LM head's kind, and the draft head's "q8_0x8" rows). Median milliseconds over `--reps` runs
after a warm-up, all measured side by side in one process; a Markdown table on stdout.

    python -m eagle_jax.bench matmul --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_matmul as cm
from . import cpu_qx


def _median_ms(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _chained(product):
    """(x, weights) -> the last product's sum, each product's input made to depend on the one before
    (the first x plus 1e-30 times the previous product's first column: the same float32 values), so
    that they run one after another, as a decoding step's do. Independent products (before stop 69)
    could run side by side, each splitting its columns over the same threads: one kernel thread then
    timed faster than two, the opposite of a decoding step.

    Each input is the *first* x plus one term, not the previous input plus one (stops 69-71): XLA
    fused the whole chain of additions into every product's input, so the i-th input re-added i
    columns, and the products' glue grew with their number and rows (120 [T, 576] x [576, 1536]
    Q4_1 x int8-row products, in one process: 1 row 2.71 against 2.25 ms, 3 rows 5.3 against 3.9;
    tests/test_bench.py checks the compiled program)."""
    def fn(x, ws):
        x0 = x
        for w in ws:
            y = product(x, w)
            x = x0 + 1e-30 * y[:, :1]
        return y.sum()
    return fn


def run(rows=(1, 2, 4, 8, 16), k: int = 576, n: int = 1536, matrices: int = 60, reps: int = 20,
        seed: int = 0) -> list[dict]:
    from gguf import GGMLQuantizationType, quants

    if not cm.available():
        raise SystemExit(f"the CPU matmul kernel is unavailable here: {cm.unavailable_reason()}")
    rng = np.random.default_rng(seed)
    w_nk = [(0.05 * rng.standard_normal((n, k))).astype(np.float32) for _ in range(matrices)]
    w_kn = [jnp.asarray(w.T) for w in w_nk]

    def quantized(kind):  # GGUF blocks and their float32 scales, one pair a matrix
        blocks = [quants.quantize(w, GGMLQuantizationType[kind.upper()]) for w in w_nk]
        return [(jnp.asarray(b), jnp.asarray(cm.block_scales(b, kind))) for b in blocks]

    q = {kind: quantized(kind) for kind in ("q4_1", "q8_0")}
    i8 = [tuple(map(jnp.asarray, cm.pack_i8(w.T))) for w in w_nk] if cm.i8_available() else None
    qx = ({kind: [jnp.asarray(cpu_qx.regroup(np.asarray(b), f"{kind}x8")) for b, _ in q[kind]] for kind in q}
          if cpu_qx.available() else None)

    xla = jax.jit(_chained(jnp.dot))
    f32 = jax.jit(_chained(cm.matmul))
    qsum = jax.jit(lambda x, bs, kind: _chained(lambda x, b: cm.qmatmul(x, b[0], kind, b[1]))(x, bs),
                   static_argnames="kind")
    i8_fn = jax.jit(_chained(lambda x, p: cm.imatmul(x, p[0], p[1], n)))
    qx_fn = jax.jit(lambda x, gs, kind: _chained(lambda x, g: cpu_qx.xmatmul(x, g, kind))(x, gs),
                    static_argnames="kind")
    out = []
    for t in rows:
        x = jnp.asarray(rng.standard_normal((t, k)).astype(np.float32))
        row = {"rows": t, "xla_ms": _median_ms(xla, (x, w_kn), reps), "kernel_f32_ms": _median_ms(f32, (x, w_kn), reps)}
        for kind, bs in q.items():
            row[f"kernel_{kind}_ms"] = _median_ms(functools.partial(qsum, kind=kind), (x, bs), reps)
        row["kernel_i8_ms"] = _median_ms(i8_fn, (x, i8), reps) if i8 is not None else None
        for kind in q:
            row[f"kernel_{kind}x8_ms"] = (_median_ms(functools.partial(qx_fn, kind=f"{kind}x8"), (x, qx[kind]), reps)
                                          if qx is not None else None)
        out.append(row)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m eagle_jax.bench matmul", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--k", type=int, default=576)
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--matrices", type=int, default=60)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    res = run(tuple(int(r) for r in args.rows.split(",")), args.k, args.n, args.matrices, args.reps)
    print(f"{args.matrices} products [T, {args.k}] x [{args.k}, {args.n}], median ms over {args.reps} runs\n")
    print("| rows T | XLA float32 | kernel float32 | kernel Q4_1 blocks | kernel Q8_0 blocks | kernel int8 tiles "
          "| kernel Q4_1 x int8 rows | kernel Q8_0 x int8 rows |\n|---|---|---|---|---|---|---|---|")
    for r in res:
        i8, qx4, qx8 = ("—" if r[c] is None else f"{r[c]:.2f}"
                        for c in ("kernel_i8_ms", "kernel_q4_1x8_ms", "kernel_q8_0x8_ms"))
        print(f"| {r['rows']} | {r['xla_ms']:.2f} | {r['kernel_f32_ms']:.2f} | {r['kernel_q4_1_ms']:.2f} "
              f"| {r['kernel_q8_0_ms']:.2f} | {i8} | {qx4} | {qx8} |")
    return 0
