"""A persistent XLA compilation cache for eagle_jax's programs.

Compiling SmolLM2's decoding programs takes 5–15 s each on a CPU (the unrolled layer layout that
decodes fastest there compiles slowest); JAX can keep compiled executables on disk and reload
them in a later process. `enable_compile_cache` turns that on at `$EAGLE_JAX_CACHE/xla`
(default `~/.cache/eagle_jax/xla`) unless the user already chose a directory (JAX's
`jax_compilation_cache_dir`, or the `JAX_COMPILATION_CACHE_DIR` variable), which is then kept.
`Engine` calls it (`compile_cache=False` opts out), so the CLI, the server and the benchmark
compile each program once per machine, not once per process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import jax


def enable_compile_cache(path: Optional[str | Path] = None) -> Optional[Path]:
    """Use `path` (default: the eagle_jax cache's `xla/`) as JAX's persistent compilation cache,
    unless a directory is already configured. Returns the directory in use (None: disabled)."""
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
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
