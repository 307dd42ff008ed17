"""The benchmark's speedup intervals: a paired bootstrap over prompts (bench_stats.py)."""

import numpy as np

from eagle_jax import bench
from eagle_jax.bench_stats import format_interval, ratio_interval


def _row(new, sec, first=None):
    r = {"tokens": [0] * new, "new_tokens": new, "target_calls": new, "seconds": sec}
    if first is not None:
        r["first_token_seconds"] = first
    return r


def test_two_prompts_span_their_own_ratios():
    # n = 2: a draw is (0, 0), (1, 1) or a mix; the mix's pooled ratio lies between the two prompts'
    # own, so the 2.5th / 97.5th percentiles of 4000 draws are exactly those two
    fast = [_row(100, 0.5), _row(50, 0.4)]
    slow = [_row(100, 1.0), _row(50, 0.5)]
    own = sorted([(100 / 0.5) / (100 / 1.0), (50 / 0.4) / (50 / 0.5)])  # 2.0, 1.25
    assert ratio_interval(fast, slow) == own
    assert format_interval(ratio_interval(fast, slow)) == "1.25–2.00"


def test_pairs_are_kept_and_the_point_estimate_lies_inside():
    rng = np.random.default_rng(3)
    new = rng.integers(20, 129, size=16)
    base = rng.uniform(0.5, 1.5, size=16)
    slow = [_row(int(n), float(s)) for n, s in zip(new, base)]
    # each prompt exactly 1.6x faster: every draw gives 1.6, however the prompts differ from each other
    same = [_row(int(n), float(s) / 1.6) for n, s in zip(new, base)]
    lo, hi = ratio_interval(same, slow)
    assert abs(lo - 1.6) < 1e-12 and abs(hi - 1.6) < 1e-12
    # unequal gains: an interval around the pooled figure, the same one every time (a fixed seed)
    gains = rng.uniform(1.2, 2.2, size=16)
    fast = [_row(int(n), float(s / g)) for n, s, g in zip(new, base, gains)]
    out = bench.summarize({"vanilla": slow, "eagle3": fast})
    lo, hi = out["eagle3"]["speedup_vs_vanilla_ci95"]
    assert lo < out["eagle3"]["speedup_vs_vanilla"] < hi and hi - lo > 0.05
    assert ratio_interval(fast, slow) == [lo, hi]
    assert 1.2 < lo and hi < 2.2
    # a shuffled pairing is another statistic: the pairs are what is resampled
    assert ratio_interval(fast[::-1], slow) != [lo, hi]


def test_summaries_and_tables_carry_the_intervals():
    v = [_row(11, 1.5, 0.5), _row(21, 2.5, 0.5), _row(31, 3.0, 0.5)]
    e = [_row(11, 1.0, 0.5), _row(21, 1.5, 0.5), _row(31, 1.5, 0.5)]
    out = bench.summarize({"vanilla": v, "eagle3": e})
    assert "speedup_vs_vanilla_ci95" not in out["vanilla"]  # the reference has no interval of its own
    lo, hi = out["eagle3"]["loop_speedup_vs_vanilla_ci95"]
    pairs = ((11, 1.0, 1.5), (21, 1.5, 2.5), (31, 1.5, 3.0))  # new tokens, eagle3's and vanilla's seconds
    own = [(n - 1) / (se - 0.5) / ((n - 1) / (sv - 0.5)) for n, se, sv in pairs]
    assert abs(lo - min(own)) < 1e-12 and abs(hi - max(own)) < 1e-12  # the loop's time: the first token's taken off
    table = bench.markdown_table(out)
    head, _, _, eagle = table.splitlines()
    assert "speedup_vs_vanilla_ci95" in head and "loop_speedup_vs_vanilla_ci95" in head
    assert format_interval(out["eagle3"]["speedup_vs_vanilla_ci95"]) in eagle
    # one prompt, or rows that do not pair up: no interval, an empty cell
    one = bench.summarize({"vanilla": v[:1], "eagle3": e[:1]})
    assert "speedup_vs_vanilla_ci95" not in one["eagle3"] and format_interval(None) == ""
    assert ratio_interval(e, v[:2]) is None
    assert "speedup_vs_vanilla_ci95" not in bench.summarize({"eagle3": e, "hf": v})["eagle3"]  # no vanilla


def test_pooled_sets_are_drawn_within_each_set():
    # set a: 2x on every prompt, set b: no gain; within each set the prompts are alike, so a draw
    # that keeps two of each set always gives (4 tokens in 3 s) / (4 in 4): 4/3, with no spread
    v = [_row(100, 1.0)] * 4
    e = [_row(100, 0.5), _row(100, 0.5), _row(100, 1.0), _row(100, 1.0)]
    groups = ["a", "a", "b", "b"]
    lo, hi = ratio_interval(e, v, groups=groups)
    assert abs(lo - 4 / 3) < 1e-12 and abs(hi - 4 / 3) < 1e-12
    lo, hi = ratio_interval(e, v)  # drawn across the sets: the mix varies
    assert lo < 4 / 3 - 0.1 and hi > 4 / 3 + 0.1
    assert ratio_interval(e, v, groups=groups[:3]) is None
    out = bench.summarize({"vanilla": v, "eagle3": e}, groups=groups)
    assert out["eagle3"]["speedup_vs_vanilla_ci95"] == ratio_interval(e, v, groups=groups)
