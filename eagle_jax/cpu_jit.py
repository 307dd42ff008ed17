"""`jax.jit` for the decoding programs, compiled on XLA:CPU so that their roundings do not depend on
the program around them.

Lossless speculative decoding needs a token's logits to be the same bits in the plain decoding
program and in the speculative one (a tree verification), whatever else each program computes.
The CPU kernels guarantee that for their products and attention (`kernels/cpu_matmul.cc`,
`kernels/cpu_attention.cc`), but XLA still computes the elementwise glue (RoPE's x cos + rot sin,
the norms' scaling, the MLP's gating). XLA:CPU's newer fusion emitters (jaxlib 0.10) compile the
same fusion, with the same HLO, to code that rounds differently in different programs: measured on
SmolLM2, the keys of a verified token differed from the plain step's in one unit of the last place
(the rotated half of RoPE, where a multiply and an add were fused in one program and not in the
other). With float32 rows of x that almost never changes a greedy token; with rows of x rounded to
int8 (`Engine(activations="int8")`) an ulp moves some values across a rounding boundary, and 12 of 16
benchmark prompts decoded speculatively drifted from plain decoding. XLA's older emitters
(`xla_cpu_use_fusion_emitters=False`) compile such fusions the same way everywhere; the decoding
programs measured as fast with them (170 vs 167 tokens/s plain, 213 vs 213 EAGLE-3).

The emitters are not the only source: XLA:CPU always lets LLVM contract a multiply and an add into
one fused multiply-add, and at backend optimisation levels 1 and 2 (not 0 or 3) how it contracted
RoPE's `x cos + rot sin` depended on the fused loop's length, so the CPU-kernel path rotates with
exact products, which no contraction changes (`models/layers.py`, `apply_rope(..., exact=True)`).
Glue that multiplies and adds in one fusion must be written that way too.

`cpu_stable_jit` is `jax.jit` with that compiler option when JAX's default backend is the CPU, and
plain `jax.jit` elsewhere (the option is XLA:CPU's; GPUs and TPUs compile as before). It keeps the
jitted function's `lower`, `clear_cache` and `_cache_size`. On the CPU backend its programs also go
through the traced-program cache when that is on (`program_cache.py`: a new process reads the traced
program from disk instead of tracing it), and every trace of one, cached or not, counts in
`TRACE_COUNTS` under its `trace_name` (the tests' check that a program compiles once per shape).
"""

from __future__ import annotations

import functools
import inspect
import threading

import jax

from . import program_cache

CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}
TRACE_COUNTS: dict[str, int] = {}  # trace_name -> traces of that program in this process
_COUNT_LOCK = threading.Lock()


def _traced(fn, static_names: frozenset, name: str, cached: bool):
    """What jax.jit traces for `fn`: `fn` itself, through the program cache when `cached`, with
    the trace counted. Keeps `fn`'s signature (static and donated arguments are found by name)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with _COUNT_LOCK:  # programs may be traced in threads (`Engine.compile_streams`)
            TRACE_COUNTS[name] = TRACE_COUNTS.get(name, 0) + 1
        if cached:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            static = {k: v for k, v in bound.arguments.items() if k in static_names}
            dynamic = {k: v for k, v in bound.arguments.items() if k not in static_names}
            try:
                return program_cache.cached_call(fn, static, dynamic)
            except program_cache.NotCached as miss:
                out = fn(*args, **kwargs)
                miss.warn()
                return out
        return fn(*args, **kwargs)

    return traced


class cpu_stable_jit:  # noqa: N801 - used as a decorator, like jax.jit
    """`jax.jit(fn, **kw)`, compiled with `CPU_COMPILER_OPTIONS` on the CPU backend (module doc);
    `trace_name` (default: the function's name) is its key in `TRACE_COUNTS`."""

    def __init__(self, fn, trace_name: str | None = None, **jit_kwargs):
        names = jit_kwargs.get("static_argnames", ())
        static = frozenset((names,) if isinstance(names, str) else names)
        name = trace_name or fn.__name__
        self._plain = jax.jit(_traced(fn, static, name, cached=False), **jit_kwargs)
        self._cpu = jax.jit(_traced(fn, static, name, cached=True), compiler_options=CPU_COMPILER_OPTIONS,
                            **jit_kwargs)
        functools.update_wrapper(self, fn)

    def _pick(self):
        return self._cpu if jax.default_backend() == "cpu" else self._plain

    def __call__(self, *args, **kwargs):
        return self._pick()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._pick().lower(*args, **kwargs)

    def clear_cache(self) -> None:
        self._plain.clear_cache()
        self._cpu.clear_cache()

    def _cache_size(self) -> int:
        return self._plain._cache_size() + self._cpu._cache_size()
