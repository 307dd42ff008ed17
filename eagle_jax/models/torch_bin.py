"""Reading `torch.save`d state dicts (`pytorch_model.bin` and its shards) without torch.

A restricted unpickler rebuilds the tensors as numpy arrays straight from the zip archive's storage
records; any global outside a tensor-only allow-list (state-dict containers, tensor rebuild helpers,
storage classes, dtypes) raises `UnsafeCheckpointError`, so a checkpoint cannot run code. Used by
`models.checkpoint` (targets shipped only as `.bin`, e.g. lmsys/vicuna-7b-v1.3) and
`draft.checkpoint` (released EAGLE heads).
"""

from __future__ import annotations

import collections
import io
import json
import pickle
import zipfile
from pathlib import Path
from typing import Callable, Mapping

import ml_dtypes
import numpy as np

from .checkpoint import CheckpointError

__all__ = ["load_torch_state_dict", "read_torch_bin_dir", "UnsafeCheckpointError"]


class UnsafeCheckpointError(CheckpointError):
    """A pickled checkpoint references a global outside the tensor-only allow-list."""


_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    "UntypedStorage": np.uint8,
}
_TORCH_DTYPES = {
    "float32": np.float32, "float": np.float32, "float64": np.float64, "double": np.float64,
    "float16": np.float16, "half": np.float16, "bfloat16": ml_dtypes.bfloat16, "int64": np.int64,
    "long": np.int64, "int32": np.int32, "int": np.int32, "int16": np.int16, "short": np.int16,
    "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
}


class _StorageKind:
    """Stand-in for a torch storage class (or dtype) named in the pickle: only its element type."""

    def __init__(self, name: str, dtype):
        self.name, self.dtype = name, np.dtype(dtype)


class _Storage:
    """One storage record of the archive as a flat numpy array."""

    def __init__(self, array: np.ndarray):
        self.array = array


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise UnsafeCheckpointError("torch checkpoint rebuilds a tensor from something that is not a storage record")
    try:
        offset, size, stride = int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"malformed tensor record in torch checkpoint: {e}") from None
    arr = storage.array
    if len(size) != len(stride) or offset < 0 or any(s < 0 for s in size) or any(s < 0 for s in stride):
        raise CheckpointError(f"malformed tensor record (offset {offset}, size {size}, stride {stride})")
    if 0 in size:
        return np.zeros(size, arr.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= arr.size:
        raise CheckpointError(f"tensor record (offset {offset}, size {size}, stride {stride}) reads past its "
                              f"storage of {arr.size} elements")
    view = np.lib.stride_tricks.as_strided(arr[offset:], shape=size,
                                           strides=tuple(s * arr.itemsize for s in stride), writeable=False)
    return np.array(view)  # own the memory (the storage may be shared by several tensors)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


class _TensorUnpickler(pickle.Unpickler):
    """Rebuilds a torch state dict as numpy arrays; any global outside the allow-list is refused."""

    def __init__(self, data: bytes, read_record: Callable[[str], bytes], big_endian: bool, source: str):
        super().__init__(io.BytesIO(data))
        self._read_record = read_record
        self._big_endian = big_endian
        self._source = source
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module in ("torch", "torch.storage") and name in _STORAGE_DTYPES:
            return _StorageKind(name, _STORAGE_DTYPES[name])
        if module == "torch" and name in _TORCH_DTYPES:
            return _StorageKind(name, _TORCH_DTYPES[name])
        if (module, name) == ("torch", "Size"):
            return tuple
        raise UnsafeCheckpointError(
            f"{self._source}: refusing to load global {module}.{name}: only tensors and state-dict containers "
            f"are allowed in a checkpoint (convert it to safetensors if it is trusted)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise UnsafeCheckpointError(f"{self._source}: unsupported persistent record {pid!r:.80}")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageKind):
            raise UnsafeCheckpointError(f"{self._source}: persistent record with storage type {kind!r:.80}")
        key = key.decode() if isinstance(key, bytes) else str(key)
        if key not in self._storages:
            raw = self._read_record(f"data/{key}")
            dt = kind.dtype.newbyteorder(">") if self._big_endian and kind.dtype.itemsize > 1 else kind.dtype
            n = int(numel)
            if n * dt.itemsize > len(raw):
                raise CheckpointError(f"{self._source}: storage {key} holds {len(raw)} bytes, "
                                      f"expected {n} × {dt.itemsize}")
            arr = np.frombuffer(raw, dtype=dt, count=n)
            self._storages[key] = _Storage(arr.astype(kind.dtype) if dt != kind.dtype else arr)
        return self._storages[key]


def load_torch_state_dict(file) -> dict[str, np.ndarray]:
    """Read a `torch.save`d state dict (zip format) as numpy arrays, without importing torch.

    Only `collections.OrderedDict`, `torch._utils._rebuild_tensor_v2` / `_rebuild_parameter`, storage
    classes and dtypes may appear in the pickle; anything else raises `UnsafeCheckpointError`.
    """
    file = Path(file)
    if not zipfile.is_zipfile(file):
        raise CheckpointError(f"{file} is a legacy (pre-zip) torch checkpoint, which eagle_jax does not unpickle; "
                              f"re-save it with torch.save (torch>=1.6) or convert it to safetensors")
    with zipfile.ZipFile(file) as z:
        pkls = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pkls) != 1:
            raise CheckpointError(f"{file}: expected one data.pkl in the torch archive, found {len(pkls)}")
        prefix = pkls[0][: -len("data.pkl")]
        names = set(z.namelist())
        big = prefix + "byteorder" in names and z.read(prefix + "byteorder").strip() == b"big"

        def read_record(rel: str) -> bytes:
            if prefix + rel not in names:
                raise CheckpointError(f"{file}: torch archive lacks record {prefix + rel!r}")
            return z.read(prefix + rel)

        try:
            obj = _TensorUnpickler(z.read(pkls[0]), read_record, big, str(file)).load()
        except CheckpointError:
            raise
        except Exception as e:  # truncated / corrupt pickle
            raise CheckpointError(f"{file}: cannot read torch checkpoint: {type(e).__name__}: {e}") from None
    if not isinstance(obj, Mapping) or not all(isinstance(k, str) and isinstance(v, np.ndarray)
                                               for k, v in obj.items()):
        raise CheckpointError(f"{file}: expected a state dict of named tensors, got {type(obj).__name__}")
    return dict(obj)


def read_torch_bin_dir(path):
    """(names, get) over a HF directory's `pytorch_model.bin` or sharded `pytorch_model.bin.index.json`
    files, or None when it has neither. Every shard is read up front (a pickle is not lazy)."""
    path = Path(path)
    if (path / "pytorch_model.bin").exists():
        sd = load_torch_state_dict(path / "pytorch_model.bin")
        return list(sd), sd.__getitem__
    index = path / "pytorch_model.bin.index.json"
    if not index.exists():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: malformed shard index ({type(e).__name__}: {e})") from None
    sd = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).exists():
            raise CheckpointError(f"torch shard {shard!r} listed in {index.name} is missing from {path}")
        sd.update(load_torch_state_dict(path / shard))
    absent = sorted(k for k in weight_map if k not in sd)
    if absent:
        raise CheckpointError(f"tensor {absent[0]!r} listed in {index.name} is in none of its shards ({path})")
    return list(sd), sd.__getitem__
