"""The persistent compilation cache (eagle_jax.compile_cache): where it goes, that a chosen
directory is kept, and that a second process reuses what the first compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys, time
import jax, jax.numpy as jnp
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
hits = []
jax.monitoring.register_event_listener(lambda e, **kw: hits.append(e) if e.endswith("cache_hits") else None)
from eagle_jax.compile_cache import enable_compile_cache
path = enable_compile_cache()
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0)
f(jnp.ones((16, 8))).block_until_ready()
print(json.dumps({"path": str(path), "config": jax.config.jax_compilation_cache_dir, "hits": len(hits),
                  "max_size": jax.config.jax_compilation_cache_max_size}))
"""


def _run(env_extra: dict, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items()  # not the test run's own cache (conftest.py)
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_COMPILATION_CACHE_MAX_SIZE")}
    env.update(env_extra, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_default_directory_under_the_eagle_jax_cache(tmp_path):
    home = tmp_path / "ej"
    got = _run({"EAGLE_JAX_CACHE": str(home)}, tmp_path)
    assert got["path"] == got["config"] == str(home / "xla")
    entries = sorted(p.name for p in (home / "xla").iterdir())
    assert entries and got["hits"] == 0, "the compiled program was not written to the cache"
    again = _run({"EAGLE_JAX_CACHE": str(home)}, tmp_path)  # a second process loads it, compiles nothing
    assert again["path"] == str(home / "xla") and again["hits"] >= 1
    assert sorted(p.name for p in (home / "xla").iterdir()) == entries


def test_a_directory_chosen_for_jax_is_kept(tmp_path):
    mine = tmp_path / "mine"
    got = _run({"EAGLE_JAX_CACHE": str(tmp_path / "ej"), "JAX_COMPILATION_CACHE_DIR": str(mine)}, tmp_path)
    assert got["path"] == got["config"] == str(mine)
    assert not (tmp_path / "ej").exists()
    assert any(mine.iterdir())


def _legacy_entry(directory, size: int):
    """An entry as an uncapped JAX cache writes it: the data, and no access-time file."""
    directory.mkdir(parents=True, exist_ok=True)
    entry = directory / "legacy-cache"
    entry.write_bytes(os.urandom(size))
    return entry


def test_the_default_directory_is_capped_and_older_entries_get_access_times(tmp_path):
    from eagle_jax.compile_cache import DEFAULT_MAX_BYTES

    home = tmp_path / "ej"
    entry = _legacy_entry(home / "xla", 1000)
    got = _run({"EAGLE_JAX_CACHE": str(home)}, tmp_path)
    assert got["max_size"] == DEFAULT_MAX_BYTES
    stamp = home / "xla" / "legacy-atime"
    assert stamp.exists(), "an entry written without a cap got no access time: JAX's eviction would fail on it"
    assert int.from_bytes(stamp.read_bytes(), "little") == entry.stat().st_mtime_ns
    assert entry.exists(), "nothing should be evicted under the default cap"


def test_a_cap_evicts_entries_written_without_one(tmp_path):
    """Over the cap, the oldest entry goes, even one written before there was a cap; the new
    program is written (without the access time JAX's eviction raises and caches nothing)."""
    home = tmp_path / "ej"
    entry = _legacy_entry(home / "xla", 400_000)
    got = _run({"EAGLE_JAX_CACHE": str(home), "JAX_COMPILATION_CACHE_MAX_SIZE": "300000"}, tmp_path)
    assert got["max_size"] == 300_000 and got["hits"] == 0
    assert not entry.exists(), "the least recently used entry was not evicted"
    assert [p for p in (home / "xla").iterdir() if p.name.endswith("-cache")], "the new program was not cached"


def test_no_cap_when_the_user_says_so(tmp_path):
    home = tmp_path / "ej"
    entry = _legacy_entry(home / "xla", 1000)
    got = _run({"EAGLE_JAX_CACHE": str(home), "JAX_COMPILATION_CACHE_MAX_SIZE": "-1"}, tmp_path)
    assert got["max_size"] == -1 and entry.exists()
    assert not (home / "xla" / "legacy-atime").exists()
