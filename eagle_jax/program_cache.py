"""Traced decoding programs kept on disk (`jax.export`), so that a new process skips tracing them.

Starting to decode costs a process three things before the first token: tracing the jitted program
(Python running eagle_jax's model code on abstract values: SmolLM2's EAGLE-3 program is about 14k
primitives, 2 s on the 2-core CPU), lowering it to StableHLO (1 s), and compiling that with XLA (26 s
cold; 1.5 s from JAX's persistent compilation cache, `compile_cache.py`). This cache removes the first
two: the first process to run a program serialises it (`jax.export`, a few hundred KB) under
`$EAGLE_JAX_CACHE/programs/`, and later processes deserialise it and call it (0.3 s to embed it in
the calling program), whose XLA compilation then loads from the compilation cache as before.

Every program runs through its serialised form, the first time too (`cached_call` exports, then
calls what it exported), so a program gives the same bits whether this process traced it or read it:
lossless decoding compares the plain and the speculative programs, and both come the same way.

A program's file is named by a hash of everything its trace depends on: the function, its static
arguments (spelled out field by field), the tree structure and abstract values (shape, dtype, weak
type) of the other arguments, the source of every file in the eagle_jax package, the versions of
Python, jax and jaxlib, the JAX settings that change what a trace computes, and the state of the CPU
kernels (which instruction set was built; `kernels/cpu_matmul.py`). A changed file of eagle_jax never
reuses a stale program; only module-level functions of eagle_jax are cached (`cacheable`: the
fingerprint covers their code, not a closure's captured values or another package's code). A static
argument whose `repr` names an address (no stable repr) or a program that cannot be serialised (a
host callback, say) is traced directly, as without the cache, and a warning is logged once per
function; a file that cannot be read back is exported again. A function of eagle_jax replaced at
run time (a test's monkeypatch) is not in the key: the cache must be off while such a patch is on
(tests/conftest.py turns it off for every test that patches).

Files live in one subdirectory per source fingerprint; when a process first uses it, it deletes all
but the `KEEP_VERSIONS` most recently used subdirectories (the programs of older sources, which no
key can reach again). Deleting the whole directory is always safe.

`enable_program_cache` turns it on (`Engine` does, with the compilation cache); only programs built
by `cpu_jit.cpu_stable_jit` on the CPU backend use it. `$EAGLE_JAX_PROGRAM_CACHE` names another
directory, or `off`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jaxlib
from jax import export as jax_export

from .atomic_file import write_atomic

log = logging.getLogger("eagle_jax.program_cache")

FORMAT = 1  # of the files below; part of every key
KEEP_VERSIONS = 4  # source fingerprints whose programs stay on disk
_state: dict = {"dir": None, "warned": set(), "pruned": set()}
_memo: dict[str, tuple] = {}  # key -> (Exported, out tree): this process's programs, read or exported
# JAX settings that change what a trace computes (the others only check or report).
_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
           "jax_numpy_dtype_promotion")


def enable_program_cache(path: Optional[str | os.PathLike] = None) -> Optional[Path]:
    """Keep traced programs in `path`: by default `$EAGLE_JAX_PROGRAM_CACHE` (`off` disables), else
    the eagle_jax cache's `programs/`. Returns the directory in use (None: disabled, or not writable)."""
    if path is None:
        env = os.environ.get("EAGLE_JAX_PROGRAM_CACHE", "").strip()
        if env.lower() in ("off", "0", "none", "false"):
            _state["dir"] = None
            return None
        if env:
            path = env
        else:
            from .models.registry import default_cache_dir

            path = default_cache_dir() / "programs"
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: trace in every process, as JAX does by default
        path = None
    _state["dir"] = path
    return path


def program_cache_dir() -> Optional[Path]:
    """The directory in use, or None when the cache is off."""
    return _state["dir"]


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A hash of the eagle_jax package's source files (Python and the kernels' C++) and of the
    Python, jax and jaxlib versions: any change makes every program's key new."""
    h = hashlib.sha256(f"{sys.version_info[:2]} {jax.__version__} {jaxlib.__version__}".encode())
    root = Path(__file__).resolve().parent
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".cc", ".h") and p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _environment() -> str:
    """What else a trace depends on, read at every key: JAX's settings and the CPU kernels' state,
    loaded first (before stop 68 a process's first key was taken before anything had loaded the
    kernels, and a later trace of the same program got another key: a second file, and a miss)."""
    from .kernels import cpu_matmul

    cpu_matmul.available()
    kernels = {k: v for k, v in cpu_matmul._state.items() if k in ("ok", "isa", "b16", "i8", "qx")}
    return repr(([(name, getattr(jax.config, name, None)) for name in _CONFIG], sorted(kernels.items())))


def cacheable(fn: Callable) -> bool:
    """Whether `fn`'s program may be cached: a module-level function of the eagle_jax package, whose
    code the source fingerprint covers (a closure's captured values, or another package's code,
    would not be in the key)."""
    return (getattr(fn, "__module__", "") or "").startswith("eagle_jax.") and "<" not in fn.__qualname__


def _spelled(value):
    """A static argument spelled out field by field (dataclasses: each field, not their `repr`, which
    may abbreviate, as `StaticTree`'s does), for its `repr` to name it exactly."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return (type(value).__qualname__, [(f.name, _spelled(getattr(value, f.name))) for f in fields])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_spelled(v) for v in value])
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), _spelled(v)) for k, v in value.items()))
    return value


def program_key(fn: Callable, static: dict, in_tree, avals) -> Optional[str]:
    """The hash that names `fn`'s program for these static arguments and argument types, or None
    when a static argument has no stable `repr`."""
    statics = repr(sorted((k, _spelled(v)) for k, v in static.items()))
    text = "\n".join([f"eagle_jax program cache {FORMAT}", f"{fn.__module__}.{fn.__qualname__}", statics,
                      str(in_tree), repr([(a.shape, str(a.dtype), a.weak_type) for a in avals]),
                      source_fingerprint(), _environment()])
    if " at 0x" in statics or " at 0x" in str(in_tree):
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _custom_calls() -> list:
    """The eagle_jax CPU kernels' custom calls, which `jax.export` must be told to allow."""
    from .kernels import cpu_matmul

    return [jax_export.DisabledSafetyCheck.custom_call(name) for name in cpu_matmul._TARGETS.values()]


def _version_dir(directory: Path) -> Path:
    """`directory`'s subdirectory for this source, marked as just used; the first time in this
    process, the subdirectories of all but the `KEEP_VERSIONS` most recently used sources go."""
    sub = directory / source_fingerprint()[:16]
    if sub not in _state["pruned"]:
        _state["pruned"].add(sub)
        sub.mkdir(parents=True, exist_ok=True)
        os.utime(sub)
        others = sorted((p for p in directory.iterdir() if p.is_dir() and p != sub),
                        key=lambda p: p.stat().st_mtime, reverse=True)
        for old in others[KEEP_VERSIONS - 1:]:
            shutil.rmtree(old, ignore_errors=True)
    return sub


def _read(path: Path):
    with open(path, "rb") as f:
        entry = pickle.load(f)
    if entry.get("format") != FORMAT:
        raise ValueError(f"format {entry.get('format')!r}")
    return jax_export.deserialize(bytearray(entry["exported"])), entry["out_tree"]


def _write(path: Path, exported, out_tree) -> None:
    write_atomic(path, pickle.dumps({"format": FORMAT, "out_tree": out_tree, "exported": bytes(exported.serialize())}))


def _export(fn: Callable, static: dict, names: tuple[str, ...], in_tree, avals):
    """Trace and serialise `fn` on abstract arguments of these types: (Exported, out tree)."""
    trees = []

    def flat(*leaves):
        args = dict(zip(names, jax.tree.unflatten(in_tree, leaves)))
        out_leaves, out_tree = jax.tree.flatten(fn(**args, **static))
        trees.append(out_tree)
        return out_leaves

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    exported = jax_export.export(jax.jit(flat), platforms=("cpu",), disabled_checks=_custom_calls())(*specs)
    return exported, trees[-1]


class NotCached(Exception):
    """`cached_call` could not run the program from the cache: trace `fn` directly, then `warn()`."""

    def __init__(self, fn: Callable, why: Optional[str] = None):
        super().__init__(why)
        self.fn, self.why = fn, why

    def warn(self) -> None:
        """Log once per function why it was traced directly (nothing when the cache is off); called
        after the direct trace succeeded, so an error in the program itself is reported alone."""
        name = f"{self.fn.__module__}.{self.fn.__qualname__}"
        if self.why and name not in _state["warned"]:
            _state["warned"].add(name)
            log.warning("program cache: tracing %s directly (%s)", name, self.why[:300])


def _read_or_export(fn: Callable, static: dict, names: tuple[str, ...], in_tree, avals, directory: Path,
                    key: str):
    """(Exported, out tree) of `fn`'s program: read from its file, else exported now and written
    there. Raises `NotCached` when the directory is unusable or the program cannot be exported."""
    try:
        path = _version_dir(directory) / f"{fn.__name__}-{key}.jaxexport"
    except OSError as e:
        raise NotCached(fn, f"{directory}: {e}") from e
    if path.exists():
        try:
            return _read(path)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: export it again
            log.info("program cache: rewriting %s (%s)", path.name, e)
    try:
        entry = _export(fn, static, names, in_tree, avals)
    except Exception as e:  # noqa: BLE001 - not exportable: trace directly (that raises real errors)
        raise NotCached(fn, f"{type(e).__name__}: {e}") from e
    try:
        _write(path, *entry)
    except Exception as e:  # noqa: BLE001 - an unwritable directory or unpicklable tree costs time only
        NotCached(fn, f"not written: {type(e).__name__}: {e}").warn()
    return entry


def cached_call(fn: Callable, static: dict, dynamic: dict[str, Any]):
    """Inside a trace: `fn(**dynamic, **static)` through its serialised program (read from the cache
    directory, or exported now and written there). Raises `NotCached` when that cannot be done (the
    cache is off, the program cannot be exported): then trace `fn` directly. `dynamic` holds the
    traced arguments, by name."""
    directory = _state["dir"]
    if directory is None or not cacheable(fn):
        raise NotCached(fn)
    names = tuple(dynamic)
    leaves, in_tree = jax.tree.flatten(tuple(dynamic.values()))
    avals = [jax.typeof(x) for x in leaves]
    key = program_key(fn, static, in_tree, avals)
    if key is None:
        raise NotCached(fn, "a static argument has no stable repr")
    entry = _memo.get(key)
    if entry is None:
        _memo[key] = entry = _read_or_export(fn, static, names, in_tree, avals, directory, key)
    exported, out_tree = entry
    return jax.tree.unflatten(out_tree, exported.call(*leaves))
