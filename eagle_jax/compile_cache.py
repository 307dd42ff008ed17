"""A persistent XLA compilation cache for eagle_jax's programs, bounded in size.

Compiling SmolLM2's decoding programs takes 5–15 s each on a CPU (the unrolled layer layout that
decodes fastest there compiles slowest); JAX can keep compiled executables on disk and reload
them in a later process. `enable_compile_cache` turns that on at `$EAGLE_JAX_CACHE/xla`
(default `~/.cache/eagle_jax/xla`) unless the user already chose a directory (JAX's
`jax_compilation_cache_dir`, or the `JAX_COMPILATION_CACHE_DIR` variable), which is then kept
as it is. `Engine` calls it (`compile_cache=False` opts out), so the CLI, the server and the
benchmark compile each program once per machine, not once per process.

Every new eagle_jax version, cache size and tree budget compiles new programs (about 2 MB each
for SmolLM2, compressed), and nothing would ever remove the old ones. So the directory eagle_jax
chooses is capped at `DEFAULT_MAX_BYTES`, least recently used out first (JAX's own eviction,
`jax_compilation_cache_max_size`), unless a cap is set already (`JAX_COMPILATION_CACHE_MAX_SIZE`,
where -1 means none). JAX's eviction reads an access-time file beside every entry, which it writes
only while a cap is on; entries written without one (eagle_jax before the cap, or a run with
`JAX_COMPILATION_CACHE_MAX_SIZE=-1`) would make it fail (it then warns and caches nothing more), so
those get one, dated from the entry's modification time.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Optional

import jax

log = logging.getLogger("eagle_jax.compile_cache")

DEFAULT_MAX_BYTES = 2 << 30  # 2 GiB: hundreds of SmolLM2 programs
_CACHE_SUFFIX, _ATIME_SUFFIX = "-cache", "-atime"  # JAX's names (jax/_src/lru_cache.py)


def enable_compile_cache(path: Optional[str | Path] = None) -> Optional[Path]:
    """Use `path` (default: the eagle_jax cache's `xla/`) as JAX's persistent compilation cache,
    capped as the module doc says, unless a directory is already configured. Returns the directory
    in use (None: disabled)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if path is None:
        from .models.registry import default_cache_dir

        path = default_cache_dir() / "xla"
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: compile in memory only, as JAX does by default
        return None
    if (jax.config.jax_compilation_cache_max_size == -1 and "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ
            and _have_filelock()):
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)
    if jax.config.jax_compilation_cache_max_size != -1:
        stamp_access_times(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path


def stamp_access_times(path: Path) -> int:
    """Give every entry of the cache directory `path` that has no access-time file one (its
    modification time), so that JAX's size-capped eviction can rank it. Returns how many it wrote."""
    written = 0
    try:
        names = set(os.listdir(path))  # one listing, not a lookup per entry: this runs at every start
    except OSError:
        return 0
    for name in names:
        stamp = name[: -len(_CACHE_SUFFIX)] + _ATIME_SUFFIX
        if not name.endswith(_CACHE_SUFFIX) or stamp in names:
            continue
        try:
            (path / stamp).write_bytes((path / name).stat().st_mtime_ns.to_bytes(8, "little"))
            written += 1
        except OSError as e:  # removed meanwhile by another process's eviction, or read-only
            log.debug("no access time for %s: %s", name, e)
    return written


def _have_filelock() -> bool:
    """JAX's capped cache locks its directory with `filelock` (a dependency of eagle_jax's); without
    it JAX would refuse the cap and cache nothing, so the cache then stays uncapped, as before."""
    if importlib.util.find_spec("filelock") is None:
        log.warning("the filelock package is missing: the compilation cache is not capped in size")
        return False
    return True
