"""Benchmark bookkeeping on the tiny model (no timing assertions)."""

import json
import os
import sys

import pytest

from eagle_jax import bench
from eagle_jax.engine import Engine


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
    assert out["machine"]["cpu_core"] in (None, "zen3", "zen4", "zen5")
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
    rows = out["rows"]["setb"]["eagle3"]  # each prompt's own figures, in the order decoded
    assert len(rows) == 2 and set(rows[0]) == set(bench.ROW_FIELDS)
    assert sum(r["new_tokens"] for r in rows) == out["sets"]["setb"]["eagle3"]["new_tokens"]
    from eagle_jax.bench_stats import ratio_interval
    pooled = {m: [r for s in out["rows"].values() for r in s[m]] for m in ("vanilla", "eagle3")}
    groups = [s for s, by_method in out["rows"].items() for _ in by_method["eagle3"]]
    assert groups == ["seta"] * 2 + ["setb"] * 2  # the pooled interval is drawn within each set
    ci = ratio_interval(pooled["eagle3"], pooled["vanilla"], groups=groups)
    assert out["methods"]["eagle3"]["speedup_vs_vanilla_ci95"] == ci
    for res in (out["methods"], *out["sets"].values()):  # two prompts or more: the speedups' intervals
        lo, hi = res["eagle3"]["speedup_vs_vanilla_ci95"]
        assert lo <= res["eagle3"]["speedup_vs_vanilla"] <= hi and "loop_speedup_vs_vanilla_ci95" in res["eagle3"]
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


@pytest.mark.parametrize("command", [["--methods", "vanilla"], ["turns"]])
def test_bad_prompt_files_are_refused_before_loading(command, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "fine"}\nnot json\n')
    assert bench.main([*command, "--model", "no/such/model", "--prompts", f"chat,{bad}"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not valid JSON" in err and "no/such/model" not in err
    folder = tmp_path / "a-folder.jsonl"
    folder.mkdir()
    assert bench.main([*command, "--model", "no/such/model", "--prompts", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and str(folder) in err and "no/such/model" not in err


def test_prompt_and_token_counts_below_one_are_refused_before_loading(capsys, monkeypatch):
    monkeypatch.setattr("eagle_jax.engine.Engine.__init__", lambda *a, **k: pytest.fail("loaded a model"))
    for flags in (["--limit", "0"], ["--limit", "-1"], ["--max-new-tokens", "0"]):
        assert bench.main(["--methods", "vanilla", *flags]) == 2
        assert ">= 1" in capsys.readouterr().err
        assert bench.main(["turns", *flags]) == 2
        assert ">= 1" in capsys.readouterr().err


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
    # one release a measured tree (after generating with it), then one a finalist timed again (a
    # profile), then one after the finalists decoded in turns (generating)
    finalists = [r for r in rows if "step_over_plain_runs" in r]
    assert released == [(True, 0)] * len(rows) + [(False, 0)] * min(3, len(rows)) + [(True, 0)] * (len(rows) > 1)
    assert len(finalists) == min(3, len(rows)) and all(len(r["step_over_plain_runs"]) == 2 for r in finalists)
    assert all("turns_speedup" in r for r in finalists) and not any("turns_speedup" in r for r in rows
                                                                     if r not in finalists)
    # the fastest decoding the prompts in turns, or, among the finalists within autotune.TURNS_TIE of
    # it (since stop 78), the one that computes least: fewest rows, then depth, top-k, chain
    from eagle_jax.autotune import TURNS_TIE

    fastest = max(r["turns_speedup"] for r in finalists)
    close = [r for r in finalists if r["turns_speedup"] >= fastest * (1.0 - TURNS_TIE)]
    best = min(close, key=lambda r: (r["total_tokens"], r["depth"], r["top_k"], r["lookup"], -r["turns_speedup"]))
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


def test_trace_runs_the_tree_it_is_given(tiny_hf_dir, capsys):
    from eagle_jax import step_trace

    argv = ["--model", str(tiny_hf_dir), "--method", "eagle3", "--drafter", "oracle", "--steps", "2"]
    assert step_trace.main(argv + ["--tree", "4/1/3", "--json"]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out.splitlines()[-1])["results"]
    assert [(r["method"], r["tree"]) for r in res] == [("vanilla", None), ("eagle3", "4/1/3")]
    assert "eagle3 (tree 4/1/3): " in out.err
    for bad in (["--tree", "s4"], ["--tree", "4/1"]):  # eagle3 drafts dynamic trees; not a tree
        with pytest.raises(SystemExit):
            step_trace.main(argv + bad)
        assert "tree" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_trace.main(["--model", str(tiny_hf_dir), "--tree", "4/1/3"])  # vanilla has no tree
