"""write_atomic (eagle_jax.atomic_file): a file is replaced whole or not at all."""

from __future__ import annotations

import os
import threading

import pytest

from eagle_jax import atomic_file
from eagle_jax.atomic_file import write_atomic


def test_replaces_text_and_bytes_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "record.json"
    assert write_atomic(path, "première") == path
    assert path.read_text(encoding="utf-8") == "première"
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    path.write_text("old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_file.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["record.json"]
    with pytest.raises(TypeError):  # not bytes or str: nothing written, nothing left behind
        write_atomic(path, 3)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_writers_in_threads_never_mix_their_files(tmp_path):
    """Each writer has its own temporary file, so the result is one writer's data, whole."""
    path = tmp_path / "shared.bin"
    blobs = [bytes([i]) * 200_000 for i in range(8)]
    seen, errors = [], []

    def writer(blob):
        try:
            for _ in range(5):
                write_atomic(path, blob)
                seen.append(path.read_bytes())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(s in blobs for s in seen) and path.read_bytes() in blobs
    assert os.listdir(tmp_path) == ["shared.bin"]
