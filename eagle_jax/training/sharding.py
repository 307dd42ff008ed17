"""Mesh and sharding: named mesh axes, logical axis names, and the one table that maps them.

Arrays never name mesh axes directly. Parameters and activations carry *logical* axis names
("embed", "heads", "mlp", "vocab", "batch", ...); `LOGICAL_RULES` says which mesh axis each
logical name is split over. Changing a parallelism strategy is a change to this table (or to the
mesh shape in a training config), never to model code.

Mesh axes:
  data    pure data parallelism: the batch is split, parameters are replicated.
  fsdp    the batch is split *and* the parameters' embed dimension is split (ZeRO-3 style);
          XLA all-gathers weights before use and reduce-scatters their gradients.
  tensor  Megatron-style model parallelism over heads, MLP width and vocabulary.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated). One table for
# parameters and activations; a name missing here is an error, not a silent replication.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("act_embed", None),  # activations keep d whole: fsdp shards weights, not activations
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters
    ("embed", "fsdp"),
    ("heads", "tensor"),  # q/o projections' num_heads * head_dim
    ("kv_heads", "tensor"),  # k/v projections' num_kv_heads * head_dim
    ("head_dim", None),  # q/k norms
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("features", "tensor"),  # fc input: concat(low, mid, high) (EAGLE-3) or concat(emb, f) (EAGLE-1)
    ("norm", None),
    ("layers", None),  # the target's scanned layer stack
    ("vocab_map", None),  # d2t / t2d draft-vocabulary maps
)

# Parameter naming -> logical axes of the unstacked parameter, keyed by (module, leaf). Kernels
# are stored [in, out] (flax Dense).
_PARAM_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("q_proj", "kernel"): ("embed", "heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "bias"): ("embed",),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "bias"): ("embed",),
    ("fc", "kernel"): ("features", "embed"),
    ("fc", "bias"): ("embed",),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("lm_head", "bias"): ("vocab",),
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("q_norm", "scale"): ("head_dim",),
    ("k_norm", "scale"): ("head_dim",),
}
_NORM_SCALE = ("norm",)  # any other "*norm*/scale": input/post-attention/hidden/final norms
_VOCAB_MAPS = ("d2t", "t2d")


class MeshConfigError(ValueError):
    """A mesh shape that cannot be built on the devices at hand."""


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with at most one `-1` ("the rest of the devices") filled in."""
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(MESH_AXES):
        raise MeshConfigError(f"mesh shape needs {len(MESH_AXES)} sizes {MESH_AXES}, got {shape}")
    if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
        raise MeshConfigError(f"mesh sizes must be positive, with at most one -1; got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if num_devices % known:
            raise MeshConfigError(f"mesh {dict(zip(MESH_AXES, shape))}: {num_devices} devices are not a "
                                  f"multiple of {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if math.prod(shape) != num_devices:
        raise MeshConfigError(f"mesh {dict(zip(MESH_AXES, shape))} needs {math.prod(shape)} devices, but "
                              f"{num_devices} are available; make the product equal the device count "
                              "or use -1 for one axis")
    return shape


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, *, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape((data, fsdp, tensor), len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _shape(x) -> tuple[int, ...]:
    """Shape of an array, a ShapeDtypeStruct or a Python scalar."""
    return tuple(getattr(x, "shape", np.shape(x)))


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_names(path) -> tuple[str, ...]:
    """A pytree key path as plain strings: ('layers', 'self_attn', 'q_proj', 'kernel')."""
    return tuple(_key_name(k) for k in path)


def leaf_logical_axes(names: Sequence[str], ndim: int) -> tuple[Optional[str], ...]:
    """Logical axes of one parameter from its path names and rank; raises if the name is unknown."""
    names = tuple(names)
    where = "/".join(names)
    if not names:
        raise ValueError("cannot name the axes of a bare array; give parameters a path")
    leaf = names[-1]
    base: Optional[tuple[str, ...]] = None
    if leaf in _VOCAB_MAPS:
        base = ("vocab_map",)
    elif len(names) >= 2 and (names[-2], leaf) in _PARAM_AXES:
        base = _PARAM_AXES[(names[-2], leaf)]
    elif len(names) >= 2 and leaf == "scale" and "norm" in names[-2]:
        base = _NORM_SCALE
    if base is None:
        raise ValueError(f"no logical-axis rule for parameter {where!r} (rank {ndim}); add one to "
                         "eagle_jax.training.sharding._PARAM_AXES or pass explicit axes")
    stacked = "layers" in names[:-1]  # the target's scanned layers: leading [num_layers] axis
    axes = (("layers",) if stacked else ()) + base
    if len(axes) != ndim:
        raise ValueError(f"parameter {where!r} has rank {ndim}, but its rule gives axes {axes}")
    return axes


def param_logical_axes(params) -> Any:
    """A pytree like `params` whose leaves are tuples of logical axis names (one per dim)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: leaf_logical_axes(path_names(p), len(_shape(x))), params)


_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.warning(msg)


def logical_to_spec(axes: Sequence[Optional[str]], shape: Sequence[int], mesh_shape: dict[str, int],
                    rules=LOGICAL_RULES) -> PartitionSpec:
    """PartitionSpec for an array of `shape` with logical `axes` on a mesh of `mesh_shape`.

    A dim whose mesh axes do not divide it is replicated (logged once per case): a 101-word
    vocabulary on tensor=2 stays whole rather than failing.
    """
    table = dict(rules)
    if len(axes) != len(shape):
        raise ValueError(f"{len(axes)} logical axes {tuple(axes)} for an array of shape {tuple(shape)}")
    spec, used = [], set()
    for name, dim in zip(axes, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in the rules table")
        target = table[name]
        mesh_axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        mesh_axes = tuple(a for a in mesh_axes if mesh_shape.get(a, 1) > 1)  # size-1 axes split nothing
        if not mesh_axes:
            spec.append(None)
            continue
        if used & set(mesh_axes):
            raise ValueError(f"logical axes {tuple(axes)} map mesh axis {sorted(used & set(mesh_axes))} twice")
        size = math.prod(mesh_shape[a] for a in mesh_axes)
        if dim % size:
            _log_once(f"logical axis {name!r}: dim {dim} is not divisible by mesh axes {mesh_axes} "
                      f"(size {size}); replicating that dim")
            spec.append(None)
            continue
        used |= set(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def logical_to_sharding(axes: Sequence[Optional[str]], shape: Sequence[int], mesh: Mesh,
                        rules=LOGICAL_RULES) -> NamedSharding:
    """NamedSharding for an array of `shape` whose dims carry the logical names `axes`."""
    return NamedSharding(mesh, logical_to_spec(axes, shape, dict(mesh.shape), rules))


def tree_shardings(tree, mesh: Mesh, axes_tree=None, rules=LOGICAL_RULES):
    """NamedShardings for every leaf of `tree` (arrays or ShapeDtypeStructs).

    `axes_tree` (a pytree of axis tuples like `tree`) defaults to `param_logical_axes(tree)`.
    """
    if axes_tree is None:
        axes_tree = param_logical_axes(tree)
    return jax.tree_util.tree_map(lambda x, ax: logical_to_sharding(ax, _shape(x), mesh, rules), tree, axes_tree,
                                  is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None)))
                                                                              for a in x))


def put_global(tree, shardings):
    """Place host (or single-device) arrays onto their shardings; every process passes the full
    value, each keeps its own shards (works the same on one host and on a pod)."""

    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree_util.tree_map(put, tree, shardings)


def shard_params(params, mesh: Mesh, axes_tree=None, rules=LOGICAL_RULES):
    """`params` placed on `mesh` as the rules table says."""
    return put_global(params, tree_shardings(params, mesh, axes_tree, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, batch, rules=LOGICAL_RULES):
    """Shardings for a batch dict: dim 0 is "batch", dim 1 (if any) "seq", further dims whole."""

    def one(x):
        shape = _shape(x)
        names = ("batch", "seq")[:len(shape)] + (None,) * max(0, len(shape) - 2)
        return logical_to_sharding(names, shape, mesh, rules)

    return jax.tree_util.tree_map(one, batch)


def put_batch(batch, shardings):
    """A global batch from each process's rows (the process-local slice of the global batch)."""
    return jax.tree_util.tree_map(lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), batch,
                                  shardings)


def with_logical_constraint(x, axes: Iterable[Optional[str]], rules=LOGICAL_RULES):
    """Constrain an activation's sharding by logical names inside a jitted function.

    Uses the mesh set by `jax.set_mesh` (the trainer sets it around its step); outside any mesh it
    returns `x` unchanged, so model code can call it unconditionally.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(tuple(axes), x.shape, dict(mesh.shape), rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def take_embedding(table_vd, ids, rules=LOGICAL_RULES):
    """Rows of an embedding table for token ids, sharded like activations.

    FSDP keeps the table's embed dim split; gathering from it directly leaves the rows split on
    d, which XLA can only turn into batch-split rows by replicating them. All-gathering the table
    over fsdp first (as FSDP does for every weight before use) keeps the step communication-light.
    """
    table_vd = with_logical_constraint(table_vd, ("vocab", None), rules)
    rows = jax.numpy.take(table_vd, ids, axis=0)
    return with_logical_constraint(rows, ("batch", "seq")[:rows.ndim - 1] + ("act_embed",), rules)
