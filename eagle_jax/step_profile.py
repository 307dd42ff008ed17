"""Where a speculative step's time goes: drafting, verification and the rest, measured.

One speculative step is a single jitted computation (draft → verify → accept → commit), so its
parts cannot be timed from inside. `profile_spec_step` times them as separate jitted programs on
a real state (after the prompt's prefill) — the drafting alone (`propose_tree`: the head's tree
and any prompt-lookup chain), the verification alone (the target's pass over the padded tree,
logits included) and the whole step (`spec_advance` by one step) — each the median of `reps` runs
after a warm-up. `other_ms` is the whole step minus the two parts (acceptance, the KV commit,
re-feeding the head, dispatch); it is a difference of medians, so it can come out slightly
negative on a noisy machine. `plain_ms` is one plain decoding step (`decode_advance` by one
token) on the same prompt, its runs alternated with the whole step's. `step_over_plain` is the
median of the ratios of each step's run to the plain run right after it, which holds while a
shared machine's speed drifts (autotuning ranks trees by it). Over ten profiles of one tree on
the Zen 1 VM its standard deviation was 0.049 against 0.056 for `step_ms / plain_ms` (quiet), and
0.12 against 0.16 with the test suite running beside them.

    split = profile_spec_step(engine, "eagle3", engine.encode("Hi"))
    split["draft_ms"], split["verify_ms"], split["step_ms"]
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Optional

import jax
import jax.numpy as jnp

from .cpu_jit import cpu_stable_jit
from .decoding import decode_advance, decode_start
from .draft.drafting import TreeBudget
from .models.config import ModelConfig
from .speculative import propose_tree, spec_advance, spec_start, verify_tree


@functools.partial(cpu_stable_jit, static_argnames=("tcfg", "budget"))
def _draft(target_params, tcfg: ModelConfig, head, state, budget: TreeBudget):
    return propose_tree(head, target_params, tcfg, state, budget)


@functools.partial(cpu_stable_jit, static_argnames=("tcfg", "depth"))
def _verify(target_params, tcfg: ModelConfig, head, state, tree, depth: int):
    out, logits = verify_tree(target_params, tcfg, head, state.tcache, tree, depth)
    return logits, out.captured


def _median_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # warm-up: compile, first-touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _paired_median_ms(fn_a, fn_b, reps: int) -> tuple[float, float, float]:
    """Medians of `reps` runs of two programs, their runs alternated (after one warm-up each), and
    the median of the ratios a / b of each run of a to the run of b right after it. A ratio of two
    back-to-back runs cancels a shared machine's drift, which a ratio of the two medians does not
    when the machine changes speed part way through (the medians may come from different speeds)."""
    jax.block_until_ready(fn_a())
    jax.block_until_ready(fn_b())
    times = ([], [])
    for _ in range(reps):
        for fn, out in ((fn_a, times[0]), (fn_b, times[1])):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - t0)
    ratio = statistics.median(a / b for a, b in zip(*times) if b > 0) if any(times[1]) else float("nan")
    return 1e3 * statistics.median(times[0]), 1e3 * statistics.median(times[1]), ratio


def profile_spec_step(engine, method: str, prompt_ids: list[int], *, budget: Optional[TreeBudget] = None,
                      reps: int = 10, cache_len: Optional[int] = None, temperature: float = 0.0,
                      top_p: float = 1.0, top_k: int = 0) -> dict:
    """{"draft_ms", "verify_ms", "step_ms", "other_ms", "plain_ms", "step_over_plain", "draft_frac",
    "verify_frac", "tree_tokens"} for one step of `method` on `engine` right after `prompt_ids`'
    prefill: greedy, or sampled with these settings (then the whole step and the plain step sample,
    and "other" holds the sampled acceptance)."""
    if method not in engine.heads:
        raise ValueError(f"method {method!r} is not set up on this engine (call add_method first)")
    budget = budget or engine.budgets[method]
    head = engine.heads[method]
    _, args = engine._request(prompt_ids, 64, temperature, top_p, top_k, 0, cache_len, method)
    state = spec_start(engine.params, engine.cfg, head, *args, budget=budget, prefill_chunk=engine.prefill_chunk)
    tree = _draft(engine.params, engine.cfg, head, state, budget)
    draft_ms = _median_ms(lambda: _draft(engine.params, engine.cfg, head, state, budget), reps)
    verify_ms = _median_ms(lambda: _verify(engine.params, engine.cfg, head, state, tree, budget.max_depth), reps)

    def one_step():  # spec_advance donates its state: give it a fresh copy (copied before the clock starts)
        return spec_advance(engine.params, engine.cfg, head, fresh.pop(), *args[2:], budget=budget,
                            n_steps=jnp.int32(1))

    def plain_step():  # decode_advance donates its state too
        return decode_advance(engine.params, engine.cfg, plain.pop(), *args[2:], n_steps=jnp.int32(1))

    fresh = [jax.tree.map(jnp.copy, state) for _ in range(reps + 1)]
    start = decode_start(engine.params, engine.cfg, *args, prefill_chunk=engine.prefill_chunk)
    plain = [jax.tree.map(jnp.copy, start) for _ in range(reps + 1)]
    jax.block_until_ready((fresh, plain))
    step_ms, plain_ms, step_over_plain = _paired_median_ms(one_step, plain_step, reps)
    return {"draft_ms": draft_ms, "verify_ms": verify_ms, "step_ms": step_ms,
            "other_ms": step_ms - draft_ms - verify_ms, "plain_ms": plain_ms, "step_over_plain": step_over_plain,
            "draft_frac": draft_ms / step_ms, "verify_frac": verify_ms / step_ms, "tree_tokens": budget.num_nodes}
