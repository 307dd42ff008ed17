"""Benchmark bookkeeping on the tiny model (no timing assertions)."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

import eagle_jax

from eagle_jax import bench
from eagle_jax.engine import Engine
from eagle_jax.tree import static_tree_of_size


def test_counts_tau_and_warmup_exclusion(tiny_hf_dir, monkeypatch):
    engine = Engine(str(tiny_hf_dir), progress=False)
    prompts = [engine.encode(p) for p in ["w5 w6", "w7", "w8 w9 w10"]]
    calls = {"vanilla": 0, "hf": 0}
    real = bench.make_runners

    def counting(engine, methods, cache_len, sampling=bench.GREEDY):
        runners = real(engine, methods, cache_len, sampling)

        def wrap(m, f):
            def run(ids, n, seed=0):
                calls[m] += 1
                return f(ids, n, seed=seed)
            return run
        return {m: wrap(m, f) for m, f in runners.items()}

    monkeypatch.setattr(bench, "make_runners", counting)
    res = bench.run_bench(engine, prompts, ["vanilla", "hf"], max_new_tokens=7, first_token=False)
    assert calls == {m: bench.WARMUP_ROUNDS + len(prompts) for m in calls}
    assert "first_token_s" not in res["vanilla"]
    calls.update(vanilla=0, hf=0)
    timed = bench.run_bench(engine, prompts, ["vanilla", "hf"], max_new_tokens=7)  # + one 1-token run each
    assert calls == {m: 2 * (bench.WARMUP_ROUNDS + len(prompts)) for m in calls}
    # both split figures are there (their arithmetic: test_first_token_split_arithmetic); the loop's may be 0 on
    # this tiny model, whose 7 tokens can take less than the separate 1-token run on a busy machine
    assert all(r["first_token_s"] > 0 and r["loop_tokens_per_s"] >= 0 for r in timed.values())
    v, h = res["vanilla"], res["hf"]
    singles = [engine.generate_ids(p, 7) for p in prompts]
    assert v["new_tokens"] == sum(g.new_tokens for g in singles) and v["prompts"] == 3
    assert v["tau"] == 1.0 and h["tau"] is None
    assert h["same_tokens_as_vanilla"] == "3/3"  # same weights, same greedy tokens
    assert abs(v["speedup_vs_hf"] * h["speedup_vs_vanilla"] - 1) < 1e-9
    assert abs(v["tokens_per_s"] - v["new_tokens"] / v["seconds"]) < 1e-9


def test_sampled_bench_seeds_each_prompt_and_skips_the_identity_check(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    engine = Engine(str(tiny_hf_dir), progress=False)
    engine.add_method("eagle3", "random")
    prompts = [engine.encode(p) for p in ["w5 w6", "w7", "w8 w9 w10"]]
    sp = bench.Sampling(temperature=1.3, top_p=0.95, seed=11)
    rows = bench.run_rows(engine, prompts, ["vanilla", "eagle3", "hf"], 8, first_token=False, sampling=sp)
    for m in ("vanilla", "eagle3"):  # prompt i sampled with seed 11 + i: a rerun makes the same tokens
        again = [engine.generate_ids(p, 8, method=m, temperature=1.3, top_p=0.95, seed=11 + i).tokens
                 for i, p in enumerate(prompts)]
        assert [r["tokens"] for r in rows[m]] == again
    greedy = [engine.generate_ids(p, 8).tokens for p in prompts]
    assert [r["tokens"] for r in rows["vanilla"]] != greedy != [r["tokens"] for r in rows["hf"]]  # they sampled
    hf = bench.make_runners(engine, ["hf"], 64, sp)["hf"]
    assert [hf(p, 8, seed=11 + i)["tokens"] for i, p in enumerate(prompts)] == [r["tokens"] for r in rows["hf"]]
    out = bench.summarize(rows, sampled=True)
    assert all("same_tokens_as_vanilla" not in r for r in out.values())
    assert out["eagle3"]["new_tokens"] == sum(len(r["tokens"]) for r in rows["eagle3"])
    assert out["eagle3"]["tau"] == out["eagle3"]["new_tokens"] / sum(r["target_calls"] for r in rows["eagle3"])
    # the CLI: every decode, the step profile's too, samples; settings record the sampling; autotuning
    # (greedy) and bad settings are refused
    temperatures = []
    real_request = Engine._request
    monkeypatch.setattr(Engine, "_request", lambda self, ids, n, t, *a: temperatures.append(t) or
                        real_request(self, ids, n, t, *a))
    assert bench.main(["--model", str(tiny_hf_dir), "--prompts", str(_prompt_file(tmp_path / "p.jsonl", ["w5"])),
                       "--max-new-tokens", "4", "--methods", "vanilla,eagle3", "--drafter", "random",
                       "--temperature", "0.7", "--top-k", "5", "--profile-reps", "1", "--json"]) == 0
    assert temperatures and set(temperatures) == {0.7}
    cap = capsys.readouterr()
    res = json.loads(cap.out.splitlines()[-1])
    assert res["settings"]["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 5, "seed": 0}
    assert "sampled: temperature 0.7, top-p 1, top-k 5" in cap.err
    from eagle_jax.bench_plots import _title
    assert "sampled (T 0.7, top-p 1, top-k 5)" in _title(res) and "greedy" in _title({})
    for bad in (["--temperature", "0.7", "--total-tokens", "auto"], ["--temperature", "-1"], ["--top-p", "0"]):
        assert bench.main(["--model", str(tiny_hf_dir), "--methods", "vanilla", *bad]) == 2
    assert "greedy" in capsys.readouterr().err


def test_first_token_split_arithmetic():
    row = lambda new, sec, first: {"tokens": [0] * new, "new_tokens": new, "target_calls": new, "seconds": sec,
                                   "first_token_seconds": first}
    rows = {"vanilla": [row(11, 1.5, 0.5), row(21, 2.5, 0.5)], "eagle3": [row(11, 1.0, 0.5), row(21, 1.5, 0.5)]}
    out = bench.summarize(rows)
    v, e = out["vanilla"], out["eagle3"]
    assert v["first_token_s"] == 0.5 and v["loop_tokens_per_s"] == 30 / 3.0  # (10 + 20) tokens in (1 + 2) s
    assert e["loop_tokens_per_s"] == 30 / 1.5 and e["loop_speedup_vs_vanilla"] == 2.0
    assert e["speedup_vs_vanilla"] == (32 / 2.5) / (32 / 4.0)  # end to end, the prefill included
    assert "first_token_s" in bench.markdown_table(out).splitlines()[0]
    # a 1-token run slower than the whole run adds no negative loop time; all such runs: a rate of 0
    late = bench.summarize({"vanilla": [row(11, 1.5, 0.5), row(21, 0.4, 0.5)], "hf": [row(3, 0.1, 0.2)]})
    assert late["vanilla"]["loop_tokens_per_s"] == 30 / 1.0 and late["hf"]["loop_tokens_per_s"] == 0.0


def test_cli_json_last_line(tiny_hf_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"w{i + 5}"}) + "\n" for i in range(4)))
    md = tmp_path / "not" / "yet" / "t.md"  # its folder is made, before the run (stop 71 lost one to it)
    assert bench.main(["--model", str(tiny_hf_dir), "--prompts", str(prompts), "--limit", "2",
                       "--max-new-tokens", "5", "--methods", "vanilla", "--json", "--markdown", str(md)]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(out) >= {"methods", "machine"} and out["methods"]["vanilla"]["prompts"] == 2
    assert out["machine"]["cpu_isa"] in (None, "avx512", "avx2") and "cpu_family_model" in out["machine"]
    assert out["machine"]["cpu_kernel_prefetch"] in (None, True, False)
    assert out["machine"]["xla_flags"] == os.environ.get("XLA_FLAGS", "")  # the tests' backend level, say
    assert {"tokens_per_s", "tau", "new_tokens", "seconds"} <= set(out["methods"]["vanilla"])
    assert "| vanilla |" in md.read_text()


def _prompt_file(path, words):
    path.write_text("".join(json.dumps({"id": i, "prompt": w}) + "\n" for i, w in enumerate(words)))
    return path


def test_prompt_sets_time_split_and_plots(tiny_hf_dir, tmp_path, capsys):
    a = _prompt_file(tmp_path / "seta.jsonl", ["w5 w6", "w7"])
    b = _prompt_file(tmp_path / "setb.jsonl", ["w9 w10 w11", "w12", "w13"])
    plots = tmp_path / "plots"
    assert bench.main(["--model", str(tiny_hf_dir), "--prompts", f"{a},{b}", "--limit", "2", "--max-new-tokens", "6",
                       "--methods", "vanilla,eagle3", "--drafter", "random", "--profile-reps", "2",
                       "--plots", str(plots), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert list(out["sets"]) == ["seta", "setb"]
    for m in ("vanilla", "eagle3"):  # the pooled figures are the sum of the sets'
        assert out["methods"][m]["new_tokens"] == sum(out["sets"][s][m]["new_tokens"] for s in out["sets"])
        assert out["methods"][m]["prompts"] == 4
    split = out["methods"]["eagle3"]["time_split"]
    assert split["draft_ms"] > 0 and split["verify_ms"] > 0 and split["step_ms"] > 0 and split["plain_ms"] > 0
    assert abs(split["draft_ms"] + split["verify_ms"] + split["other_ms"] - split["step_ms"]) < 1e-6
    assert "time_split" not in out["methods"]["vanilla"]
    for name in ("speedup.png", "acceptance.png", "time_split.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (plots / "budget.png").exists()  # no autotune in this run


def test_output_folders_that_cannot_be_made_are_refused_before_loading(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for flag, path in (("--markdown", blocker / "t.md"), ("--plots", blocker / "plots"),
                       ("--save-budget", blocker / "METHOD.json"), ("--save-budget", blocker / "METHOD" / "b.json")):
        assert bench.main(["--model", "no/such/model", "--methods", "vanilla", flag, str(path)]) == 2
        err = capsys.readouterr().err
        assert "output folder" in err and str(blocker) in err and "no/such/model" not in err


def test_unknown_prompt_set_is_refused(capsys):
    assert bench.main(["--prompts", "chat,nonsense", "--methods", "vanilla"]) == 2
    assert "nonsense" in capsys.readouterr().err


def test_transformers_methods_without_torch_are_refused_before_loading(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as where only `pip install -e .` went in
    assert bench.main(["--model", "no/such/model", "--methods", "vanilla,hf-pld"]) == 2
    err = capsys.readouterr().err
    assert "hf-pld" in err and "needs torch" in err and ".[bench]" in err


@pytest.mark.slow  # compiles and times every candidate tree, then runs serve (75 s in a cold CI run)
def test_autotune_saves_a_budget_that_serve_loads(tiny_hf_dir, tmp_path, capsys, monkeypatch):
    from eagle_jax import autotune
    from eagle_jax.autotune import default_budget_path, load_budget
    from eagle_jax.serve.cli import main as serve_main

    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "cache"))
    released = []
    real_release = autotune.release_programs

    def release():  # each measured tree's compiled programs are dropped (memory maps), none left behind
        from eagle_jax.speculative import speculative_generate

        generated = speculative_generate._cache_size() > 0
        real_release()
        released.append((generated, speculative_generate._cache_size()))

    monkeypatch.setattr(autotune, "release_programs", release)
    prompts = _prompt_file(tmp_path / "p.jsonl", ["w5 w6"])
    assert bench.main(["--model", str(tiny_hf_dir), "--prompts", str(prompts), "--limit", "1", "--max-new-tokens", "5",
                       "--methods", "vanilla,eagle3", "--drafter", "random", "--total-tokens", "auto",
                       "--auto-candidates", "4", "--auto-shapes", "1:2", "--auto-lookups", "0,2",
                       "--auto-lookup-ngrams", "2",
                       "--profile-reps", "0", "--plots", str(tmp_path / "plots"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    rec = out["autotune"]["eagle3"]
    rows = rec["candidates"]
    from eagle_jax.training.prompts import CALIBRATION_FILE, load_prompt_file

    # tuned on the calibration prompts (training prompts: never the benchmark's), at the benchmark's length
    assert rec["prompts"] == len(load_prompt_file(CALIBRATION_FILE)) and rec["max_new_tokens"] == 5
    shape = lambda r: (r["total_tokens"], r["depth"], r["top_k"], r["lookup"], r["lookup_min_ngram"])
    # the search ranked by each tree's first timing (the finalists' second comes after it)
    first_timing = lambda r: r["tau"] / r["step_over_plain_runs"][0] if "step_over_plain_runs" in r \
        else r["expected_speedup"]
    best_of = lambda rs: max(rs, key=first_timing)
    # The flags reach the search (whose order test_budget_search_* checks with a fake measure): the
    # size with the default tree's top-k 4 (depth 5, clamped to N - 2) and the first chain listed (0),
    # then shape 1:2, then chain 2 at the best tree so far, then the shortest n-gram 2 if the best tree
    # has a chain; no tree twice
    assert [shape(r) for r in rows[:2]] == [(4, 2, 4, 0, 1), (4, 1, 2, 0, 1)]
    b2 = best_of(rows[:2])
    assert shape(rows[2]) == shape(b2)[:3] + (2, 1)
    b3 = best_of(rows[:3])
    assert len(rows) == (4 if b3["lookup"] else 3)
    if b3["lookup"]:
        assert shape(rows[3]) == shape(b3)[:4] + (2,)
    assert len({shape(r) for r in rows}) == len(rows)
    # one release a measured tree (after generating with it), then one a finalist timed again (a profile)
    assert released == [(True, 0)] * len(rows) + [(False, 0)] * min(3, len(rows))
    assert sum(len(r.get("step_over_plain_runs", ())) == 2 for r in rows) == min(3, len(rows))
    best = max([r for r in rows if "step_over_plain_runs" in r], key=lambda r: r["expected_speedup"])  # both timings
    assert shape(rec["budget"]) == shape(best)
    for r in rows:  # ranked by the speedup expected from a plain step timed beside the tree's step
        assert abs(r["expected_tokens_per_s"] - 1e3 * r["tau"] / r["step_ms"]) < 1e-6
        assert r["plain_step_ms"] > 0
        assert r["step_over_plain"] > 0 and abs(r["expected_speedup"] - r["tau"] / r["step_over_plain"]) < 1e-9
    assert f"total_tokens={best['total_tokens']}" in out["settings"]["budgets"]["eagle3"]  # the run used it
    path = default_budget_path(str(tiny_hf_dir), "eagle3", "random")
    saved = load_budget(path, "eagle3")
    assert rec["saved_to"] == str(path) and (saved.total_tokens, saved.depth, saved.top_k, saved.lookup,
                                             saved.lookup_min_ngram) == shape(best)
    assert (tmp_path / "plots" / "budget.png").exists()

    # serve's CLI, in this process (its programs are the benchmark's, already compiled)
    assert serve_main(["--model", str(tiny_hf_dir), "--prompt", "w5", "--method", "eagle3", "--drafter", "random",
                       "--total-tokens", "auto", "--max-new-tokens", "4", "--json"]) == 0
    assert f"tuned tree budget from {path}: {best['total_tokens']} tokens" in capsys.readouterr().err
    from eagle_jax.autotune import resolve_budget

    assert resolve_budget(str(tiny_hf_dir), "eagle3", "random", None)[0].total_tokens == best["total_tokens"]
    assert resolve_budget(str(tiny_hf_dir), "eagle3", "random", 5)[0].total_tokens == 5  # explicit flags win
    # so does the library: an Engine given no budget runs the same tree as serve
    from eagle_jax.engine import Engine, default_budget

    engine = Engine(str(tiny_hf_dir), method="eagle3", drafter="random", progress=False)
    assert engine.budgets["eagle3"].total_tokens == best["total_tokens"]
    engine.add_method("eagle2", "random")  # nothing tuned or packaged for it: the default tree
    assert engine.budgets["eagle2"] == default_budget("eagle2")
    # a later benchmark without tree flags measures what serve runs: the saved budget, not the 24-token default
    assert bench.main(["--model", str(tiny_hf_dir), "--prompts", str(prompts), "--limit", "1", "--max-new-tokens", "3",
                       "--methods", "vanilla,eagle3", "--drafter", "random", "--profile-reps", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert f"total_tokens={best['total_tokens']}," in out["settings"]["budgets"]["eagle3"]
    with pytest.raises(ValueError, match="eagle2"):
        load_budget(path, "eagle2")


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
        for isa, suffix in [("avx512", "cpu"), ("avx2", "cpu-avx2")]:
            monkeypatch.setattr(cpu_matmul, "cpu_isa", lambda isa=isa: isa)
            packaged = load_budget(budgets / f"smollm2-135m-instruct.{m}.default.{suffix}.json", m)
            assert resolve_budget("smollm2-135m-instruct", m, "default", None)[0] == packaged
        assert load_budget(budgets / f"smollm2-135m-instruct.{m}.default.cpu-avx2.json") != \
            load_budget(budgets / f"smollm2-135m-instruct.{m}.default.cpu.json")
    monkeypatch.setattr(cpu_matmul, "cpu_isa", lambda: "neon")  # no file for that kernel build: the CPU one
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
    best = max(rec["candidates"], key=lambda r: r["expected_speedup"])
    assert rec["budget"] == {k: best[k] for k in rec["budget"]} and rec["budget"]["paths"] == best["paths"]
    assert engine.budgets["eagle1"].static_tree == static_tree_of_size(best["total_tokens"])
    assert all(len(r["step_over_plain_runs"]) == 2 for r in rec["candidates"])  # both finalists timed again


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


def test_matmul_microbenchmark_chains_its_products():
    """Each product's input depends on the product before (so they run one after another, as in a
    decoding step), by a term too small to change the float32 values of x."""
    import jax
    import jax.numpy as jnp

    from eagle_jax.kernels.matmul_bench import _chained

    x = jnp.full((1, 4), 2.0)
    # y = [1e30 w, x0, x1]: the first product (w = 1) adds 1e-30 * 1e30 = 1 to x; the last (w = 0)
    # sums what it was given, 3 + 3 (independent products would give 2 + 2)
    big = lambda x, w: jnp.concatenate([jnp.full((1, 1), 1e30 * w), x[:, :2]], axis=1)
    assert float(_chained(big)(x, [1.0, 0.0])) == 6.0
    small = jax.jit(_chained(lambda x, w: x * w))
    assert float(small(x, [jnp.float32(3.0), jnp.float32(0.5)])) == 4 * 2.0 * 0.5  # x unchanged by 1e-30 * 6


def test_matmul_microbenchmark_glue_does_not_grow_with_the_chain():
    """Each product's input is computed from the first x and the product before only: chained as
    x_i = x_(i-1) + 1e-30 y_(i-1)[:, :1], XLA fused every earlier addition into each input (a
    fusion of i + 1 operands before the i-th product), and that glue, not the kernels, made
    several-row products look slow."""
    import re

    import jax
    import jax.numpy as jnp

    from eagle_jax.kernels.matmul_bench import _chained

    x = jnp.ones((3, 8))
    ws = [jnp.full((8, 16), float(i)) for i in range(6)]
    compiled = jax.jit(_chained(jnp.dot)).lower(x, ws).compile().as_text()
    operands = [len(args.split(",")) for args in re.findall(r"fusion\(([^)]*)\)", compiled)]
    assert len(operands) >= len(ws) - 1 and max(operands) <= 2, operands


def test_matmul_microbenchmark_times_every_row_kind(capsys):
    from eagle_jax.kernels import cpu_matmul as cm
    from eagle_jax.kernels import matmul_bench

    if not cm.available():
        pytest.skip(f"no CPU kernel here: {cm.unavailable_reason()}")
    res = matmul_bench.run(rows=(1, 3), k=64, n=80, matrices=2, reps=2)
    assert [r["rows"] for r in res] == [1, 3]
    for r in res:
        for key in ("xla_ms", "kernel_f32_ms", "kernel_q4_1_ms", "kernel_q8_0_ms"):
            assert r[key] > 0
        assert (r["kernel_i8_ms"] is None) == (not cm.i8_available())
    assert bench.main(["matmul", "--rows", "2", "--k", "32", "--n", "64", "--matrices", "1", "--reps", "1"]) == 0
    table = capsys.readouterr().out
    assert "| rows T | XLA float32 | kernel float32 | kernel Q4_1 blocks |" in table
    assert "| kernel int8 tiles |" in table and table.strip().splitlines()[-1].startswith("| 2 |")


def test_trace_summary_sums_sites_and_kinds_per_step():
    from eagle_jax import step_trace

    events = [("ffi_call.1", 800.0), ("ffi_call.1", 1200.0), ("ffi_call.2", 40.0), ("ffi_call.3", 10.0),
              ("ffi_call.3", 10.0), ("multiply_fusion.3", 20.0), ("multiply_fusion.17", 10.0), ("while", 5.0),
              ("$api.py:1 block_until_ready", 999.0), ("ThunkExecutor::Execute", 999.0), ("end: ffi_call", 1.0)]
    res = step_trace.summarize(events, steps=2)
    cc = res["custom_calls"]
    assert cc["calls"] == 2.5 and abs(cc["ms"] - 1.03) < 1e-12  # (2000 + 40 + 20) us over 2 steps
    assert [r["calls"] for r in cc["top_sites"]] == [1.0, 0.5, 1.0]  # by time: 1.0, 0.02, 0.01 ms a step
    # a site's bucket is its time a call: 1.0, 0.04 and 0.01 ms
    assert [(b["from_ms"], b["sites"]) for b in cc["buckets"]] == [(1.0, 1), (0.02, 1), (0.01, 1)]
    assert abs(sum(b["ms"] for b in cc["buckets"]) - cc["ms"]) < 1e-12
    assert res["xla_ops"] == {"multiply_fusion": {"calls": 1.0, "ms": pytest.approx(0.015)},
                              "while": {"calls": 0.5, "ms": pytest.approx(0.0025)}}


def test_trace_sums_by_name_scope_from_the_compiled_programs_text():
    from eagle_jax import step_trace

    hlo = "\n".join([
        'ENTRY %main.1 (p: f32[4]) -> f32[4] {',
        '  %copy.141 = f32[1,1,773,3,64]{4,3,2,1,0} copy(%gte.1), metadata={op_name="jit(spec_advance)/'
        'call_exported/jit(flat)/while/body/while/body/closed_call/Eagle3Module/midlayer/self_attn/scatter" '
        'stack_frame_id=3}',
        '  ROOT %ffi_call.7 = f32[1,960]{1,0} custom-call(%p), metadata={op_name="jit(decode_advance)/while/body/'
        'DecoderLayer/self_attn/qkv_proj/ffi_call"}',
        '  %add_add_fusion.3 = f32[1,3,9,64]{3,2,1,0} fusion(%a, %b), kind=kLoop, metadata={op_name="jit(x)/add"}',
        '  %constant.5 = s32[] constant(-4096)',
        '}'])
    scopes = step_trace.hlo_scopes(hlo)
    assert scopes == {"copy.141": "while/body/closed_call/Eagle3Module/midlayer/self_attn",
                      "ffi_call.7": "DecoderLayer/self_attn/qkv_proj", "add_add_fusion.3": "(top level)"}
    events = [("copy.141", 40.0), ("copy.141", 50.0), ("ffi_call.7", 30.0), ("ffi_call.7", 10.0),
              ("while.3", 6.0), ("$api.py:1 block_until_ready", 999.0)]
    res = step_trace.summarize(events, steps=2, scopes=scopes)
    assert res["by_scope"] == {
        "while/body/closed_call/Eagle3Module/midlayer/self_attn": {"calls": 1.0, "ms": pytest.approx(0.045)},
        "kernel: DecoderLayer/self_attn/qkv_proj": {"calls": 1.0, "ms": pytest.approx(0.02)},
        "(unnamed)": {"calls": 0.5, "ms": pytest.approx(0.003)}}
    assert "by_scope" not in step_trace.summarize(events, steps=2)
    assert "| kernel: DecoderLayer/self_attn/qkv_proj | 1.0 | 0.020 |" in step_trace.markdown(
        {"method": "x", "steps": 2, "wall_ms_per_step": 1.0, **res})


def test_trace_of_plain_steps_on_the_tiny_model(tiny_hf_dir):
    from eagle_jax import step_trace
    from eagle_jax.kernels import cpu_matmul as cm

    engine = Engine(str(tiny_hf_dir), progress=False)
    res = step_trace.trace_method(engine, "vanilla", engine.encode("w5 w6 w7"), steps=3)
    assert res["wall_ms_per_step"] > 0 and res["steps"] == 3
    cc = res["custom_calls"]
    if engine.cfg.matmul_impl == "cpu_kernel" and cm.available():
        # every layer's weight products go through the kernel: at least 7 sites a layer, each once a step
        assert cc["calls"] >= 7 * engine.cfg.num_layers
        assert all(abs(r["calls"] - round(r["calls"])) < 1e-9 for r in cc["top_sites"])
        # and by scope: the layers' products are kernel calls inside the decoder layers' scopes
        kernel_layers = [k for k in res["by_scope"] if k.startswith("kernel: DecoderLayer")]
        assert kernel_layers and all(res["by_scope"][k]["calls"] >= 1 for k in kernel_layers)
    assert any(k.startswith("DecoderLayer") for k in res["by_scope"])
    assert "| call duration |" in step_trace.markdown(res)
