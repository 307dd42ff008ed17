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
