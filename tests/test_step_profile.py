"""The time split of a speculative step (`eagle_jax/step_profile.py`): parts timed in turns, the
step ÷ plain ratio per round, a call's own cost subtracted, cheap parts timed as the fastest of
repeated calls, and the looped programs running their part n times (no timing assertions)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.engine import Engine


def test_profile_timing_goes_in_turns():
    """The parts of a step and the plain step autotuning divides by are timed in turns, round by
    round (one warm-up each first)."""
    from eagle_jax.step_profile import _in_turns

    calls = []
    fns = [(lambda c=c: calls.append(c)) for c in "dvsp"]
    rounds = _in_turns(fns, 3)
    assert calls == list("dvsp") * 4 and len(rounds) == 3 and all(len(r) == 4 and min(r) >= 0 for r in rounds)


def test_step_over_plain_is_per_round(monkeypatch):
    """The step ÷ plain ratio is the median of each round's ratio, not the ratio of the medians. Here
    the step takes twice the plain step throughout, and the machine halves its speed part way
    through the third round: the medians are both 2 s (ratio 1), the rounds' ratios 2, 2, 1, 2, 2."""
    from eagle_jax import step_profile

    durations = iter([0.0, 0.0] + [2, 1, 2, 1, 2, 2, 4, 2, 4, 2])  # two warm-ups, then (step, plain) rounds
    now = [0.0]

    def run():  # each program's run takes its listed number of seconds
        now[0] += next(durations)

    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: now[0])
    rounds = step_profile._in_turns((run, run), 5)
    assert sorted(r[0] for r in rounds)[2] == sorted(r[1] for r in rounds)[2] == 2  # the drift hides the cost
    assert step_profile._ratio_per_round(rounds, 0, 1) == 2.0


def test_loop_timing_subtracts_the_call(monkeypatch):
    """A part's time is that of 1 + LOOP runs in one call minus one run, over LOOP: a call's own cost
    (0.5 s here) drops out, a run's stays; in turns, the ratio is per round of differences."""
    from eagle_jax import step_profile

    now = [0.0]
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: now[0])

    def part(cost):
        def run(n):  # a call: 0.5 s of its own, then n runs
            now[0] += 0.5 + cost * n
        return run

    assert step_profile._loop_seconds(part(0.25)) == pytest.approx(0.25)
    rounds = step_profile._in_turns((part(0.3), part(0.1)), 3, step_profile._loop_seconds)
    assert rounds == [[pytest.approx(0.3), pytest.approx(0.1)]] * 3
    assert step_profile._ratio_per_round(rounds, 0, 1) == pytest.approx(3.0)


def test_cheap_parts_take_the_fastest_of_repeated_calls(monkeypatch):
    """A part whose LOOP extra runs outlast MIN_LOOP_S and a call is timed once a round; a cheap one
    takes the fastest of as many calls as make its extra runs last that long (at most the limit; the
    limit when the calibrating difference is lost in noise), which drops a call a hiccup slowed; a
    difference still lost in noise (not above zero) takes more pairs, up to MAX_PAIRS. Fake clock: a
    call costs `own` s, a run `cost` s, a listed call `stall` s more."""
    from eagle_jax import step_profile as sp

    now = [0.0]
    monkeypatch.setattr(sp.time, "perf_counter", lambda: now[0])

    def part(cost, own=0.001, stall=()):
        calls = iter(range(10**6))

        def run(n):
            now[0] += own + cost * n + (0.5 if next(calls) in stall else 0.0)
        return run

    assert sp._repeats(part(0.01)) == 1  # 8 runs = 80 ms
    assert sp._repeats(part(0.0005)) == 3  # 4 ms a pair: 3 pairs hold 10 ms
    assert sp._repeats(part(0.01, own=0.2)) == 3  # the runs must outlast the call's own 0.2 s too
    assert sp._repeats(part(0.0001)) == sp.MAX_REPEATS
    assert sp._repeats(part(0.01, stall={1}), limit=5) == 5  # the one-run call stalled: noise
    # the 1-run calls of the first two pairs stall; one timing would give (0.008 - 0.5) / 8 < 0
    assert sp._loop_seconds(part(0.001, stall={1, 3}), repeats=3) == pytest.approx(0.001)
    assert sp._loop_seconds(part(0.001, stall={3}), repeats=1) == pytest.approx(0.001)  # call 3 not reached
    assert sp._loop_seconds(part(0.001, stall={1}), limit=1) < 0  # what one timing can give
    assert sp._loop_seconds(part(0.001, stall={1})) == pytest.approx(0.001)  # lost in noise: one pair more
    counted = []

    def counting(inner):
        return lambda n: (counted.append(n), inner(n))

    assert sp._loop_seconds(counting(part(0.001, stall={1, 3})), repeats=3) == pytest.approx(0.001)
    assert counted == [1 + sp.LOOP, 1] * 3  # the difference showed: no pair more than asked
    counted.clear()  # every one-run call stalls: pairs up to the limit, and the noise is what comes back
    assert sp._loop_seconds(counting(part(0.001, stall=range(1, 999, 2))), repeats=2) < 0
    assert counted == [1 + sp.LOOP, 1] * sp.MAX_PAIRS
    made, used = [], []  # `before` makes each call's state (off the clock), the call takes it
    sp._loop_seconds(lambda n: (used.append(made.pop()), part(0.001)(n)), repeats=2,
                     before=lambda: made.append(object()))
    assert len(used) == 4 and made == []


def test_looped_parts_run_n_times_and_give_one_runs_result(tiny_hf_dir, monkeypatch):
    """`_draft` / `_verify` with n runs: n drafts (counted from inside the program), and the tree and
    logits of a single run (the nudge between runs is zero)."""
    from eagle_jax import step_profile
    from eagle_jax.speculative import spec_start

    engine = Engine(str(tiny_hf_dir), method="eagle3", drafter="random", progress=False)
    budget, head = engine.budgets["eagle3"], engine.heads["eagle3"]
    _, args = engine._request(engine.encode("w5 w6 w7"), 16, 0.0, 1.0, 0, 0, None, "eagle3")
    state = spec_start(engine.params, engine.cfg, head, *args, budget=budget, prefill_chunk=engine.prefill_chunk)
    runs, propose = [], step_profile.propose_tree

    def counted(*a):
        jax.debug.callback(lambda: runs.append(1), ordered=False)
        return propose(*a)

    monkeypatch.setattr(step_profile, "propose_tree", counted)
    step_profile._draft.clear_cache()
    try:
        one = step_profile._draft(engine.params, engine.cfg, head, state, budget, jnp.int32(1))
        jax.effects_barrier()
        assert len(runs) == 1
        four = step_profile._draft(engine.params, engine.cfg, head, state, budget, jnp.int32(4))
        jax.effects_barrier()
        assert len(runs) == 5
    finally:
        step_profile._draft.clear_cache()
    for x, y in zip(one, four):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    v1, v3 = (step_profile._verify(engine.params, engine.cfg, head, state, one, budget.max_depth, jnp.int32(n))
              for n in (1, 3))
    for x, y in zip(jax.tree.leaves(v1), jax.tree.leaves(v3)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
