"""Drafting a tree with a head: EAGLE-1 static trees and EAGLE-2 dynamic trees, static shapes.

Both start from `h_root` [B, d], the head's output at draft position P-1 (it has consumed the
root token t_P), whose logits propose the root's children. Frontier nodes of tree level i are fed
back at draft position P + i - 1, their keys written to the draft cache's scratch slots past the
committed length (slot P + (i-1)·W + j), where each node attends to the committed prefix, its
ancestors' scratch slots and itself. Nothing here advances the draft cache: after verification the
accepted path is re-run over those slots (`speculative.py`). `draft_tree_and_cache` also returns
the cache with the scratch slots written, for that re-run to write into: the scratch lies past the
committed length, where no later query looks until a later write has replaced it, so the re-run
needs no copy of the cache as it was before drafting (XLA copied the whole draft cache at every
step to keep that).

Output of both: `Tree(tokens_bn, parents_bn, valid_bn)` — node 0 is the root, parents precede
children, siblings in draft-rank order (the contract of `eagle_jax.tree`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..models.decoder import KVCache
from ..models.layers import BlockStart
from ..sampling import argmax_last
from ..tree import StaticTree, rerank
from .heads import DraftHead, head_logits, head_step, to_target_ids


class Tree(NamedTuple):
    tokens_bn: jax.Array  # [B, N] target token ids; node 0 = root
    parents_bn: jax.Array  # [B, N] parent node index, -1 for the root
    valid_bn: jax.Array  # [B, N] real nodes (padding never attends or is attended)


@dataclasses.dataclass(frozen=True)
class TreeBudget:
    """Static shape of a speculative step (a hashable jit static argument).

    dynamic (EAGLE-2): `depth` expansion steps of `top_k` frontier nodes, reranked to the best
    `total_tokens` nodes (root included); tree depth ≤ depth + 1. A tree of N nodes cannot hold a
    node below level N - 1 (a kept node's ancestors are kept: path values only fall along a path),
    so `depth` is clipped to N - 2 expansions: the same tree, without drafting levels that could
    never be kept (a 4-token tree drafts 2 levels, not 5; a 2-token tree, the root and the head's
    first choice, none: before stop 72 it drafted a level it then dropped, one of its two head
    passes a step). `depth` 0: the root's best N - 1 children alone, no expansion (`top_k` is
    clipped to N - 1 there: one budget, one program, for each such tree).
    static (EAGLE-1): the fixed tree `static_tree`; total_tokens = its node count.
    lookup: a chain of up to `lookup` tokens copied from the context by n-gram lookup (n-grams of
    `lookup_ngram` tokens down to `lookup_min_ngram`, the longest that occurred before first) is
    grafted onto the head's tree (`tree.lookup`); paths reach `lookup` deep. A larger
    `lookup_min_ngram` finds fewer chains and better ones: where the tree is small, a wrong chain
    costs the head's rows (without a chain it is set to 1: the same tree). A dynamic tree keeps
    its `total_tokens` rows: in a batch row where a chain was found, the head's best
    `total_tokens - lookup` nodes and the chain's new nodes, elsewhere the head's best
    `total_tokens` as without a chain. A static tree gets `lookup` more rows for it. 0: the head's
    tree alone.
    """

    kind: str = "dynamic"
    total_tokens: int = 24
    depth: int = 5
    top_k: int = 4
    static_tree: Optional[StaticTree] = None
    lookup: int = 0
    lookup_ngram: int = 3
    lookup_min_ngram: int = 1

    def __post_init__(self):
        if self.lookup < 0 or not 1 <= self.lookup_min_ngram <= self.lookup_ngram:
            raise ValueError(f"need lookup >= 0 and 1 <= lookup_min_ngram <= lookup_ngram, got {self.lookup}, "
                             f"{self.lookup_min_ngram}, {self.lookup_ngram}")
        if not self.lookup:  # no chain to find: one budget, one compiled program, whatever the n-grams
            object.__setattr__(self, "lookup_min_ngram", 1)
        if self.kind not in ("dynamic", "static"):
            raise ValueError(f"tree kind must be 'dynamic' or 'static', got {self.kind!r}")
        if self.kind == "static":
            if self.static_tree is None:
                raise ValueError("a static tree budget needs static_tree")
            object.__setattr__(self, "total_tokens", self.static_tree.num_nodes)
            object.__setattr__(self, "depth", self.static_tree.depth)
            object.__setattr__(self, "top_k", self.static_tree.top_k)
        else:
            if self.top_k < 1 or self.depth < 0:
                raise ValueError(f"need top_k >= 1 and depth >= 0, got top_k={self.top_k}, depth={self.depth}")
            most = self.most_tokens(self.depth, self.top_k)
            if not 2 <= self.total_tokens <= most:
                raise ValueError(f"total_tokens must be in [2, {most}] for top_k={self.top_k}, depth={self.depth}; "
                                 f"got {self.total_tokens}")
            object.__setattr__(self, "depth", min(self.depth, self.total_tokens - 2))
            if self.depth == 0:  # the best N - 1 of the root's children are its top N - 1: the same tree
                object.__setattr__(self, "top_k", min(self.top_k, self.total_tokens - 1))
            if self.lookup > self.total_tokens - 2:
                raise ValueError(f"lookup must leave the head at least the root and one node: lookup <= "
                                 f"total_tokens - 2 = {self.total_tokens - 2}, got {self.lookup}")

    @staticmethod
    def most_tokens(depth: int, top_k: int) -> int:
        """The most nodes a dynamic tree of this shape can offer: the root, its top_k children and
        top_k² candidates a further expansion."""
        return 1 + top_k + depth * top_k ** 2

    @property
    def draft_depth(self) -> int:
        """Deepest node of the head's own tree below the root."""
        return self.depth if self.kind == "static" else self.depth + 1

    @property
    def max_depth(self) -> int:
        """Deepest node below the root: the most draft tokens one step can accept."""
        return max(self.draft_depth, self.lookup)

    @property
    def num_nodes(self) -> int:
        """Verification rows of a step (a static tree's chain comes on top of it)."""
        return self.total_tokens + (self.lookup if self.kind == "static" else 0)

    @property
    def scratch(self) -> int:
        """Draft-cache slots the expansion writes past the committed length."""
        if self.kind == "static":
            return sum(len(lv) for lv in self.static_tree.levels()[:-1]) or 1
        return self.depth * self.top_k


def _scratch_mask(length_b, max_len: int, scratch_visible_bws, offset_w: int):
    """[B, W, S] visibility: committed slots plus the scratch slots each query may see."""
    b, w, n_scr = scratch_visible_bws.shape
    s = jnp.arange(max_len)[None, None, :]
    rel = s - length_b[:, None, None]
    committed = rel < 0
    idx = jnp.clip(rel, 0, n_scr - 1)
    scr = jnp.take_along_axis(scratch_visible_bws, jnp.broadcast_to(idx, (b, w, max_len)), axis=2)
    return committed | ((rel >= 0) & (rel < n_scr) & scr)


def _top_k_rows(x_rv, k: int):
    """`lax.top_k` of each row (the same order: ties to the lower index), as k argmax passes for a
    small k. Inside a drafting program XLA:CPU lowered some top-k over a large vocabulary to a full
    sort (42 ms for [2, 49152] on the 2-core Zen 1 VM: an EAGLE-1 head's second static-tree level),
    where k passes cost a fraction of a millisecond. On the CPU with the kernels built, one pass of
    their custom call (`kernels.cpu_topk`, the same order) instead."""
    from ..kernels import cpu_topk  # imported on use, as sampling does

    if cpu_topk.usable(x_rv, k):
        return cpu_topk.top_k(x_rv, k)[:2]
    if k > 8:
        return jax.lax.top_k(x_rv, k)
    rows = jnp.arange(x_rv.shape[0])
    taken = jnp.zeros(x_rv.shape, bool)
    vals, idx = [], []
    for _ in range(k):
        left = jnp.where(taken, -jnp.inf, x_rv)
        best = jnp.max(left, axis=-1, keepdims=True)
        i = argmax_last((left == best) & ~taken)  # -inf ties too: never one taken
        vals.append(x_rv[rows, i])
        idx.append(i)
        taken = taken.at[rows, i].set(True)
    return jnp.stack(vals, -1), jnp.stack(idx, -1)


def _top_log_probs(head, target_params, target_cfg, h, k: int):
    """The head's top `k` log-probabilities over its vocabulary and their ids, [..., k] each (the
    top-k of the logits minus their log-sum-exp: the log-softmax's ranking)."""
    from ..kernels import cpu_topk

    logits = head_logits(head, target_params, target_cfg, h)
    flat = logits.reshape(-1, logits.shape[-1])
    if cpu_topk.usable(flat, k):  # one pass for both (the log-sum-exp to float32 rounding)
        vals, idx, lse = cpu_topk.top_k(flat, k, with_lse=True)
        vals = vals - lse[:, None]
    else:
        vals, idx = _top_k_rows(flat, k)
        vals = vals - jax.nn.logsumexp(flat, axis=-1, keepdims=True)
    shape = (*logits.shape[:-1], k)
    return vals.reshape(shape), idx.reshape(shape)


def draft_dynamic(head: DraftHead, target_params, target_cfg, h_root_bd, root_b, cache: KVCache,
                  budget: TreeBudget) -> Tree:
    """EAGLE-2: expand the top_k frontier by path value (sum of log-probs) for `depth` steps, then keep
    the best total_tokens - 1 candidates (plus the root)."""
    return _dynamic(head, target_params, target_cfg, h_root_bd, root_b, cache, budget)[0]


def _dynamic(head, target_params, target_cfg, h_root_bd, root_b, cache: KVCache, budget: TreeBudget):
    *cands, cache = draft_candidates(head, target_params, target_cfg, h_root_bd, cache, budget)
    return Tree(*rerank(*cands, root_b, budget.total_tokens)), cache


def draft_candidates(head: DraftHead, target_params, target_cfg, h_root_bd, cache: KVCache, budget: TreeBudget):
    """EAGLE-2's expansion: (tokens, cumulative log-prob scores, parent candidate) [B, C] of every
    candidate in generation order, for `tree.rerank`, and the draft cache with the expansion's
    scratch slots written (module doc)."""
    k, depth = budget.top_k, budget.depth
    b = h_root_bd.shape[0]
    embed = target_params["embed_tokens"]["embedding"]
    p0, i0 = _top_log_probs(head, target_params, target_cfg, h_root_bd, k)  # B K
    tok0 = to_target_ids(head, i0)
    root_children = jnp.full((b, k), -1, jnp.int32)
    if depth == 0:  # the root's children are every candidate: no head step, no scratch slot written
        return tok0, p0, root_children, cache
    n_scr = depth * k
    pos0 = cache.length  # level-1 nodes sit at draft position P (they predict target position P+2)

    def level(carry, i):
        tok_f, h_f, score_f, cand_f, vis_f, cache = carry
        slots = BlockStart(cache.length + i * k)  # fits: the cache has `budget.scratch` slots past the prefix
        mask = _scratch_mask(cache.length, cache.max_len, vis_f, 0)
        h_out, cache = head_step(head, embed, tok_f, h_f, jnp.broadcast_to((pos0 + i)[:, None], (b, k)), cache,
                                 slots, mask)
        tp, ti = _top_log_probs(head, target_params, target_cfg, h_out, k)  # B K K
        cu = (tp + score_f[:, :, None]).reshape(b, k * k)
        toks = to_target_ids(head, ti).reshape(b, k * k)
        parent = jnp.repeat(cand_f, k, axis=1)  # candidate index of each child's parent
        sel_score, sel = jax.lax.top_k(cu, k)
        rows = sel // k
        nxt_vis = jnp.take_along_axis(vis_f, rows[:, :, None], axis=1)
        own = jax.nn.one_hot((i + 1) * k + jnp.arange(k), n_scr, dtype=bool)[None]
        nxt = (jnp.take_along_axis(toks, sel, axis=1), jnp.take_along_axis(h_out, rows[:, :, None], axis=1),
               sel_score, k + i * k * k + sel, nxt_vis | own, cache)
        return nxt, (toks, cu, parent)

    vis0 = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(k), n_scr, dtype=bool)[None], (b, k, n_scr))
    h0 = jnp.broadcast_to(h_root_bd[:, None, :], (b, k, h_root_bd.shape[-1]))
    init = (tok0, h0, p0, jnp.broadcast_to(jnp.arange(k)[None], (b, k)), vis0, cache)
    last, (toks, scores, parents) = jax.lax.scan(level, init, jnp.arange(depth))
    flat = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, depth * k * k)
    cand_tok = jnp.concatenate([tok0, flat(toks)], axis=1)
    cand_score = jnp.concatenate([p0, flat(scores)], axis=1)
    cand_parent = jnp.concatenate([root_children, flat(parents).astype(jnp.int32)], axis=1)
    return cand_tok, cand_score, cand_parent, last[-1]


def draft_static(head: DraftHead, target_params, target_cfg, h_root_bd, root_b, cache: KVCache,
                 budget: TreeBudget) -> Tree:
    """EAGLE-1: fill a fixed tree level by level; a node is its parent's rank-r draft token."""
    return _static(head, target_params, target_cfg, h_root_bd, root_b, cache, budget)[0]


def _static(head, target_params, target_cfg, h_root_bd, root_b, cache: KVCache, budget: TreeBudget):
    tree = budget.static_tree
    b = h_root_bd.shape[0]
    embed = target_params["embed_tokens"]["embedding"]
    levels = tree.levels()
    parents = np.asarray(tree.parents)
    ranks = np.asarray(tree.ranks)
    n = tree.num_nodes
    tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(root_b)
    # Scratch slot of each node that is fed to the head (every level but the last), and its
    # static visibility (ancestors' and own scratch slots).
    fed = [int(x) for lv in levels[:-1] for x in lv]
    slot_of = {node: i for i, node in enumerate(fed)}
    n_scr = max(len(fed), 1)
    vis = np.zeros((n, n_scr), bool)
    for node in fed:
        a = node
        while a > 0:
            vis[node, slot_of[a]] = True
            a = parents[a]
    top_i = _top_log_probs(head, target_params, target_cfg, h_root_bd, tree.top_k)[1]  # children of the root by rank
    lv1 = np.asarray(levels[0])
    tokens = tokens.at[:, lv1].set(to_target_ids(head, top_i[:, ranks[lv1]]))
    h_prev, parent_pos = h_root_bd, None
    for d in range(1, len(levels)):
        nodes_prev = np.asarray(levels[d - 1])
        w = len(nodes_prev)
        slots = BlockStart(cache.length + slot_of[int(nodes_prev[0])])  # a level's slots are consecutive
        mask = _scratch_mask(cache.length, cache.max_len, jnp.broadcast_to(jnp.asarray(vis[nodes_prev])[None],
                                                                          (b, w, n_scr)), 0)
        h_in = (jnp.broadcast_to(h_root_bd[:, None], (b, w, h_root_bd.shape[-1])) if d == 1
                else jnp.take(h_prev, jnp.asarray(parent_pos), axis=1))
        h_out, cache = head_step(head, embed, tokens[:, nodes_prev], h_in,
                                 jnp.broadcast_to((cache.length + d - 1)[:, None], (b, w)), cache, slots, mask)
        top_i = _top_log_probs(head, target_params, target_cfg, h_out, tree.top_k)[1]  # B W K
        nodes = np.asarray(levels[d])
        pos_in_prev = {int(x): j for j, x in enumerate(nodes_prev)}
        parent_pos = [pos_in_prev[int(parents[x])] for x in nodes]
        picked = top_i[:, jnp.asarray(parent_pos), jnp.asarray(ranks[nodes])]
        tokens = tokens.at[:, nodes].set(to_target_ids(head, picked))
        h_prev = h_out
    par = jnp.broadcast_to(jnp.asarray(parents, jnp.int32)[None], (b, n))
    return Tree(tokens, par, jnp.ones((b, n), bool)), cache


def draft_tree(head: DraftHead, target_params, target_cfg, h_root_bd, root_b, cache: KVCache,
               budget: TreeBudget) -> Tree:
    return draft_tree_and_cache(head, target_params, target_cfg, h_root_bd, root_b, cache, budget)[0]


def draft_tree_and_cache(head: DraftHead, target_params, target_cfg, h_root_bd, root_b, cache: KVCache,
                         budget: TreeBudget) -> tuple[Tree, KVCache]:
    """`draft_tree` and the draft cache with the drafting's scratch slots written (module doc)."""
    fn = _static if budget.kind == "static" else _dynamic
    return fn(head, target_params, target_cfg, h_root_bd, root_b, cache, budget)
