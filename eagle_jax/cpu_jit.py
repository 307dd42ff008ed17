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

`cpu_stable_jit` is `jax.jit` with that compiler option when JAX's default backend is the CPU, and
plain `jax.jit` elsewhere (the option is XLA:CPU's; GPUs and TPUs compile as before). It keeps the
jitted function's `lower`, `clear_cache` and `_cache_size`.
"""

from __future__ import annotations

import functools

import jax

CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


class cpu_stable_jit:  # noqa: N801 - used as a decorator, like jax.jit
    """`jax.jit(fn, **kw)`, compiled with `CPU_COMPILER_OPTIONS` on the CPU backend (module doc)."""

    def __init__(self, fn, **jit_kwargs):
        self._plain = jax.jit(fn, **jit_kwargs)
        self._cpu = jax.jit(fn, compiler_options=CPU_COMPILER_OPTIONS, **jit_kwargs)
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
