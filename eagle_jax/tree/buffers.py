"""Tree buffers derived on device from `parents_bn` and `valid_bn`: attention masks, depths
(positions are `P + depth`), leaves, root-to-node paths and the reference's retrieve indices.

Tree contract (shared by static and dynamic trees): node 0 is the root (parent -1); every valid
node i > 0 has a valid parent `parents_bn[b, i] < i`; invalid (padding) nodes have arbitrary
parents and must never influence anything. All functions are jittable with `max_depth` static; the
work is D steps of pointer chasing (a gather per step), never a Python loop over nodes.

Defensive rule used everywhere: an edge i -> parents[i] is followed only if i > 0, i is valid,
0 <= parents[i] < i and the parent is valid. So padding nodes are isolated, valid nodes can never
reach an invalid one, and garbage parents can neither create cycles nor leak into valid rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TreeBuffers(NamedTuple):
    """Everything verification needs about one padded tree, computed in one pass."""

    mask_bnn: jax.Array  # bool [B, N, N]: j is an ancestor-or-self of i
    depth_bn: jax.Array  # int32 [B, N]: root 0, invalid 0
    is_leaf_bn: jax.Array  # bool [B, N]: valid node without valid children
    paths_bnd: jax.Array  # int32 [B, N, D+1]: root-to-node paths, -1 padded; invalid row i: [i, -1..]
    ri_bnd: jax.Array  # int32 [B, N, D+1]: paths_bnd on leaf rows, all -1 elsewhere


def effective_parents(parents_bn: jax.Array, valid_bn: jax.Array | None = None) -> jax.Array:
    """Parents with every edge that must not be followed replaced by -1 (see module docstring).

    With `valid_bn=None` only the structural checks apply (i > 0, 0 <= parent < i)."""
    parents = parents_bn.astype(jnp.int32)
    n = parents.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)[None, :]
    ok = (idx > 0) & (parents >= 0) & (parents < idx)
    if valid_bn is not None:
        valid_bn = valid_bn.astype(bool)
        parent_valid = jnp.take_along_axis(valid_bn, jnp.clip(parents, 0, n - 1), axis=-1)
        ok = ok & valid_bn & parent_valid
    return jnp.where(ok, parents, -1)


def ancestor_chains(nodes_bm: jax.Array, eff_parents_bn: jax.Array, max_depth: int) -> jax.Array:
    """[B, M, D+1] int32: entry k is the k-th ancestor of `nodes_bm` (k = 0: the node itself), -1
    past the root. A -1 start node yields an all -1 row. D gathers (static loop over depth)."""
    cur = nodes_bm.astype(jnp.int32)
    n = eff_parents_bn.shape[-1]
    out = [cur]
    for _ in range(max_depth):
        up = jnp.take_along_axis(eff_parents_bn, jnp.clip(cur, 0, n - 1), axis=-1)
        cur = jnp.where(cur >= 0, up, -1)
        out.append(cur)
    return jnp.stack(out, axis=-1)


def chains_to_paths(chain_bmd: jax.Array) -> jax.Array:
    """Reverse ancestor chains into root-to-node paths, padded with -1 after the node.

    Chains that do not end at the root within D steps (deeper than max_depth, a contract breach)
    are reversed as they are."""
    d1 = chain_bmd.shape[-1]
    length = jnp.sum(chain_bmd >= 0, axis=-1, keepdims=True)  # depth + 1 (0 for a -1 start)
    t = jnp.arange(d1, dtype=jnp.int32)
    src = jnp.clip(length - 1 - t, 0, d1 - 1)
    return jnp.where(t < length, jnp.take_along_axis(chain_bmd, src, axis=-1), -1)


def _all_chains(parents_bn, valid_bn, max_depth):
    b, n = parents_bn.shape
    eff = effective_parents(parents_bn, valid_bn)
    nodes = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    return eff, ancestor_chains(nodes, eff, max_depth)


def _mask_from_chains(chain_bnd):
    n = chain_bnd.shape[1]
    j = jnp.arange(n, dtype=jnp.int32)
    return jnp.any(chain_bnd[:, :, None, :] == j[None, None, :, None], axis=-1)


def _leaves(eff_bn, valid_bn):
    valid_bn = valid_bn.astype(bool)
    n = eff_bn.shape[-1]
    j = jnp.arange(n, dtype=jnp.int32)
    has_child = jnp.any(eff_bn[:, :, None] == j[None, None, :], axis=1)  # [B, N] over parents j
    return valid_bn & ~has_child


def ancestor_mask(parents_bn: jax.Array, valid_bn: jax.Array, max_depth: int) -> jax.Array:
    """bool [B, N, N]: mask[b, i, j] = node j is an ancestor-or-self of node i (both valid).

    An invalid row i holds only [i, i] (so its attention row is never empty), and no valid row
    ever holds an invalid column. This is the tree block of the verification attention mask."""
    _, chain = _all_chains(parents_bn, valid_bn, max_depth)
    return _mask_from_chains(chain)


def node_depths(parents_bn: jax.Array, valid_bn: jax.Array, max_depth: int) -> jax.Array:
    """int32 [B, N] node depth (root 0, invalid nodes 0). Target positions are `P + depth`."""
    _, chain = _all_chains(parents_bn, valid_bn, max_depth)
    return (jnp.sum(chain >= 0, axis=-1) - 1).astype(jnp.int32)


def tree_positions(depth_bn: jax.Array, length_b: jax.Array) -> jax.Array:
    """int32 [B, N] target positions of the tree tokens: committed length P (the root's position)
    plus node depth. Padding nodes (depth 0) sit at P; their keys are masked out anyway."""
    return (length_b.astype(jnp.int32)[:, None] + depth_bn).astype(jnp.int32)


def is_leaf(parents_bn: jax.Array, valid_bn: jax.Array) -> jax.Array:
    """bool [B, N]: valid nodes that have no valid child."""
    return _leaves(effective_parents(parents_bn, valid_bn), valid_bn)


def retrieve_indices(parents_bn: jax.Array, valid_bn: jax.Array, max_depth: int) -> jax.Array:
    """int32 [B, N, D+1]: row i lists the root-to-leaf node indices of leaf i, padded with -1;
    rows of non-leaves (and of invalid nodes) are all -1. The reference's retrieve_indices with
    one row per node instead of one per leaf, so the shape is static."""
    eff, chain = _all_chains(parents_bn, valid_bn, max_depth)
    leaf = _leaves(eff, valid_bn)
    return jnp.where(leaf[..., None], chains_to_paths(chain), -1)


def path_to(node_b: jax.Array, parents_bn: jax.Array, max_depth: int) -> jax.Array:
    """int32 [B, D+1]: root-to-`node_b` node indices, padded with -1 after the node.

    Only structural checks are applied to the parents (the node and its ancestors are assumed
    valid, as for an accepted node)."""
    eff = effective_parents(parents_bn)
    chain = ancestor_chains(node_b.astype(jnp.int32)[:, None], eff, max_depth)
    return chains_to_paths(chain)[:, 0]


def tree_buffers(parents_bn: jax.Array, valid_bn: jax.Array, max_depth: int) -> TreeBuffers:
    """All buffers at once, sharing one set of ancestor chains."""
    eff, chain = _all_chains(parents_bn, valid_bn, max_depth)
    leaf = _leaves(eff, valid_bn)
    paths = chains_to_paths(chain)
    return TreeBuffers(
        mask_bnn=_mask_from_chains(chain),
        depth_bn=(jnp.sum(chain >= 0, axis=-1) - 1).astype(jnp.int32),
        is_leaf_bn=leaf,
        paths_bnd=paths,
        ri_bnd=jnp.where(leaf[..., None], paths, -1),
    )
