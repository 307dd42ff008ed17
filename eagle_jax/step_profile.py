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
1 + extra runs minus that of one run, divided by the extra runs: the cost inside a decoding
program, without a call's own cost. That cost is not small on the CPU: a call passes the target's
393 parameter arrays (unrolled layers) to XLA (≈ 0.5 ms on the 2-core Zen 3 VM) and copies the
caches it does not own (a few ms). Before stop 59 every part carried it once, so the split showed
EAGLE-3's drafting at 2.8 ms where it costs about 1.5 ms inside the step, and `other_ms` came out
negative. The extra runs are `LOOP`, doubled per part until they last `MIN_LOOP_S` and longer than
one call (`_extra_runs`, from one calibrating pair of calls), so that a shared machine's jitter of
a few ms stays small beside the difference: a cheap part (a small model's plain step, 0.1 ms) would
otherwise come out at zero or below. The four programs are timed in turns, `reps` rounds (so that a
shared machine's drift moves them together), and each figure is the median of its `reps`
differences; `step_over_plain` is the median of the ratios of each round's step to its plain step,
which holds while the machine's speed drifts (autotuning ranks trees by it).

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


LOOP = 8  # the fewest extra runs of a part inside one call (module doc)
MIN_LOOP_S = 0.03  # the extra runs last at least this long (and longer than one call), up to MAX_LOOP runs
MAX_LOOP = 256


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


def _loop_seconds(fn, extra: int = LOOP) -> float:
    """Seconds of one run of a part inside a call: `fn(n)` runs it n times; (1 + extra runs − 1 run) / extra."""
    return (_time(lambda: fn(1 + extra)) - _time(lambda: fn(1))) / extra


def _extra_runs(fn, limit: int = MAX_LOOP, floor: float = MIN_LOOP_S, timer=_time) -> int:
    """How many extra runs to time `fn` (`fn(n)` runs a part n times) with: `LOOP`, doubled until
    they last `floor` seconds and longer than one call, by one calibrating pair of calls (1 and
    1 + `LOOP` runs, after a warm-up); at most `limit` (at least `LOOP`). A difference lost in the
    noise (not above zero) asks for the most."""
    timer(lambda: fn(1))  # compile, first touch
    one, more = timer(lambda: fn(1)), timer(lambda: fn(1 + LOOP))
    per_run, extra = max(more - one, 0.0) / LOOP, LOOP
    while extra < limit and extra * per_run < max(floor, one):
        extra *= 2
    return max(LOOP, min(extra, limit))


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
    head, step_tokens = engine.heads[method], budget.max_depth + 1  # a looped step accepts a whole path

    def start(spec_extra, plain_extra):  # (args, spec state, plain state), no EOS, room for the looped steps
        room = max((1 + spec_extra) * step_tokens, 1 + plain_extra) + 8
        _, args = engine._request(prompt_ids, max(64, room), temperature, top_p, top_k, 0, cache_len, method)
        args = (*args[:3], jnp.asarray([-1], jnp.int32), *args[4:])  # no looped run stops early
        return args, spec_start(engine.params, engine.cfg, head, *args, budget=budget,
                                prefill_chunk=engine.prefill_chunk), \
            decode_start(engine.params, engine.cfg, *args, prefill_chunk=engine.prefill_chunk)

    args, state, plain_state = start(LOOP, LOOP)
    draft = lambda n: _draft(engine.params, engine.cfg, head, state, budget, jnp.int32(n))
    tree = draft(1)
    verify = lambda n: _verify(engine.params, engine.cfg, head, state, tree, budget.max_depth, jnp.int32(n))
    pools = {}  # spec_advance and decode_advance donate their state: each call takes a fresh copy

    def fill(count):  # copies made before the clock starts
        pools["spec"] = [jax.tree.map(jnp.copy, state) for _ in range(count)]
        pools["plain"] = [jax.tree.map(jnp.copy, plain_state) for _ in range(count)]
        jax.block_until_ready(pools)

    def steps(n):
        return spec_advance(engine.params, engine.cfg, head, pools["spec"].pop(), *args[2:], budget=budget,
                            n_steps=jnp.int32(n))

    def plain_steps(n):
        return decode_advance(engine.params, engine.cfg, pools["plain"].pop(), *args[2:], n_steps=jnp.int32(n))

    fill(3)
    fits = engine.max_cache_len - len(prompt_ids) - 8  # room the cache has for looped steps' tokens
    limit = lambda runs: max(LOOP, min(MAX_LOOP, runs))
    extras = [_extra_runs(draft), _extra_runs(verify), _extra_runs(steps, limit(fits // step_tokens - 1)),
              _extra_runs(plain_steps, limit(fits - 1))]
    if max(extras[2:]) > LOOP:  # a cheap step: start again with room for its looped steps
        args, state, plain_state = start(*extras[2:])
    fill(2 * reps + 2)
    rounds = _in_turns(list(zip((draft, verify, steps, plain_steps), extras)), reps, lambda p: _loop_seconds(*p))
    draft_ms, verify_ms, step_ms, plain_ms = (1e3 * statistics.median(col) for col in zip(*rounds))
    step_over_plain = _ratio_per_round(rounds, 2, 3)
    return {"draft_ms": draft_ms, "verify_ms": verify_ms, "step_ms": step_ms,
            "other_ms": step_ms - draft_ms - verify_ms, "plain_ms": plain_ms, "step_over_plain": step_over_plain,
            "draft_frac": draft_ms / step_ms, "verify_frac": verify_ms / step_ms, "tree_tokens": budget.num_nodes}
