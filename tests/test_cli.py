"""`python -m eagle_jax.serve` one-shot: --json contract, prompts files, clear errors."""

import json
import subprocess
import sys

import pytest

from eagle_jax.engine import Engine
from eagle_jax.serve.cli import main, read_prompts

FIELDS = {"id", "text", "tokens", "new_tokens", "target_calls", "accept_lengths", "tau", "seconds"}


def _run(*args):
    return subprocess.run([sys.executable, "-m", "eagle_jax.serve", *args], capture_output=True, text=True,
                          timeout=300)


def test_json_output_is_one_object_per_prompt_and_nothing_else(tiny_hf_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "w5 w6 w7"}\n\n{"id": 7, "prompt": "w9"}\n')
    r = _run("--model", str(tiny_hf_dir), "--prompts", str(prompts), "--max-new-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    objs = [json.loads(line) for line in lines]
    assert [o["id"] for o in objs] == ["a", 7]
    engine = Engine(str(tiny_hf_dir), progress=False)
    for o, p in zip(objs, ["w5 w6 w7", "w9"]):
        assert set(o) == FIELDS
        g = engine.generate(p, 6)
        assert o["tokens"] == g.tokens and o["text"] == g.text
        assert o["new_tokens"] == len(o["tokens"]) == o["target_calls"] and o["tau"] == 1.0
        assert o["accept_lengths"] == [1] * o["target_calls"]


def test_sampling_flags_and_raw(tiny_hf_dir, capsys):
    args = ["--model", str(tiny_hf_dir), "--prompt", "w5 w6", "--raw", "--json", "--max-new-tokens", "5",
            "--temperature", "0.9", "--top-p", "0.8", "--top-k", "10"]
    assert main(args + ["--seed", "1"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(args + ["--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == a["tokens"]


def test_prompt_longer_than_cache_says_so(tiny_hf_dir, capsys):
    rc = main(["--model", str(tiny_hf_dir), "--prompt", " ".join(["w5"] * 40), "--max-cache-len", "32",
               "--max-new-tokens", "4", "--json"])
    err = capsys.readouterr()
    assert rc == 2 and err.out == ""
    assert "exceeds the cache length 32" in err.err


def test_compilation_is_reported_apart_from_decoding(tiny_hf_dir, tmp_path, capsys):
    """The one-shot CLI compiles each new cache size before decoding it and says so once; the speed
    line after each answer is the decoding's. Two prompts of one cache size: one compile line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "w5 w6 w7"}\n{"id": 2, "prompt": "w9"}\n')
    assert main(["--model", str(tiny_hf_dir), "--prompts", str(prompts), "--max-new-tokens", "6"]) == 0
    err = capsys.readouterr().err.splitlines()
    compiled = [i for i, line in enumerate(err) if "decoding for a" in line]
    speeds = [i for i, line in enumerate(err) if "tok/s" in line]
    assert len(compiled) == 1 and len(speeds) == 2 and compiled[0] < speeds[0], err
    assert "compiled vanilla decoding for a 128-token cache in" in err[compiled[0]]


def test_engine_compile_for_is_the_program_generate_runs(tiny_hf_dir):
    """`Engine.compile_for` traces and compiles what `generate_ids` then runs (no second trace), once
    per shape and method (None after), and checks the request as `generate_ids` does."""
    from eagle_jax.cpu_jit import TRACE_COUNTS

    engine = Engine(str(tiny_hf_dir), method="eagle3", drafter="random", progress=False, max_cache_len=64)
    ids = engine.encode("w5 w6 w7")
    for method, name in (("eagle3", "speculative"), ("vanilla", "generate")):
        before = TRACE_COUNTS.get(name, 0)
        assert engine.compile_for(ids, 7, cache_len=48, method=method) >= 0
        assert TRACE_COUNTS[name] == before + 1
        assert engine.compile_for(ids, 7, cache_len=48, method=method) is None
        engine.generate_ids(ids, 7, cache_len=48, method=method)
        assert TRACE_COUNTS[name] == before + 1
    assert engine.compile_for(ids, 7, cache_len=56) >= 0  # another shape
    with pytest.raises(ValueError, match="exceeds the cache length 64"):
        engine.compile_for(ids, 70)


@pytest.mark.parametrize("args,msg", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
])
def test_bad_flags_are_rejected_before_loading(args, msg, capsys):
    assert main(["--model", "/nonexistent", "--prompt", "hi", *args]) == 2
    assert msg in capsys.readouterr().err


def test_bad_prompts_file_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": \n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not valid JSON"):
        read_prompts(f)
    f.write_text('{"id": 1, "text": "no prompt field"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: expected an object"):
        read_prompts(f)


def test_unknown_model_is_a_clear_error():
    r = _run("--model", "no-such-model", "--prompt", "hi")
    assert r.returncode == 2 and "error: unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("method", ["eagle1", "eagle2", "eagle3"])
def test_speculative_methods_match_vanilla(tiny_hf_dir, method, capsys):
    base = ["--model", str(tiny_hf_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--method", "vanilla"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--method", method, "--drafter", "oracle"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"]
    assert spec["target_calls"] < plain["target_calls"] and spec["tau"] > 1
    assert sum(spec["accept_lengths"]) >= spec["new_tokens"] and len(spec["accept_lengths"]) == spec["target_calls"]


def test_drafter_directory_and_budget_flags(tiny_hf_dir, tmp_path, capsys):
    import jax

    from eagle_jax.draft import DraftConfig, init_head, save_drafter

    engine = Engine(str(tiny_hf_dir), progress=False)
    head = init_head(DraftConfig.for_target("eagle3", engine.cfg, draft_vocab_size=50), jax.random.PRNGKey(0),
                     d2t=[0] * 50)
    save_drafter(tmp_path / "e3", head, engine.cfg)
    args = ["--model", str(tiny_hf_dir), "--prompt", "w5 w6", "--max-new-tokens", "8", "--json"]
    assert main(args + ["--method", "eagle3", "--drafter", str(tmp_path / "e3"), "--total-tokens", "8",
                        "--depth", "3", "--tree-top-k", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == engine.generate("w5 w6", 8).tokens
    # An EAGLE-3 head cannot serve eagle2, and an impossible budget is refused, both with a message.
    assert main(args + ["--method", "eagle2", "--drafter", str(tmp_path / "e3")]) == 2
    assert "needs an EAGLE-1 head" in capsys.readouterr().err
    assert main(args + ["--method", "eagle2", "--drafter", "random", "--total-tokens", "99", "--depth", "2",
                        "--tree-top-k", "2"]) == 2
    assert "total_tokens must be in [2, 11]" in capsys.readouterr().err
