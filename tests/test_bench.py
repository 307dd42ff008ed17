"""Benchmark bookkeeping on the tiny model (no timing assertions)."""

import json

from eagle_jax import bench
from eagle_jax.engine import Engine


def test_counts_tau_and_warmup_exclusion(tiny_hf_dir, monkeypatch):
    engine = Engine(str(tiny_hf_dir), progress=False)
    prompts = [engine.encode(p) for p in ["w5 w6", "w7", "w8 w9 w10"]]
    calls = {"vanilla": 0, "hf": 0}
    real = bench.make_runners

    def counting(engine, methods, cache_len):
        runners = real(engine, methods, cache_len)

        def wrap(m, f):
            def run(ids, n):
                calls[m] += 1
                return f(ids, n)
            return run
        return {m: wrap(m, f) for m, f in runners.items()}

    monkeypatch.setattr(bench, "make_runners", counting)
    res = bench.run_bench(engine, prompts, ["vanilla", "hf"], max_new_tokens=7)
    assert calls == {m: bench.WARMUP_ROUNDS + len(prompts) for m in calls}
    v, h = res["vanilla"], res["hf"]
    singles = [engine.generate_ids(p, 7) for p in prompts]
    assert v["new_tokens"] == sum(g.new_tokens for g in singles) and v["prompts"] == 3
    assert v["tau"] == 1.0 and h["tau"] is None
    assert h["same_tokens_as_vanilla"] == "3/3"  # same weights, same greedy tokens
    assert abs(v["speedup_vs_hf"] * h["speedup_vs_vanilla"] - 1) < 1e-9
    assert abs(v["tokens_per_s"] - v["new_tokens"] / v["seconds"]) < 1e-9


def test_cli_json_last_line(tiny_hf_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"w{i + 5}"}) + "\n" for i in range(4)))
    md = tmp_path / "t.md"
    assert bench.main(["--model", str(tiny_hf_dir), "--prompts", str(prompts), "--limit", "2",
                       "--max-new-tokens", "5", "--methods", "vanilla", "--json", "--markdown", str(md)]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(out) >= {"methods", "machine"} and out["methods"]["vanilla"]["prompts"] == 2
    assert {"tokens_per_s", "tau", "new_tokens", "seconds"} <= set(out["methods"]["vanilla"])
    assert "| vanilla |" in md.read_text()
