"""`python -m eagle_jax.bench turns` bookkeeping on the tiny model (no timing assertions)."""

import pytest

from eagle_jax import bench, bench_turns
from eagle_jax.draft import TreeBudget
from eagle_jax.engine import Engine


def test_parse_tree():
    assert bench_turns.parse_tree("serve") is None
    b = bench_turns.parse_tree("4/2/4")
    assert (b.kind, b.total_tokens, b.depth, b.top_k, b.lookup) == ("dynamic", 4, 2, 4, 0)
    assert bench_turns.parse_tree("5/1/2/2").lookup == 2
    assert bench_turns.tree_label(bench_turns.parse_tree("5/1/2/2")) == "5/1/2/2"
    for bad in ("3/1", "a/b/c", "3/1/2/1/0"):
        with pytest.raises(ValueError, match="N/D/K"):
            bench_turns.parse_tree(bad)
    with pytest.raises(ValueError, match="total_tokens"):
        bench_turns.parse_tree("40/1/2")  # more than the shape can hold


def test_parse_static_and_saved_trees(tmp_path):
    import json

    from eagle_jax.autotune import budget_fields
    from eagle_jax.tree import static_tree_of_size

    b = bench_turns.parse_tree("s3", "eagle1")
    assert (b.kind, b.static_tree, b.lookup) == ("static", static_tree_of_size(3), 0)
    assert bench_turns.tree_label(bench_turns.parse_tree("s2/2", "eagle1")) == "s2/2"
    assert bench_turns.tree_label(b) == "s3" != bench_turns.tree_label(bench_turns.parse_tree("3/1/2"))
    with pytest.raises(ValueError, match="eagle1 drafts static trees"):
        bench_turns.parse_tree("3/1/2", "eagle1")
    with pytest.raises(ValueError, match="eagle2 drafts dynamic trees"):
        bench_turns.parse_tree("s3", "eagle2")
    for bad in ("s", "s2/1/1", "sx"):
        with pytest.raises(ValueError, match="sN or sN/L"):
            bench_turns.parse_tree(bad, "eagle1")
    saved = TreeBudget("static", static_tree=static_tree_of_size(4), lookup=2)
    (tmp_path / "t.json").write_text(json.dumps({"method": "eagle1", "budget": budget_fields(saved)}))
    assert bench_turns.parse_tree(str(tmp_path / "t.json"), "eagle1") == saved
    with pytest.raises(ValueError, match="tuned for eagle1, not eagle2"):
        bench_turns.parse_tree(str(tmp_path / "t.json"), "eagle2")


def test_turns_run_eagle1_static_trees(tiny_hf_dir):
    engine = Engine(str(tiny_hf_dir), progress=False)
    heads = {"": engine.load_head("eagle1", "oracle")}
    budgets = {label: bench_turns.parse_tree(label, "eagle1") for label in ("s2", "s4/2")}
    prompts = [("a", engine.encode("w5 w6")), ("b", engine.encode("w8 w9 w10"))]
    res = bench_turns.run_turns(engine, "eagle1", heads, budgets, prompts, max_new_tokens=9, rounds=1)
    assert list(res["settings"]) == ["s2", "s4/2"]
    for f in res["settings"].values():
        assert f["new_tokens"] == res["vanilla"]["new_tokens"] and f["same_tokens_as_vanilla"] == "2/2"
    # the oracle accepts every drafted token: 1 a step from s2, up to 2 from s4 (depth 2) or its chain
    assert res["settings"]["s4/2"]["tau"] > res["settings"]["s2"]["tau"] > 1.0


def test_turns_count_every_round_and_check_every_setting(tiny_hf_dir, monkeypatch):
    engine = Engine(str(tiny_hf_dir), progress=False)
    heads = {"random": engine.load_head("eagle3", "random"), "oracle": engine.load_head("eagle3", "oracle")}
    budgets = {"3/1/2": TreeBudget("dynamic", 3, 1, 2), "5/3/2": TreeBudget("dynamic", 5, 3, 2)}
    prompts = [("a", engine.encode("w5 w6")), ("a", engine.encode("w7")), ("b", engine.encode("w8 w9 w10"))]
    calls = []
    real = engine.generate_ids

    def counting(ids, n, **kw):
        calls.append((kw["method"], kw["method"] != "vanilla" and engine.budgets["eagle3"].total_tokens))
        return real(ids, n, **kw)

    monkeypatch.setattr(engine, "generate_ids", counting)
    res = bench_turns.run_turns(engine, "eagle3", heads, budgets, prompts, max_new_tokens=9, rounds=2)
    labels = ["random 3/1/2", "random 5/3/2", "oracle 3/1/2", "oracle 5/3/2"]
    assert list(res["settings"]) == labels and len(res["rounds"]) == 2
    assert len(calls) == 5 * (1 + 2 * len(prompts))  # one warm-up decode each, then every prompt every round
    assert sorted(c[1] for c in calls if c[0] == "eagle3")[-1] == 5  # the settings' own trees ran
    singles = {s: sum(real(ids, 9).new_tokens for t, ids in prompts if t == s) for s in ("a", "b")}
    v = res["vanilla"]
    assert v["sets"]["a"]["new_tokens"] == 2 * singles["a"] and v["new_tokens"] == 2 * sum(singles.values())
    assert v["tau"] == 1.0  # one target call a token (the prefill's included)
    for label in labels:
        f = res["settings"][label]
        assert f["new_tokens"] == v["new_tokens"]  # greedy: the same tokens as plain decoding
        assert f["speedup_vs_vanilla"] == pytest.approx(f["tokens_per_s"] / v["tokens_per_s"])
        assert f["tokens_per_s"] == pytest.approx(f["new_tokens"] / f["seconds"])
    assert res["settings"]["oracle 5/3/2"]["tau"] > res["settings"]["random 5/3/2"]["tau"]
    assert res["settings"]["oracle 5/3/2"]["tau"] > res["settings"]["oracle 3/1/2"]["tau"]  # deeper tree, more
    assert res["rounds"][0]["vanilla"]["new_tokens"] * 2 == v["new_tokens"]  # each round's line is cumulative

    def differing(ids, n, **kw):
        g = real(ids, n, **kw)
        if kw["method"] != "vanilla" and engine.heads["eagle3"] is heads["oracle"]:
            g.tokens = g.tokens[:-1] + [g.tokens[-1] + 1]
        return g

    monkeypatch.setattr(engine, "generate_ids", differing)
    with pytest.raises(AssertionError, match="oracle 3/1/2 decoded prompt 0"):
        bench_turns.run_turns(engine, "eagle3", heads, budgets, prompts, max_new_tokens=9, rounds=1)


def test_turns_cli_refuses_bad_settings_before_loading(capsys, monkeypatch):
    monkeypatch.setattr("eagle_jax.engine.Engine.__init__", lambda *a, **k: pytest.fail("loaded a model"))
    assert bench.main(["turns", "--trees", "3/1"]) == 2
    assert "N/D/K" in capsys.readouterr().err
    assert bench.main(["turns", "--method", "eagle1", "--trees", "3/1/2"]) == 2
    assert "eagle1 drafts static trees" in capsys.readouterr().err
    assert bench.main(["turns", "--rows", "q9"]) == 2
    assert "unknown draft-row kind" in capsys.readouterr().err
    assert bench.main(["turns", "--rounds", "0"]) == 2
    assert bench.main(["turns", "--rows", "i8,q4_1x8,q8_0x8", "--trees", "2/0/1,3/1/2,4/1/2,4/2/4,5/3/2"]) == 2
    assert "more than 12 settings" in capsys.readouterr().err
