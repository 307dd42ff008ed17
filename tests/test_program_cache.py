"""The traced-program cache (eagle_jax/program_cache.py): programs read back from disk give the same
bits as traced ones, skip tracing, are keyed by everything a trace depends on, and fall back to a
direct trace whenever they cannot be used."""

import logging
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import decoding, program_cache, speculative
from eagle_jax.cpu_jit import TRACE_COUNTS, cpu_stable_jit
from eagle_jax.decoding import generate_tokens
from eagle_jax.draft import DraftConfig, TreeBudget, init_head
from eagle_jax.kernels import cpu_matmul
from eagle_jax.sampling import SamplingParams
from eagle_jax.speculative import speculative_generate
from eagle_jax.tree import StaticTree
from test_speculative import _run

BUDGET = TreeBudget("dynamic", total_tokens=6, depth=3, top_k=2)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty cache directory, in use for this test only (the jitted programs retrace around it)."""
    monkeypatch.setitem(program_cache._state, "dir", tmp_path)
    monkeypatch.setitem(program_cache._state, "pruned", set())
    monkeypatch.setitem(program_cache._state, "warned", set())
    monkeypatch.setattr(program_cache, "_memo", {})
    _forget()
    yield tmp_path
    _forget()


def _forget():
    """Drop this process's traced programs (jit caches and the cache's memo), as a new process starts."""
    generate_tokens.clear_cache()
    speculative_generate.clear_cache()
    program_cache._memo.clear()


def _files(directory):
    return sorted(p.name for p in directory.rglob("*.jaxexport"))


def _decode_both(cfg, params, head, temperature):
    """Plain and speculative decoding of the same prompts; every output array, as numpy."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sp = SamplingParams.create(2, temperature, 0.9, 0)
    plain, _ = _run(generate_tokens, params, cfg, prompts, 12, sp=sp, seed=3)
    spec, _ = _run(speculative_generate, params, cfg, prompts, 12, sp=sp, seed=3, head=head, budget=BUDGET)
    return [np.asarray(a) for a in jax.tree.leaves((plain, spec))]


def _configs(tiny_llama):
    _, cfg, params = tiny_llama
    out = [cfg]
    if cpu_matmul.available():  # the CPU kernels' custom calls in the serialised program too
        out.append(cfg.replace(matmul_impl="cpu_kernel"))
    return out, params


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cached_programs_give_the_bits_of_traced_ones_and_skip_tracing(tiny_llama, cache_dir, monkeypatch,
                                                                        temperature):
    configs, params = _configs(tiny_llama)
    for cfg in configs:
        head = init_head(DraftConfig.for_target("eagle3", cfg, draft_vocab_size=60), jax.random.PRNGKey(2),
                         d2t=np.zeros(60, np.int32))
        monkeypatch.setitem(program_cache._state, "dir", None)
        _forget()
        traced = _decode_both(cfg, params, head, temperature)  # the cache off: traced directly
        monkeypatch.setitem(program_cache._state, "dir", cache_dir)
        _forget()
        before = set(_files(cache_dir))
        exported = _decode_both(cfg, params, head, temperature)  # exported, written, run from the export
        written = set(_files(cache_dir)) - before
        assert len(written) == 2 and {n.split("-")[0] for n in written} == {"generate_tokens",
                                                                            "speculative_generate"}
        _forget()

        bodies = []  # the programs' bodies traced (the plain and the speculative prefill)

        def spy(real):
            return lambda *a, **k: bodies.append(1) or real(*a, **k)

        with monkeypatch.context() as m:
            m.setattr(decoding, "_start", spy(decoding._start))
            m.setattr(speculative, "_start", spy(speculative._start))
            counts = dict(TRACE_COUNTS)
            read = _decode_both(cfg, params, head, temperature)  # read back, as a new process would
        assert bodies == []  # not traced, not exported again
        assert TRACE_COUNTS["generate"] == counts["generate"] + 1  # the wrapper traced, not the body
        for a, b, c in zip(traced, exported, read):
            assert np.array_equal(a, b) and np.array_equal(a, c)


def test_the_key_changes_with_what_a_trace_depends_on(monkeypatch):
    fn = generate_tokens.__wrapped__
    tree = jax.tree.structure((1, 2))
    f32 = [jax.ShapeDtypeStruct((2, 8), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32, weak_type=True)]

    def key(static=None, avals=f32, tree=tree, f=fn):
        return program_cache.program_key(f, static or {"cfg": 1}, tree, avals)

    base = key()
    assert key() == base
    # two static trees of the same size, depth and width: StaticTree's repr cannot tell them apart
    a, b = StaticTree(((0,), (1,), (0, 0))), StaticTree(((0,), (1,), (1, 0)))
    assert repr(a) == repr(b)
    assert key({"budget": TreeBudget("static", static_tree=a)}) != key({"budget": TreeBudget("static", static_tree=b)})
    assert key({"cfg": 2}) != base
    assert key(avals=[jax.ShapeDtypeStruct((2, 9), jnp.float32), f32[1]]) != base  # a shape
    assert key(avals=[jax.ShapeDtypeStruct((2, 8), jnp.bfloat16), f32[1]]) != base  # a dtype
    assert key(avals=[f32[0], jax.ShapeDtypeStruct((), jnp.int32)]) != base  # a weak type
    assert key(tree=jax.tree.structure([1, 2])) != base
    assert key(f=speculative_generate.__wrapped__) != base
    monkeypatch.setitem(cpu_matmul._state, "isa", "another")  # the kernels' state
    assert key() != base
    monkeypatch.undo()
    program_cache.source_fingerprint.cache_clear()
    monkeypatch.setattr(program_cache, "source_fingerprint", lambda: "another source")
    assert key() != base
    monkeypatch.undo()
    assert key() == base
    assert key({"cfg": object()}) is None  # no stable repr: not cached


def test_only_module_level_eagle_jax_functions_are_cached():
    assert program_cache.cacheable(generate_tokens.__wrapped__)
    assert program_cache.cacheable(speculative_generate.__wrapped__)
    assert not program_cache.cacheable(lambda x: x)

    def local(x):
        return x

    assert not program_cache.cacheable(local)
    assert not program_cache.cacheable(np.add)  # another package's code: not in the fingerprint


def test_a_damaged_file_is_exported_again(tiny_llama, cache_dir):
    _, cfg, params = tiny_llama
    want, lens = _run(generate_tokens, params, cfg, [[5, 6, 7]], 6)
    (path,) = list(cache_dir.rglob("*.jaxexport"))
    path.write_bytes(path.read_bytes()[:100])  # truncated
    _forget()
    got, _ = _run(generate_tokens, params, cfg, [[5, 6, 7]], 6)
    assert np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    program_cache._read(path)  # rewritten whole


def _boom_module_fn(x, n):
    if n < 0:
        raise ValueError("n must be >= 0")
    return jax.pure_callback(lambda v: np.asarray(v) * n, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


_boom_module_fn.__module__ = "eagle_jax.fake"  # counted as eagle_jax's code: the cache takes it


def test_a_program_that_cannot_be_exported_is_traced_directly_with_one_warning(cache_dir, caplog):
    """A host callback cannot be serialised: the program is traced as without the cache (same result),
    with one warning for the function; an error in the program itself is raised with no warning."""
    f = cpu_stable_jit(_boom_module_fn, static_argnames=("n",))
    with caplog.at_level(logging.WARNING, logger="eagle_jax.program_cache"):
        with pytest.raises(ValueError, match="n must be >= 0"):
            f(jnp.ones(5), n=-1)
        assert not caplog.records
        assert np.asarray(f(jnp.ones(3), n=2)).tolist() == [2.0, 2.0, 2.0]
        assert np.asarray(f(jnp.ones(4), n=3)).tolist() == [3.0] * 4
    warnings = [r for r in caplog.records if "tracing eagle_jax.fake._boom_module_fn directly" in r.getMessage()]
    assert len(warnings) == 1, caplog.records
    assert _files(cache_dir) == []


def test_programs_of_old_sources_are_pruned(cache_dir):
    now = time.time()
    for i in range(6):  # six older sources, the newest first
        d = cache_dir / f"old{i}"
        d.mkdir()
        (d / "x.jaxexport").write_bytes(b"")
        os.utime(d, (now - 100 * (i + 1), now - 100 * (i + 1)))
    current = program_cache._version_dir(cache_dir)
    kept = sorted(p.name for p in cache_dir.iterdir())
    assert kept == sorted([current.name] + [f"old{i}" for i in range(program_cache.KEEP_VERSIONS - 1)])


def test_the_cache_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.setitem(program_cache._state, "dir", program_cache._state["dir"])
    monkeypatch.setenv("EAGLE_JAX_PROGRAM_CACHE", "off")
    assert program_cache.enable_program_cache() is None and program_cache.program_cache_dir() is None
    monkeypatch.setenv("EAGLE_JAX_PROGRAM_CACHE", str(tmp_path / "p"))
    assert program_cache.enable_program_cache() == tmp_path / "p" and (tmp_path / "p").is_dir()


def test_a_programs_key_does_not_depend_on_whether_the_kernels_were_loaded_yet():
    """A fresh process's first key used to be taken before anything had loaded the CPU kernels, and
    the same program's key after that differed (a second file, a miss): the key loads them first."""
    code = ("import jax, sys; from eagle_jax import program_cache; from eagle_jax.decoding import generate_tokens; "
            "from eagle_jax.kernels import cpu_matmul; "
            "key = lambda: program_cache.program_key(generate_tokens, {}, jax.tree.structure(()), []); "
            "loaded = 'ok' in cpu_matmul._state; first = key(); cpu_matmul.available(); "
            "print(loaded, first == key())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
