"""The fast GGUF header reader (eagle_jax.models.gguf_index): the same metadata and tensors as
gguf's own `GGUFReader` on files gguf's writer wrote, and a fallback to `GGUFReader` for files it
does not read. Loading through it (GGUFModel) is covered end to end by test_gguf.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf_util import MIXED_TYPES, gguf, tiny_config, write_tiny_gguf  # noqa: E402

from eagle_jax.models.gguf_index import GGUFIndex, UnsupportedGGUF  # noqa: E402
from eagle_jax.models.gguf_loader import GGUFError, GGUFModel  # noqa: E402

VT = gguf.GGUFValueType


def _every_value_type(w):
    """Metadata of every scalar type, strings (empty, non-ASCII) and flat arrays of each."""
    for i, (vtype, value) in enumerate([
            (VT.UINT8, 200), (VT.INT8, -100), (VT.UINT16, 60000), (VT.INT16, -30000), (VT.UINT32, 4_000_000_000),
            (VT.INT32, -2_000_000_000), (VT.FLOAT32, 0.1), (VT.BOOL, True), (VT.UINT64, 2**63 + 5),
            (VT.INT64, -(2**62)), (VT.FLOAT64, 1e-300), (VT.STRING, ""), (VT.STRING, "héllo ✓")]):
        w.add_key_value(f"test.scalar.{i}", value, vtype)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.strings", ["a", "", "ünï", "x" * 300])
    w.add_array("test.empty", [])


def _assert_same(index: GGUFIndex, reader) -> None:
    assert list(index.fields) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key, field in index.fields.items():
        want = reader.fields[key].contents()
        got = field.contents()
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
            assert field.count == len(reader.fields[key].data), key
    assert index.data_offset == reader.data_offset
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(index.tensors, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        np.testing.assert_array_equal(mine.shape, theirs.shape, err_msg=mine.name)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        np.testing.assert_array_equal(mine.data, theirs.data, err_msg=mine.name)


@pytest.mark.parametrize("alignment", [None, 64])
def test_index_reads_what_gguf_reader_reads(tmp_path, alignment):
    path = tmp_path / "mixed.gguf"

    def metadata(w):
        _every_value_type(w)
        if alignment:
            w.add_custom_alignment(alignment)

    cfg = tiny_config("llama")
    write_tiny_gguf(path, cfg, MIXED_TYPES, metadata=metadata,
                    extra_tensors={"extra.i32": (np.arange(12, dtype=np.int32).reshape(3, 4), None),
                                   "extra.f16": (np.linspace(-1, 1, 64, dtype=np.float16).reshape(2, 32), None)})
    reader = gguf.GGUFReader(str(path))
    index = GGUFIndex(path)
    assert index.alignment == (alignment or 32)
    _assert_same(index, reader)
    assert {t.tensor_type.name for t in index.tensors} >= set(MIXED_TYPES.values()) | {"F32", "I32", "F16"}
    # and the loader built on it reads such a file (without the extra tensors, which have no HF names):
    # the config from the metadata, the vocabulary size from the token list's length (counted, not decoded)
    write_tiny_gguf(path, cfg, MIXED_TYPES, metadata=metadata)
    model = GGUFModel(path)
    assert model._reader.__class__ is GGUFIndex
    assert model.hf_config["vocab_size"] == cfg.vocab_size
    assert model.hf_config["num_hidden_layers"] == cfg.num_layers


def test_files_the_index_does_not_read_go_to_gguf_reader(tmp_path):
    cfg = tiny_config("llama")
    nested = tmp_path / "nested.gguf"  # an array of arrays: GGUFReader's business
    write_tiny_gguf(nested, cfg, metadata=lambda w: w.add_array("test.nested", [[1, 2], [3]]))
    with pytest.raises(UnsupportedGGUF, match="array of value type"):
        GGUFIndex(nested)
    model = GGUFModel(nested)
    assert isinstance(model._reader, gguf.GGUFReader)
    plain = tmp_path / "plain.gguf"
    write_tiny_gguf(plain, cfg)
    assert model.hf_config == GGUFModel(plain).hf_config

    # truncated files: the index gives up at once (however large the counts it read), and the loader
    # reports the file as unreadable through GGUFReader's error
    raw = plain.read_bytes()
    for n in (0, 10, 40, 2000):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(raw[:n])
        with pytest.raises(UnsupportedGGUF):
            GGUFIndex(cut)
        with pytest.raises(GGUFError, match="not a readable GGUF file"):
            GGUFModel(cut)
    huge = bytearray(raw)
    start = raw.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4  # type, item type
    huge[start:start + 8] = (2**62).to_bytes(8, "little")  # the token list's count
    (tmp_path / "huge.gguf").write_bytes(bytes(huge))
    with pytest.raises(UnsupportedGGUF, match="cannot fit"):
        GGUFIndex(tmp_path / "huge.gguf")
