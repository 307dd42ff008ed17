"""Writing a file whole: the one way eagle_jax replaces its records, caches and indexes.

`write_atomic(path, data)` writes into a temporary file beside `path`, named for this process and
thread (two writers never share one), then renames it over `path`. A reader, in this process or
another, sees the old file or the new one, never part of either, and a failed or interrupted
write leaves `path` as it was. The temporary file goes in every case. Errors (`OSError`) reach
the caller, which decides what a failed write means: the tuned-budget file and the training
data's index must exist, a cache entry that could not be written only costs the next start time.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str, encoding: str = "utf-8") -> Path:
    """Replace `path` with `data` (bytes, or text in `encoding`) whole (module doc); returns `path`."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode(encoding) if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
