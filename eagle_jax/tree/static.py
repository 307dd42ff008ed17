"""EAGLE-1 static draft trees, described by Medusa/EAGLE-1 style `choices`.

A static tree is a list of paths; each path is a tuple of child ranks from the root, so `(0, 1)` is
the top-2 child of the root's top-1 child. The root (the token the target already chose) is not
listed. Everything here is host-side numpy computed once per tree: the tree is a jit static
argument (frozen and hashable), and its index arrays become constants in the compiled step.

Node order: root first, then nodes by depth, then lexicographically by path. Parents therefore
precede children and siblings appear in rank order, which is the shared tree contract
(`parents[i] < i`, siblings in draft-rank order).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import NamedTuple, Sequence

import numpy as np


class Level(NamedTuple):
    """What the drafter needs to grow level `depth` (1..D) of a static tree from level depth-1.

    Positions index the node lists of the levels (level 0 is `[root]`), so the drafter can keep
    per-level arrays of width `len(nodes)` instead of the whole tree."""

    depth: int
    nodes: np.ndarray  # [W_d] node indices at this depth, increasing
    frontier: np.ndarray  # [F_d] node indices of level d-1 that have children, increasing
    frontier_pos: np.ndarray  # [F_d] positions of the frontier nodes in level d-1's node list
    parent_pos: np.ndarray  # [W_d] position of each node's parent in level d-1's node list
    parent_frontier_pos: np.ndarray  # [W_d] position of each node's parent in the frontier list
    ranks: np.ndarray  # [W_d] rank of each node among its parent's top-k


def _canonical(paths: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Paths as sorted tuples of ints (by depth, then lexicographically); ValueError if malformed."""
    out = []
    for path in paths:
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence):
            raise ValueError(f"a tree path must be a sequence of ranks, got {path!r}")
        if len(path) == 0:
            raise ValueError("the empty path (the root) must not be listed; list only draft nodes")
        ranks = []
        for r in path:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise ValueError(f"ranks must be integers, got {r!r} in path {tuple(path)!r}")
            if r < 0:
                raise ValueError(f"ranks must be >= 0, got {int(r)} in path {tuple(path)!r}")
            ranks.append(int(r))
        out.append(tuple(ranks))
    return tuple(sorted(out, key=lambda p: (len(p), p)))


@dataclasses.dataclass(frozen=True)
class StaticTree:
    """A static draft tree: `paths` of child ranks (root excluded). Hashable; a valid jit static arg.

    The constructor accepts lists and any path order; `paths` is stored canonically sorted, so two
    trees with the same set of paths compare (and hash) equal."""

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        paths = _canonical(self.paths)
        if not paths:
            raise ValueError("a static tree needs at least one path")
        seen = set()
        for p in paths:
            if p in seen:
                raise ValueError(f"duplicate path {p!r}")
            seen.add(p)
        for p in paths:
            if len(p) > 1 and p[:-1] not in seen:
                raise ValueError(f"path {p!r} has no parent: its prefix {p[:-1]!r} is not a path")
        object.__setattr__(self, "paths", paths)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """N: number of nodes including the root."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        """D: the longest path length (depth of the deepest node)."""
        return max(len(p) for p in self.paths)

    @property
    def top_k(self) -> int:
        """How many top-k candidates per expanded node the drafter must compute (max rank + 1)."""
        return max(max(p) for p in self.paths) + 1

    @property
    def max_width(self) -> int:
        """Number of nodes in the widest level."""
        return max(len(level) for level in self.levels())

    # ---- per-node arrays (numpy, read-only) --------------------------------------------------
    @functools.cached_property
    def _index(self) -> dict:
        return {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}

    @functools.cached_property
    def parents(self) -> np.ndarray:
        """[N] int32 parent node index; -1 for the root."""
        idx = self._index
        return _frozen([-1] + [idx[p[:-1]] for p in self.paths])

    @functools.cached_property
    def ranks(self) -> np.ndarray:
        """[N] int32 rank of each node among its parent's children candidates; 0 for the root."""
        return _frozen([0] + [p[-1] for p in self.paths])

    @functools.cached_property
    def depths(self) -> np.ndarray:
        """[N] int32 node depth; the root is 0."""
        return _frozen([0] + [len(p) for p in self.paths])

    def path_of(self, node: int) -> tuple[int, ...]:
        """The rank path of node `node` (() for the root)."""
        return () if node == 0 else self.paths[node - 1]

    def levels(self) -> tuple[np.ndarray, ...]:
        """For each depth d = 1..D the node indices at that depth (increasing)."""
        return tuple(level.nodes for level in self.level_plan())

    def level_plan(self) -> tuple[Level, ...]:
        """The level-by-level expansion plan: one `Level` per depth 1..D (see `Level`)."""
        return self._level_plan

    @functools.cached_property
    def _level_plan(self) -> tuple[Level, ...]:
        parents, depths, ranks = self.parents, self.depths, self.ranks
        prev = np.array([0], np.int32)  # level 0: the root
        plan = []
        for d in range(1, self.depth + 1):
            nodes = np.flatnonzero(depths == d).astype(np.int32)
            pos_in_prev = {int(n): i for i, n in enumerate(prev)}
            frontier = np.array(sorted({int(parents[n]) for n in nodes}), np.int32)
            pos_in_frontier = {int(n): i for i, n in enumerate(frontier)}
            plan.append(Level(
                depth=d,
                nodes=_frozen(nodes),
                frontier=_frozen(frontier),
                frontier_pos=_frozen([pos_in_prev[int(f)] for f in frontier]),
                parent_pos=_frozen([pos_in_prev[int(parents[n])] for n in nodes]),
                parent_frontier_pos=_frozen([pos_in_frontier[int(parents[n])] for n in nodes]),
                ranks=_frozen(ranks[nodes]),
            ))
            prev = nodes
        return tuple(plan)

    # ---- configs -----------------------------------------------------------------------------
    def to_json(self) -> list[list[int]]:
        """The paths as a JSON-ready list of lists (canonical order)."""
        return [list(p) for p in self.paths]

    @classmethod
    def from_json(cls, data: str | Sequence[Sequence[int]]) -> "StaticTree":
        """A tree from a list of lists, or from a JSON string holding one."""
        if isinstance(data, (str, bytes)):
            data = json.loads(data)
        if not isinstance(data, Sequence):
            raise ValueError(f"a static tree is a list of paths, got {type(data).__name__}")
        return cls(tuple(data))

    def __repr__(self) -> str:
        return f"StaticTree(num_nodes={self.num_nodes}, depth={self.depth}, top_k={self.top_k})"


def _frozen(values) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int32).reshape(-1)
    arr.setflags(write=False)
    return arr


# A narrowing EAGLE-1-style tree sized for a CPU verify budget: 20 nodes (root included), depth 6,
# top_k 4. Like the reference's trees, most mass goes to the top-1 chain and the lower-rank
# branches are pruned early (draft acceptance falls quickly with rank).
DEFAULT_STATIC_TREE = StaticTree((
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 1, 0),
    (0, 0, 0, 0, 0, 0),
))

# The default tree's paths in the order a smaller verify budget should keep them: each prefix of
# N - 1 paths is a tree of N nodes (a path comes after its parent). The order follows an estimated
# path value (a weak head's rank-1 and rank-2 guesses at the first level before its deeper rank-0
# chain); which prefix pays on a device is measured (`static_tree_of_size`, `autotune`).
PRIORITY_PATHS = (
    (0,), (1,), (0, 0), (2,), (0, 0, 0), (0, 1), (1, 0), (3,), (0, 0, 0, 0), (0, 0, 1), (0, 2), (1, 1),
    (0, 1, 0), (1, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 0, 0, 0, 0, 0), (0, 0, 0, 1, 0),
)


def static_tree_of_size(num_nodes: int) -> StaticTree:
    """The static tree of `num_nodes` nodes (root included, 2 ≤ N ≤ 20): the first N - 1 paths of
    `PRIORITY_PATHS`; N = 20 is `DEFAULT_STATIC_TREE`."""
    if not 2 <= num_nodes <= len(PRIORITY_PATHS) + 1:
        raise ValueError(f"a sized static tree has 2 to {len(PRIORITY_PATHS) + 1} nodes, got {num_nodes}")
    return StaticTree(PRIORITY_PATHS[:num_nodes - 1])
