"""Where a speculative step's time goes: drafting, verification and the rest, measured.

One speculative step is a single jitted computation (draft → verify → accept → commit), so its
parts cannot be timed from inside. `profile_spec_step` times them as separate jitted programs on
a real state (after the prompt's prefill) — the drafting alone (`propose_tree`: the head's tree
and any prompt-lookup chain), the verification alone (the target's pass over the padded tree,
logits included) and the whole step (`spec_advance`) — and a plain decoding step
(`decode_advance`) on the same prompt. `other_ms` is the whole step minus the two parts
(acceptance, the KV commit, re-feeding the head).

Each program runs its part n times in a row inside one call (n dynamic: one compile), every run
on inputs nudged by an opaque zero from the run before (so that the compiler hoists nothing out of
the loop) and, for verification, on the cache the run before wrote. A part's time is that of
1 + `LOOP` runs minus that of one run, divided by `LOOP`: the cost inside a decoding program,
without a call's own cost. That cost is not small on the CPU: a call passes the target's 393
parameter arrays (unrolled layers) to XLA (≈ 0.5 ms on the 2-core Zen 3 VM) and copies the caches
it does not own (a few ms). Before stop 59 every part carried it once, so the split showed
EAGLE-3's drafting at 2.8 ms where it costs about 1.5 ms inside the step, and `other_ms` came out
negative. A cheap part (a small model's plain step: 0.1 ms, so `LOOP` runs last under 1 ms) would
drown in a shared machine's jitter of a few ms and could come out at zero or below: each of its
two timings is then the fastest of several calls (`_repeats`: as many as make the runs' total
`MIN_LOOP_S` and longer than a call, from one calibrating pair; stop 60), which drops the calls a
hiccup slowed. A difference that still comes out at zero or below takes more pairs until it
shows, at most `MAX_PAIRS` (stop 66): a busy machine can slow every one-run call of a few pairs,
as a pytest worker beside the autotuning test did (beside two busy processes, 4 tiny-model profiles
in 40 came out at zero or below before, none in 120 after). The four programs are timed in turns,
`reps` rounds (so that a shared machine's drift moves them together), and each figure is the
median of its `reps` differences; `step_over_plain` is the median of the ratios of each round's
step to its plain step, which holds while the machine's speed drifts (autotuning ranks trees by it).

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


LOOP = 8  # extra runs of a part inside one call (module doc)
MIN_LOOP_S = 0.01  # a cheap part's repeated calls hold this many seconds of extra runs (and more than a call)
MAX_REPEATS = 8
MAX_PAIRS = 32  # a difference lost in the noise is timed again, up to this many pairs (`_loop_seconds`)


def _opaque_zero(x, dtype):
    """0 in practice, computed from `x` so that the compiler can fold nothing away (no tree sums its
    token ids to -7, no logits sum to it)."""
    return (jnp.sum(x) == -7).astype(dtype)


def _nudged(state, z):
    """`state` with every input of a draft shifted by the opaque zero `z` of the run before: the next
    run depends on it, so the compiler can hoist no part of it (masks, positions) out of the loop."""
    shift = lambda x: x + z.astype(x.dtype)
    return state._replace(h_root=shift(state.h_root), root=shift(state.root), length=shift(state.length),
                          dcache=state.dcache.replace(length=shift(state.dcache.length)))


@functools.partial(cpu_stable_jit, static_argnames=("tcfg", "budget"))
def _draft(target_params, tcfg: ModelConfig, head, state, budget: TreeBudget, n):
    """The step's drafting `n` times in a row (dynamic n >= 1); the last tree."""
    draft = lambda st: propose_tree(head, target_params, tcfg, st, budget)

    def again(_, carry):
        st, tree = carry
        st = _nudged(st, _opaque_zero(tree.tokens_bn, jnp.int32))
        return st, draft(st)

    return jax.lax.fori_loop(1, n, again, (state, draft(state)))[1]


@functools.partial(cpu_stable_jit, static_argnames=("tcfg", "depth"))
def _verify(target_params, tcfg: ModelConfig, head, state, tree, depth: int, n):
    """The target's pass over `tree` `n` times in a row (dynamic n >= 1), each on the cache the one
    before wrote (the same slots: nothing copied, as in a step); the last logits and features."""
    def verify(tcache, tree):
        out, logits = verify_tree(target_params, tcfg, head, tcache, tree, depth)
        return out.cache, tree, logits, out.captured

    def again(_, carry):
        tcache, tree, logits, _ = carry
        z = _opaque_zero(logits[:, :, 0], jnp.int32)
        tree = tree._replace(tokens_bn=tree.tokens_bn + z, parents_bn=tree.parents_bn + z)
        return verify(tcache.advance(z), tree)

    return jax.lax.fori_loop(1, n, again, verify(state.tcache, tree))[2:]


def _time(fn) -> float:
    """Seconds of one call of `fn` (to its results)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def _timed(fn, n: int, before=None, timer=_time) -> float:
    """Seconds of the call `fn(n)`; `before()` (a fresh state to donate) runs first, off the clock."""
    if before is not None:
        before()
    return timer(lambda: fn(n))


def _loop_seconds(fn, repeats: int = 1, before=None, timer=_time, limit: int = MAX_PAIRS) -> float:
    """Seconds of one run of a part inside a call: `fn(n)` runs it n times; (1 + LOOP runs − 1 run) /
    LOOP, each timing the fastest of `repeats` calls (made in pairs). A difference lost in the noise
    (not above zero: no run is free, but a busy machine can slow every one-run call of a few pairs)
    takes more pairs, one at a time, until it shows or `limit` pairs are made."""
    more, one = [], []
    while len(more) < max(repeats, 1) or (min(more) <= min(one) and len(more) < limit):
        more.append(_timed(fn, 1 + LOOP, before, timer))
        one.append(_timed(fn, 1, before, timer))
    return (min(more) - min(one)) / LOOP


def _repeats(fn, before=None, floor: float = MIN_LOOP_S, limit: int = MAX_REPEATS, timer=_time) -> int:
    """How many calls each timing of `fn` takes the fastest of: 1 when `LOOP` extra runs last `floor`
    seconds and longer than one call; else as many as make their extra runs together last that long,
    at most `limit`. From one calibrating pair of calls (1 and 1 + `LOOP` runs, after a warm-up); a
    difference lost in the noise (not above zero) asks for `limit`."""
    _timed(fn, 1, before, timer)  # compile, first touch
    one, more = _timed(fn, 1, before, timer), _timed(fn, 1 + LOOP, before, timer)
    extra, need = more - one, max(floor, one)
    if extra >= need:
        return 1
    return limit if extra <= 0 else min(limit, -int(-need // extra))


def _in_turns(fns, reps: int, timer=_time) -> list[list[float]]:
    """Seconds of `reps` rounds in which every program of `fns` is timed once, in order (after one
    warm-up each): [[round 1's timings], ...]. Programs timed in turns share the machine's drift."""
    for fn in fns:
        timer(fn)  # warm-up: compile, first-touch
    return [[timer(fn) for fn in fns] for _ in range(reps)]


def _ratio_per_round(rounds: list[list[float]], a: int, b: int) -> float:
    """Median over the rounds of timing a ÷ timing b of the same round. A ratio of two back-to-back
    timings cancels a shared machine's drift, which a ratio of the two medians does not when the
    machine changes speed part way through (the medians may come from different speeds)."""
    ratios = [r[a] / r[b] for r in rounds if r[b] > 0]
    return statistics.median(ratios) if ratios else float("nan")


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
    room = (1 + LOOP) * (budget.max_depth + 1) + 8  # every looped step accepts a whole path and goes on
    _, args = engine._request(prompt_ids, max(64, room), temperature, top_p, top_k, 0, cache_len, method)
    args = (*args[:3], jnp.asarray([-1], jnp.int32), *args[4:])  # no EOS: no looped run stops early
    state = spec_start(engine.params, engine.cfg, head, *args, budget=budget, prefill_chunk=engine.prefill_chunk)
    plain_state = decode_start(engine.params, engine.cfg, *args, prefill_chunk=engine.prefill_chunk)
    draft = lambda n: _draft(engine.params, engine.cfg, head, state, budget, jnp.int32(n))
    tree = draft(1)
    verify = lambda n: _verify(engine.params, engine.cfg, head, state, tree, budget.max_depth, jnp.int32(n))
    fresh = {}  # spec_advance and decode_advance donate their state: each call gets a copy, made off the clock

    def steps(n):
        return spec_advance(engine.params, engine.cfg, head, fresh.pop("spec"), *args[2:], budget=budget,
                            n_steps=jnp.int32(n))

    def plain_steps(n):
        return decode_advance(engine.params, engine.cfg, fresh.pop("plain"), *args[2:], n_steps=jnp.int32(n))

    def copy(key, st):
        return lambda: fresh.update({key: jax.block_until_ready(jax.tree.map(jnp.copy, st))})

    parts = [(draft, None), (verify, None), (steps, copy("spec", state)), (plain_steps, copy("plain", plain_state))]
    parts = [(fn, _repeats(fn, before), before) for fn, before in parts]
    rounds = _in_turns(parts, reps, lambda p: _loop_seconds(*p))
    draft_ms, verify_ms, step_ms, plain_ms = (1e3 * statistics.median(col) for col in zip(*rounds))
    step_over_plain = _ratio_per_round(rounds, 2, 3)
    return {"draft_ms": draft_ms, "verify_ms": verify_ms, "step_ms": step_ms,
            "other_ms": step_ms - draft_ms - verify_ms, "plain_ms": plain_ms, "step_over_plain": step_over_plain,
            "draft_frac": draft_ms / step_ms, "verify_frac": verify_ms / step_ms, "tree_tokens": budget.num_nodes}
