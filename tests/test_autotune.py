"""Tree-budget autotuning (`eagle_jax/autotune.py`, `bench --total-tokens auto`): the searches over
sizes, shapes and chains, the finalists timed again, saved budgets and the flags that pick one."""

import dataclasses
from pathlib import Path

import pytest

import eagle_jax
from eagle_jax.engine import Engine
from eagle_jax.tree import static_tree_of_size


def test_budget_search_finds_the_best_tree_shape_without_measuring_a_tree_twice():
    """The coordinate search (sizes, then shapes at the best size, then sizes with the best shape)
    on a made-up cost surface whose optimum needs both steps: 6 tokens, depth 1, top-k 3."""
    from eagle_jax.autotune import parse_shapes, search_budgets
    from eagle_jax.draft import TreeBudget

    seen = []

    def measure(b):
        seen.append((b.total_tokens, b.depth, b.top_k))
        return {"expected_speedup": 100 - abs(b.total_tokens - 5) - 3 * abs(b.depth - 1) - 2 * abs(b.top_k - 3)
                + 1.5 * (b.total_tokens == 6)}

    base = TreeBudget("dynamic", total_tokens=24, depth=5, top_k=4)
    best, rows = search_budgets([3, 4, 5, 6, 8], parse_shapes("1:2,1:3,2:3,3:3,9:9,1:1"), base, measure)
    assert (best.total_tokens, best.depth, best.top_k) == (6, 1, 3)
    assert len(seen) == len(set(seen)) == len(rows)  # each distinct (clamped) tree once
    assert seen[:5] == [(3, 1, 4), (4, 2, 4), (5, 3, 4), (6, 4, 4), (8, 5, 4)]  # depth clamped to N - 2
    assert (3, 1, 1) in seen and (3, 1, 9) in seen  # 9:9 clamped to depth 1 at 3 tokens
    narrow = TreeBudget("dynamic", total_tokens=3, depth=1, top_k=1)  # 2 nodes below the root at most
    assert [r["total_tokens"] for r in search_budgets([3, 5], (), narrow, measure)[1]] == [3]
    assert max(rows, key=lambda r: r["expected_speedup"])["total_tokens"] == 6
    assert search_budgets([4], (), base, measure)[0] == TreeBudget("dynamic", total_tokens=4, depth=2, top_k=4)
    # 2 tokens best of the sizes: every shape of it is one tree, so the shapes go to the best size above 2
    pair_first = lambda b: {"expected_speedup": measure(b)["expected_speedup"] + 20 * (b.total_tokens == 2)}
    seen.clear()
    best, rows = search_budgets([2, 3, 4], parse_shapes("1:2,1:3"), base, pair_first)
    assert (best.total_tokens, best.depth) == (2, 0)
    assert seen == [(2, 0, 1), (3, 1, 4), (4, 2, 4), (3, 1, 2), (3, 1, 3)], seen  # 3 beat 4 above 2
    # the lookup chain: measured at the best tree, then the sizes again with the best chain
    chain = lambda b: {"expected_speedup": measure(b)["expected_speedup"] + 4 * (b.lookup == 3)
                       - 3 * (b.lookup == 3) * (b.total_tokens == 6)}
    best, rows = search_budgets([5, 6, 7], parse_shapes("1:3"), base, chain, lookups=(0, 3, 6))
    assert (best.total_tokens, best.depth, best.top_k, best.lookup) == (5, 1, 3, 3)
    # sizes (best: 5), shape 1:3 at 5, chain 3 at (5, 1, 3) (0 is that tree), chain 6 on 5 + 6 tokens
    # (it would leave 5 tokens' head no node), then the sizes with chain 3
    assert [(r["total_tokens"], r["depth"], r["lookup"]) for r in rows] == [
        (5, 3, 0), (6, 4, 0), (7, 5, 0), (5, 1, 0), (5, 1, 3), (11, 1, 6), (6, 1, 3), (7, 1, 3)]
    # the chain's shortest n-gram: tried for the best tree's chain (1 is that tree), then the sizes with it
    grams = lambda b: {"expected_speedup": chain(b)["expected_speedup"] + 2 * (b.lookup_min_ngram == 2)}
    best, rows = search_budgets([5, 6], parse_shapes("1:3"), base, grams, lookups=(0, 3), lookup_ngrams=(1, 2, 3))
    assert (best.total_tokens, best.depth, best.top_k, best.lookup, best.lookup_min_ngram) == (5, 1, 3, 3, 2)
    assert [(r["total_tokens"], r["depth"], r["lookup"], r["lookup_min_ngram"]) for r in rows] == [
        (5, 3, 0, 1), (6, 4, 0, 1), (5, 1, 0, 1), (5, 1, 3, 1), (5, 1, 3, 2), (5, 1, 3, 3), (6, 1, 3, 2)]
    # no chain in the best tree: no n-gram to try
    assert len(search_budgets([5], (), base, measure, lookups=(0,), lookup_ngrams=(2, 3))[1]) == 1
    # a start whose chain is longer than a small size's N - 2 (the default tree's 6, `--auto-lookups
    # none`): every size is measured, with the chain cut to fit (not skipped, leaving 8 alone)
    long_chain = dataclasses.replace(base, lookup=6)
    rows = search_budgets([2, 3, 4, 8], (), long_chain, measure)[1]
    assert [(r["total_tokens"], r["lookup"]) for r in rows] == [(2, 0), (3, 1), (4, 2), (8, 6)]
    with pytest.raises(ValueError, match="DEPTH:TOP_K"):
        parse_shapes("2x4")
    from eagle_jax.autotune import parse_lookups

    assert parse_lookups("0,3") == (0, 3) and parse_lookups("none") == ()
    with pytest.raises(ValueError, match=">= 0"):
        parse_lookups("2,-1")
    with pytest.raises(ValueError, match="top-k >= 1"):
        parse_shapes("1:0")
    with pytest.raises(ValueError, match="depth must be >= 0"):
        parse_shapes("-1:4")
    assert parse_shapes("0:4") == ((0, 4),)  # the root's children alone
    assert parse_shapes("none") == ()


def test_a_budget_tuned_slower_than_plain_decoding_says_so(tmp_path, monkeypatch):
    """Loading a tuned budget whose tree was expected below plain decoding's speed (no tree beat it:
    a weak head on a CPU where rows cost much) tells the user that --method vanilla is faster; one
    expected faster, or a hand-written file with no measurements, says nothing more."""
    from eagle_jax import autotune

    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    budget = {"kind": "dynamic", "total_tokens": 4, "depth": 1, "top_k": 3, "lookup": 2, "lookup_min_ngram": 1}
    other = dict(budget, total_tokens=6)

    def tuned(method, chosen_speedup, runner_up=0.7):
        rows = [dict(other, tau=1.5, expected_speedup=runner_up),
                dict(budget, tau=1.7, expected_speedup=chosen_speedup)]
        path = autotune.default_budget_path("m", method, "default")
        autotune.save_budget({"method": method, "budget": budget, "candidates": rows}, path)

    def told(method):
        lines = []
        got, tune = autotune.resolve_budget("m", method, "default", "auto", log=lines.append)
        assert (got.total_tokens, got.top_k, got.lookup, tune) == (4, 3, 2, None)
        return "\n".join(lines)

    tuned("eagle2", 0.77)
    assert "eagle2 with this tree was expected at 0.77× the tokens/s of plain decoding" in told("eagle2")
    assert "--method vanilla decodes faster" in told("eagle2")
    tuned("eagle3", 1.2, runner_up=0.9)  # only the chosen tree's row counts
    assert "vanilla" not in told("eagle3") and "4 tokens, depth 1, top-k 3" in told("eagle3")
    autotune.save_budget({"method": "eagle2", "budget": budget}, autotune.default_budget_path("m", "eagle2", "default"))
    assert "vanilla" not in told("eagle2")  # no candidates: nothing known
    assert autotune.slower_than_plain("eagle1", {"expected_speedup": 0.88}).startswith("on the device")
    assert autotune.slower_than_plain("eagle1", {"expected_speedup": 1.0}) is None
    assert autotune.slower_than_plain("eagle1", {"expected_speedup": float("nan")}) is None  # not known


def test_budget_flags_are_checked(tmp_path, monkeypatch):
    from eagle_jax.autotune import load_budget, resolve_budget, save_budget

    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    good = save_budget({"method": "eagle3", "budget": {"kind": "dynamic", "total_tokens": 12, "depth": 4, "top_k": 3}},
                       tmp_path / "b.json")
    budget, tune = resolve_budget("m", "eagle3", "default", None, budget_config=good)
    assert (budget.total_tokens, budget.depth, budget.top_k, budget.lookup, tune) == (12, 4, 3, 0, None)  # older files
    siblings = resolve_budget("m", "eagle3", "default", 3, depth=0, top_k=2, lookup=0)[0]  # --depth 0 kept
    assert (siblings.total_tokens, siblings.depth, siblings.top_k) == (3, 0, 2)
    with pytest.raises(ValueError, match="top_k >= 1"):  # --tree-top-k 0 refused, not read as unset
        resolve_budget("m", "eagle3", "default", 3, depth=1, top_k=0)
    start, tune = resolve_budget("m", "eagle3", "default", "auto", depth=1, top_k=2)  # the shape to start from
    assert (start.total_tokens, start.depth, start.top_k, tune is not None) == (7, 1, 2, True)  # 24 would not fit
    shaped = resolve_budget("m", "eagle3", "default", None, depth=1, top_k=2)[0]  # no size given: what fits
    assert (shaped.total_tokens, shaped.depth, shaped.top_k) == (7, 1, 2)
    assert resolve_budget("m", "eagle3", "default", None, depth=3)[0].total_tokens == 24
    budget, _ = resolve_budget("m", "eagle3", "default", None, budget_config=good, lookup=5)  # --lookup replaces
    assert (budget.total_tokens, budget.lookup) == (12, 5)
    chained = save_budget({"method": "eagle3", "budget": {"kind": "dynamic", "total_tokens": 8, "depth": 2, "top_k": 3,
                                                          "lookup": 4}}, tmp_path / "c.json")
    assert (load_budget(chained).lookup, load_budget(chained).lookup_min_ngram) == (4, 1)  # older files: 1
    budget, _ = resolve_budget("m", "eagle3", "default", None, budget_config=chained, lookup_min_ngram=2)
    assert (budget.lookup, budget.lookup_min_ngram) == (4, 2)  # --lookup-min-ngram replaces
    grams = save_budget({"method": "eagle3", "budget": {"kind": "dynamic", "total_tokens": 8, "depth": 2, "top_k": 3,
                                                        "lookup": 3, "lookup_min_ngram": 3}}, tmp_path / "g.json")
    assert load_budget(grams).lookup_min_ngram == 3
    with pytest.raises(ValueError, match="lookup_min_ngram"):
        resolve_budget("m", "eagle3", "default", None, budget_config=chained, lookup_min_ngram=4)
    with pytest.raises(ValueError, match="lookup must leave the head"):  # the chain takes rows of the tree
        resolve_budget("m", "eagle3", "default", None, budget_config=chained, lookup=7)
    with pytest.raises(ValueError, match="not both"):
        resolve_budget("m", "eagle3", "default", 16, budget_config=good)
    budget, tune = resolve_budget("m", "eagle1", "default", "auto")  # eagle1 tunes its static tree's size
    assert budget.static_tree.num_nodes == 20 and tune is not None and ".eagle1." in str(tune)
    assert resolve_budget("m", "eagle1", "default", 4)[0].static_tree == static_tree_of_size(4)
    with pytest.raises(ValueError, match="--depth"):
        resolve_budget("m", "eagle1", "default", None, depth=2)
    budget, tune = resolve_budget("m", "eagle3", "default", "auto")  # nothing saved yet: tune into the cache
    assert budget.total_tokens == 24 and tune is not None and str(tune).startswith(str(tmp_path))
    assert resolve_budget("m", "vanilla", "default", "auto") == (None, None)
    # the packaged CPU budget of the default drafter applies when this machine has none of its own:
    # the one tuned on an AVX2 CPU where the matmul kernel is the AVX2 build
    from eagle_jax.kernels import cpu_matmul

    budgets = Path(eagle_jax.__file__).parent / "assets" / "budgets"
    for m in ("eagle1", "eagle2", "eagle3"):
        for isa, core, suffix in [("avx512", None, "cpu"), ("avx2", None, "cpu-avx2"),
                                  ("avx2", "zen3", "cpu-avx2"), ("avx512", "zen4", "cpu"),
                                  ("avx512", "zen5", "cpu-avx512-zen5" if m == "eagle3" else "cpu"),
                                  ("avx2", "zen5", "cpu-avx2")]:
            monkeypatch.setattr(cpu_matmul, "cpu_isa", lambda isa=isa: isa)
            monkeypatch.setattr(cpu_matmul, "cpu_core", lambda core=core: core)
            packaged = load_budget(budgets / f"smollm2-135m-instruct.{m}.default.{suffix}.json", m)
            assert resolve_budget("smollm2-135m-instruct", m, "default", None)[0] == packaged
    # Zen 5's EAGLE-3 tree is larger than the one tuned on Zen 4 (which the check above tells apart)
    assert load_budget(budgets / "smollm2-135m-instruct.eagle3.default.cpu-avx512-zen5.json").total_tokens \
        > load_budget(budgets / "smollm2-135m-instruct.eagle3.default.cpu.json").total_tokens
    # files that differ, so that the checks above tell them apart (eagle3's trees are the same since
    # stop 77, 3 tokens, depth 1, top-k 2, and eagle2's since stop 78, 2 tokens, tuned on each kind of CPU)
    assert [m for m in ("eagle1", "eagle2", "eagle3")
            if load_budget(budgets / f"smollm2-135m-instruct.{m}.default.cpu-avx2.json")
            != load_budget(budgets / f"smollm2-135m-instruct.{m}.default.cpu.json")] == ["eagle1"]
    monkeypatch.setattr(cpu_matmul, "cpu_isa", lambda: "neon")  # no file for that kernel build: the CPU one
    monkeypatch.setattr(cpu_matmul, "cpu_core", lambda: None)
    assert resolve_budget("smollm2-135m-instruct", "eagle2", "default", None)[0] == \
        load_budget(budgets / "smollm2-135m-instruct.eagle2.default.cpu.json", "eagle2")
    assert resolve_budget("smollm2-135m-instruct", "eagle3", "default", 24)[0].total_tokens == 24
    assert resolve_budget("smollm2-135m-instruct", "eagle3", "other-head", None)[0].total_tokens == 24
    (tmp_path / "bad.json").write_text('{"budget": {"total_tokens": 8}}')
    with pytest.raises(ValueError, match="bad.json.*depth"):
        load_budget(tmp_path / "bad.json")


def test_budgets_tuned_with_other_kernels_are_kept_apart(tmp_path, monkeypatch):
    from eagle_jax.autotune import default_budget_path, kernel_tag, resolve_budget, save_budget
    from eagle_jax.kernels import cpu_matmul, cpu_qx

    if not cpu_matmul.available():
        pytest.skip("the CPU matmul kernel is not built here")
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    assert kernel_tag() == "" and kernel_tag("cpu_kernel", "auto", "auto") == ""  # the defaults, spelled or not
    assert kernel_tag("xla", "float32", "q4_1") == ".matmul-xla"  # the XLA products ignore the kernel's flags
    assert kernel_tag(draft_rows="q4_1") == ".rows-q4_1"
    if cpu_qx.available():  # int8 rows of x are the default here: float32 rows are another cost per tree token
        assert kernel_tag(activations="int8") == ""
        assert kernel_tag(activations="float32", draft_rows="q4_1") == ".act-float32.rows-q4_1"
    plain = default_budget_path("m", "eagle3", "default")
    other = default_budget_path("m", "eagle3", "default", ".rows-q4_1")
    assert plain.name.endswith("cpu-cpu.json") and other.name == plain.name[:-5] + ".rows-q4_1.json"
    save_budget({"method": "eagle3", "budget": {"kind": "dynamic", "total_tokens": 5, "depth": 3, "top_k": 2}}, plain)
    assert resolve_budget("m", "eagle3", "default", None)[0].total_tokens == 5
    assert resolve_budget("m", "eagle3", "default", "auto")[1] is None  # tuned before: loaded
    # other kernels: not that budget, and --total-tokens auto tunes into their own file
    assert resolve_budget("m", "eagle3", "default", None, kernels=".rows-q4_1")[0].total_tokens == 24
    assert resolve_budget("m", "eagle3", "default", "auto", kernels=".rows-q4_1")[1] == other


def test_static_tree_search_and_its_saved_budget(tmp_path):
    """eagle1's search: each static tree size once (sizes outside 2..20 skipped), then the chains at the
    best size; the saved record holds the tree's paths and loads back as the same budget."""
    from eagle_jax.autotune import budget_fields, describe_budget, load_budget, save_budget, search_static_budgets
    from eagle_jax.draft import TreeBudget

    seen = []

    def measure(b):
        seen.append((b.num_nodes, b.lookup))
        return {"expected_speedup": 10 - abs(b.static_tree.num_nodes - 4) + 1.5 * (b.lookup == 2)}

    base = TreeBudget("static", static_tree=static_tree_of_size(20))
    best, rows = search_static_budgets([1, 2, 3, 4, 6, 40], base, measure, lookups=(0, 2))
    assert seen == [(2, 0), (3, 0), (4, 0), (6, 0), (6, 2)]  # a static tree's chain rows come on top
    assert best == TreeBudget("static", static_tree=static_tree_of_size(4), lookup=2)
    assert rows[2]["paths"] == static_tree_of_size(4).to_json() and rows[2]["kind"] == "static"
    path = save_budget({"method": "eagle1", "budget": budget_fields(best)}, tmp_path / "eagle1.json")
    assert load_budget(path, "eagle1") == best
    assert describe_budget(best).startswith("static tree: 4 tokens")
    with pytest.raises(ValueError, match="no candidate size"):
        search_static_budgets([1, 30], base, measure)


def test_autotune_sizes_eagle1s_static_tree(tiny_hf_dir, monkeypatch):
    """The measured search on a real engine: each static tree generates and is profiled, the winner
    is set on the engine and recorded with its paths."""
    from eagle_jax import autotune

    engine = Engine(str(tiny_hf_dir), method="eagle1", drafter="random", progress=False)
    prompts = [engine.encode("w5 w6"), engine.encode("w7")]
    rec = autotune.autotune_budget(engine, "eagle1", prompts, candidates=(3, 2), lookups=(), max_new_tokens=4, reps=1)
    assert [r["total_tokens"] for r in rec["candidates"]] == [2, 3]
    for r in rec["candidates"]:  # one at a time, so that a failure says which
        assert r["kind"] == "static" and r["tau"] >= 1, r
        assert r["step_ms"] > 0 and r["plain_step_ms"] > 0, r  # no cost lost in the noise (step_profile)
    assert all(len(r["step_over_plain_runs"]) == 2 for r in rec["candidates"])  # both finalists timed again
    assert all(r["turns_speedup"] > 0 and r["turns_tokens_per_s"] > 0 for r in rec["candidates"])  # then decoded
    best = max(rec["candidates"], key=lambda r: r["turns_speedup"])  # the faster in turns wins
    assert rec["budget"] == {k: best[k] for k in rec["budget"]} and rec["budget"]["paths"] == best["paths"]
    assert engine.budgets["eagle1"].static_tree == static_tree_of_size(best["total_tokens"])


@pytest.mark.parametrize("turns", [2, 0])
def test_finalists_decoded_in_turns_decide(tiny_hf_dir, monkeypatch, turns):
    """The finalists decode the prompts in turns with plain decoding and the fastest wins, whatever
    their expected speedups said (here the turns favour the finalist the profile ranked last);
    turns=0 leaves the choice to the expected speedup. The engine keeps its head."""
    from eagle_jax import autotune, bench_turns

    engine = Engine(str(tiny_hf_dir), method="eagle3", drafter="random", progress=False)
    head = engine.heads["eagle3"]
    prompts = [engine.encode("w5 w6"), engine.encode("w7")]
    calls, seen = [], {}
    real_settle = autotune._settle

    def spy(engine_, method, rows, *a):  # the rows as the search left them, for the fake below
        seen["rows"] = rows
        return real_settle(engine_, method, rows, *a)

    def settle(eng, method, budgets, ids, max_new, rounds, cache_len=None, log=None):
        calls.append((method, len(budgets), len(ids), max_new, rounds))
        row = lambda label: seen["rows"][int(label.split()[0][1:])]  # labels are "#<row index> <tree>"
        last = min(budgets, key=lambda label: row(label)["expected_speedup"])
        return {label: {"speedup_vs_vanilla": 1.5 if label == last else 1.1, "tokens_per_s": 9.0} for label in budgets}

    monkeypatch.setattr(bench_turns, "settle_in_turns", settle)
    monkeypatch.setattr(autotune, "_settle", spy)
    rec = autotune.autotune_budget(engine, "eagle3", prompts, candidates=(2, 3), shapes=(), lookups=(),
                                   lookup_ngrams=(), max_new_tokens=4, reps=1, confirm=2, turns=turns)
    rows = rec["candidates"]
    finalists = [r for r in rows if "step_over_plain_runs" in r]
    assert len(finalists) == 2 and engine.heads["eagle3"] is head
    shape = lambda r: (r["total_tokens"], r["depth"], r["top_k"])
    if turns:
        assert calls == [("eagle3", 2, 2, 4, 2)]
        worst = min(finalists, key=lambda r: r["expected_speedup"])
        assert shape(rec["budget"]) == shape(worst) and worst["turns_speedup"] == 1.5
        assert sorted(r["turns_speedup"] for r in finalists) == [1.1, 1.5]
    else:
        assert calls == [] and not any("turns_speedup" in r for r in rows)
        assert shape(rec["budget"]) == shape(max(finalists, key=lambda r: r["expected_speedup"]))
    b = engine.budgets["eagle3"]
    assert (b.total_tokens, b.depth, b.top_k) == shape(rec["budget"])


@pytest.mark.parametrize("second,pick", [(1.154, 2), (1.140, 1)])
def test_turns_tie_goes_to_the_cheaper_tree(second, pick):
    """Finalists within TURNS_TIE of the fastest in turns are a tie, taken by the tree that computes
    least (stop 77: 3/1/3 at 1.158x against the same tree drafted with top-k 2 at 1.154x); outside
    it the fastest wins. A static tree's chain counts as rows."""
    from eagle_jax.autotune import draft_cost, pick_in_turns
    from eagle_jax.draft.drafting import TreeBudget

    budgets = [TreeBudget(total_tokens=2, depth=0, top_k=1), TreeBudget(total_tokens=3, depth=1, top_k=3),
               TreeBudget(total_tokens=3, depth=1, top_k=2)]
    rows = [{"turns_speedup": 1.128}, {"turns_speedup": 1.158}, {"turns_speedup": second}]
    assert pick_in_turns(rows, budgets, [0, 1, 2]) == pick
    assert pick_in_turns(rows, budgets, [0, 1, 2], tie=0.0) == 1
    assert pick_in_turns(rows, budgets, [0, 1, 2], tie=0.05) == 0  # all three tie: the 2-token tree
    from eagle_jax.tree import StaticTree

    chain = TreeBudget("static", static_tree=StaticTree.from_json([[0]]), lookup=2)
    assert draft_cost(chain) > draft_cost(TreeBudget(total_tokens=2, depth=0, top_k=1))


def test_finalists_timed_again_choose_by_both_timings():
    """The winner's curse: a tree whose one timing came out low (its plain steps slow) leads the search;
    timed again, the mean of its two ratios ranks it below the runner-up, which wins. Rows outside the
    finalists keep their one timing and cannot win."""
    from eagle_jax.autotune import confirm_finalists

    def row(tau, ratio, step):
        return {"tau": tau, "step_over_plain": ratio, "expected_speedup": tau / ratio, "step_ms": step,
                "plain_step_ms": step / ratio, "expected_tokens_per_s": 1e3 * tau / step}

    rows = [row(2.45, 1.415, 18.4), row(2.72, 1.62, 18.0), row(2.15, 1.42, 16.7), row(2.87, 1.77, 19.9)]
    again = {0: 1.60, 1: 1.62, 3: 1.0}  # row 2 is not a finalist (4th by expected speedup)
    said = []
    best = confirm_finalists(rows, lambda i: {"step_over_plain": again[i], "step_ms": 18.0, "plain_ms": 11.0},
                             3, said.append, lambda i: f"tree {i}")
    assert sorted(i for i, r in enumerate(rows) if "step_over_plain_runs" in r) == [0, 1, 3]
    assert rows[0]["step_over_plain"] == pytest.approx((1.415 + 1.60) / 2)
    assert rows[0]["expected_speedup"] == pytest.approx(2.45 / rows[0]["step_over_plain"])
    assert rows[0]["step_ms"] == pytest.approx(18.2)
    assert rows[0]["plain_step_ms"] == pytest.approx((18.4 / 1.415 + 11) / 2)
    assert best == 3 and len(said) == 3 and said[0].startswith("tree 0")  # row 3 now the best
    rows[3]["expected_speedup"] = 0.0
    assert confirm_finalists(rows[:3], lambda i: {"step_over_plain": 1.5, "step_ms": 1, "plain_ms": 1}, 2) == 1
    assert confirm_finalists(rows[:1], lambda i: 1 / 0, 3) == 0  # one row: nothing timed again


def test_cpu_core_names_the_amd_cores_that_packaged_budgets_are_tuned_for():
    from eagle_jax.kernels.cpu_matmul import cpu_core

    assert cpu_core(("AuthenticAMD", 26, 2)) == "zen5"  # family 1Ah, the stop-80 VM
    assert cpu_core(("AuthenticAMD", 25, 1)) == "zen3"  # Milan
    assert cpu_core(("AuthenticAMD", 25, 17)) == "zen4"  # Genoa
    assert cpu_core(("AuthenticAMD", 25, 0x61)) == "zen4"  # Raphael
    assert cpu_core(("AuthenticAMD", 25, 0x50)) == "zen3"  # Cezanne
    assert cpu_core(("AuthenticAMD", 23, 49)) is None  # Zen 2: no budget of its own
    assert cpu_core(("GenuineIntel", 6, 207)) is None
