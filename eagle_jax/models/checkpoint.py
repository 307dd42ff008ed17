"""Hugging Face checkpoints ↔ eagle_jax params.

A HF state dict (`model.layers.{i}.self_attn.q_proj.weight`, ...) maps onto the stacked Flax
params by rule: drop `model.`, stack `layers.{i}` along a leading axis, `weight` → `kernel`
(transposed) / `scale` (norms) / `embedding`. Every expected tensor is checked by name and shape
before anything is converted, so a bad checkpoint names the offending tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping

import jax
import numpy as np

from .config import ModelConfig
from .decoder import init_params


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has one of the wrong shape, or has one we don't know."""


# Buffers some exporters write that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _param_shapes(cfg: ModelConfig):
    return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))


def expected_hf_tensors(cfg: ModelConfig) -> dict[str, tuple]:
    """HF tensor name → HF shape for every tensor this config needs."""
    return {name: shape for name, shape, _ in _hf_layout(cfg)}


def _hf_layout(cfg: ModelConfig):
    """Yield (hf_name, hf_shape, flax_path) for every parameter (per layer for stacked ones)."""
    shapes = _param_shapes(cfg)
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        keys = [p.key for p in path]
        if keys[0] == "layers":
            per_layer = leaf.shape[1:]
            for i in range(cfg.num_layers):
                name, hf_shape = _hf_name(["layers", str(i)] + keys[1:], per_layer)
                yield name, hf_shape, (tuple(keys), i)
        else:
            name, hf_shape = _hf_name(keys, leaf.shape)
            yield name, hf_shape, (tuple(keys), None)


def _hf_name(keys, shape):
    *mods, leaf = keys
    prefix = "" if mods[0] == "lm_head" else "model."
    if leaf == "kernel":
        return prefix + ".".join(mods) + ".weight", tuple(shape[::-1])
    if leaf in ("scale", "embedding"):
        return prefix + ".".join(mods) + ".weight", tuple(shape)
    return prefix + ".".join(mods) + "." + leaf, tuple(shape)


def params_from_hf_state_dict(cfg: ModelConfig, get: Callable[[str], np.ndarray] | Mapping[str, np.ndarray],
                              names=None, dtype=None, omit=()):
    """Build params from HF tensors. `get` is a mapping or a callable name → array; `names` the
    available names (defaults to the mapping's keys). Raises CheckpointError naming the tensor.
    `omit`: param paths of stacked layer leaves (e.g. ("layers", "mlp", "up_proj", "kernel")) that
    are required in the checkpoint but not read: each becomes an empty [L, 0] placeholder, as
    `models.quantized.drop_shadowed_kernels` leaves the float32 weights that GGUF blocks replace."""
    if names is None:
        names = list(get.keys())
    fetch = get.__getitem__ if isinstance(get, Mapping) else get
    available = set(names)
    layout = list(_hf_layout(cfg))
    expected = {n for n, _, _ in layout}
    missing = [n for n in (n for n, _, _ in layout) if n not in available]
    if cfg.tie_word_embeddings:
        available.discard("lm_head.weight")  # tied: some exporters still write it; it is the embedding
    unexpected = sorted(n for n in available if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint has unexpected tensor {unexpected[0]!r}{more} for config {cfg.family} "
                              f"(qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}, tied={cfg.tie_word_embeddings})")
    dt = np.dtype(dtype or cfg.dtype) if (dtype or cfg.dtype) != "bfloat16" else jax.numpy.bfloat16
    flat: dict[tuple, np.ndarray] = {}
    omit = set(omit)
    for name, hf_shape, (keys, layer) in layout:
        if keys in omit:
            if layer is None:
                raise ValueError(f"only stacked layer leaves can be omitted, not {keys}")
            flat.setdefault(keys, np.zeros((cfg.num_layers, 0), dt))
            continue
        arr = np.asarray(fetch(name))
        if tuple(arr.shape) != tuple(hf_shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(hf_shape)}")
        if keys[-1] == "kernel":
            arr = arr.T
        if layer is None:
            flat[keys] = arr.astype(dt, copy=False)  # no copy where the checkpoint has the dtype already
        else:  # each layer converted straight into its slot of the stack: one copy, no list of layers
            if keys not in flat:
                flat[keys] = np.empty((cfg.num_layers, *arr.shape), dt)
            flat[keys][layer] = arr
    params: dict = {}
    for keys, arr in flat.items():
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = jax.device_put(arr)  # not jnp.asarray: that compiles a program per shape
    return params


def params_to_hf_state_dict(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """Inverse of `params_from_hf_state_dict` (float32 numpy, HF layout)."""
    out = {}
    for name, _, (keys, layer) in _hf_layout(cfg):
        node = params
        for k in keys:
            node = node[k]
        arr = np.asarray(jax.device_get(node), dtype=np.float32)
        if layer is not None:
            arr = arr[layer]
        out[name] = np.ascontiguousarray(arr.T if keys[-1] == "kernel" else arr)
    return out


# ---------------------------------------------------------------------------------- directories
def read_safetensors_dir(path: str | os.PathLike):
    """(names, get) over a HF directory's single or sharded safetensors files, read lazily."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {path}")
        weight_map = {}
    missing_files = [f for f in files if not (path / f).exists()]
    if missing_files:
        raise CheckpointError(f"safetensors shard {missing_files[0]!r} listed in {index.name} is missing from {path}")
    handles = {f: safe_open(str(path / f), framework="numpy") for f in files}
    if not weight_map:
        for f, h in handles.items():
            for k in h.keys():
                weight_map[k] = f
    return list(weight_map), lambda name: handles[weight_map[name]].get_tensor(name)


def read_weights_dir(path: str | os.PathLike):
    """(names, get) over a HF directory's weights: safetensors (single or `model.safetensors.index.json`
    shards, read lazily) where there are any, else PyTorch `pytorch_model.bin` (single or
    `pytorch_model.bin.index.json` shards, as lmsys/vicuna-7b-v1.3 ships), read without torch by
    `models.torch_bin`'s restricted unpickler."""
    path = Path(path)
    if (path / "model.safetensors.index.json").exists() or any(path.glob("*.safetensors")):
        return read_safetensors_dir(path)
    from .torch_bin import read_torch_bin_dir

    found = read_torch_bin_dir(path)
    if found is None:
        raise CheckpointError(f"{path} has no weights: neither model.safetensors (or model.safetensors.index.json) "
                              f"nor pytorch_model.bin (or pytorch_model.bin.index.json)")
    return found


def load_hf_dir(path: str | os.PathLike, omit=(), **config_overrides):
    """Load (cfg, params) from a HF directory with config.json and safetensors or PyTorch `.bin`
    weights (`read_weights_dir`; `omit`: stacked layer leaves left unread, as
    `params_from_hf_state_dict` says)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path} has no config.json")
    cfg = ModelConfig.from_hf_config(json.loads(cfg_file.read_text()), **config_overrides)
    names, get = read_weights_dir(path)
    return cfg, params_from_hf_state_dict(cfg, get, names, omit=omit)


def save_hf_dir(path: str | os.PathLike, cfg: ModelConfig, params, extra_config: dict | None = None):
    """Write config.json + model.safetensors in the HF layout (transformers can load it)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf_config()
    hf.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(params_to_hf_state_dict(cfg, params), str(path / "model.safetensors"), metadata={"format": "pt"})
