"""EAGLE-2 dynamic draft trees: frontier selection while drafting, then a global rerank.

The drafter grows candidates level by level (as the reference's `topK_genrate`): level 1 holds
the root's top-K children; every later level holds a K*K block, K children (draft top-k) for each
of the K frontier nodes, the frontier being the top-K candidates of the previous level by
cumulative score (sum of draft log-probs along the path). Candidates are numbered in generation
order, so level 1 is [0, K), level l >= 2 is [K + (l-2)K^2, K + (l-1)K^2) in (frontier, rank)
order, and a candidate's parent always has a smaller index.

`expand_level` does one step's bookkeeping (scores, parents, next frontier). `rerank` then keeps
the `total_tokens - 1` best candidates overall and lays them out as the shared tree (root + nodes
in increasing candidate order, `parents_bn`, `valid_bn`).

Why the kept set is closed under ancestry, ties included: `jax.lax.top_k` is stable (equal
scores: lower index first), a parent has a lower index than its child, and a child's score is
<= its parent's (adding a log-prob <= 0 cannot raise a float; rounding is monotone). So whenever
a child is kept, its parent ranks strictly ahead of it (higher score, or equal score and lower
index) and is kept too.
`-inf` (masked) candidates are marked invalid; as a safety net for callers whose scores are not
monotone, any node whose parent was not kept is marked invalid together with its subtree.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def _clean(scores):
    """Float32 scores with NaN mapped to -inf (never selected ahead of a real candidate)."""
    scores = scores.astype(jnp.float32)
    return jnp.where(jnp.isnan(scores), -jnp.inf, scores)


def level_offset(level: int, k: int) -> int:
    """Index of the first candidate of `level` (1-based) in generation order."""
    if level < 1:
        raise ValueError(f"levels are numbered from 1, got {level}")
    return 0 if level == 1 else k + (level - 2) * k * k


def num_candidates(depth: int, k: int) -> int:
    """C: candidates of a `depth`-level draft with top-k `k` (K + (depth-1)*K^2)."""
    return level_offset(depth + 1, k) if depth >= 1 else 0


def select_frontier(cand_scores_bkk: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Top-`k` of a level's K*K cumulative scores (row = frontier node, column = child rank).

    Returns (flat_idx_bk int32 into the row-major K*K block, score_bk float32), best first; ties go
    to the lower flat index (stable `jax.lax.top_k`). Row = flat // K, rank = flat % K. Any
    [B, F, K] block works the same way (flat = f * K + rank)."""
    b = cand_scores_bkk.shape[0]
    flat = _clean(cand_scores_bkk.reshape(b, -1))
    score, idx = jax.lax.top_k(flat, k)
    return idx.astype(jnp.int32), score


class LevelExpansion(NamedTuple):
    """One drafted level: its candidate block and the frontier the next level grows from."""

    tokens_bc: jax.Array  # int32 [B, F*K] block tokens in (frontier node, rank) order
    scores_bc: jax.Array  # float32 [B, F*K] cumulative scores
    parents_bc: jax.Array  # int32 [B, F*K] parent candidate indices (-1: the root)
    frontier_cand_bk: jax.Array  # int32 [B, k] candidate indices of the next frontier, best first
    frontier_scores_bk: jax.Array  # float32 [B, k] their cumulative scores
    frontier_tokens_bk: jax.Array  # int32 [B, k] their tokens: the next draft step's inputs
    frontier_src_bk: jax.Array  # int32 [B, k] the input row (frontier node f) each one extends


def expand_level(frontier_scores_bf: jax.Array, frontier_cand_bf: jax.Array, topk_logp_bfk: jax.Array,
                 topk_tokens_bfk: jax.Array, level_start: int, k: int) -> LevelExpansion:
    """Bookkeeping of one draft step, as `topK_genrate` does it.

    Inputs: the current frontier's cumulative scores and candidate indices [B, F] (the root: F = 1,
    score 0, index -1), the draft's top-K log-probs and tokens for each frontier node [B, F, K],
    and this level's first candidate index (`level_offset`). A child's score is its parent's plus
    its log-prob; the next frontier is the top-`k` of the block (`select_frontier`). The draft's
    hidden state for next-frontier node j is the output at input row `frontier_src_bk[j]`."""
    b, f, kk = topk_logp_bfk.shape
    cu = _clean(frontier_scores_bf)[:, :, None] + topk_logp_bfk.astype(jnp.float32)
    tokens = topk_tokens_bfk.astype(jnp.int32).reshape(b, f * kk)
    flat, score = select_frontier(cu, k)
    return LevelExpansion(
        tokens_bc=tokens,
        scores_bc=_clean(cu.reshape(b, f * kk)),
        parents_bc=jnp.repeat(frontier_cand_bf.astype(jnp.int32), kk, axis=-1),
        frontier_cand_bk=level_start + flat,
        frontier_scores_bk=score,
        frontier_tokens_bk=jnp.take_along_axis(tokens, flat, axis=-1),
        frontier_src_bk=flat // kk,
    )


def rerank(cand_tokens_bc: jax.Array, cand_scores_bc: jax.Array, cand_parent_bc: jax.Array,
           root_token_b: jax.Array, total_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pick the `total_tokens - 1` best candidates and lay them out as a tree of `total_tokens`.

    Args: candidate tokens, cumulative scores and parent candidate indices (-1: child of the root)
    [B, C] in generation order, the root token [B], and the static budget N = `total_tokens`.
    Returns (tokens_bn int32, parents_bn int32, valid_bn bool), each [B, N]: node 0 is the root
    (parent -1); nodes 1..N-1 are the kept candidates in increasing candidate index. A node is
    valid iff its score is > -inf (not NaN) and its parent (hence every ancestor) was kept and is
    valid; invalid nodes carry token 0 and parent 0 so they are harmless if gathered."""
    b, c = cand_scores_bc.shape
    m = total_tokens - 1
    if not 0 <= m <= c:
        raise ValueError(f"total_tokens - 1 = {m} must be in [0, {c}] (the number of candidates)")
    scores = _clean(cand_scores_bc)
    _, top = jax.lax.top_k(scores, m)
    sel = jnp.sort(top, axis=-1).astype(jnp.int32)  # [B, M] kept candidates, parents first
    sel_scores = jnp.take_along_axis(scores, sel, axis=-1)
    sel_tokens = jnp.take_along_axis(cand_tokens_bc.astype(jnp.int32), sel, axis=-1)
    sel_parent = jnp.take_along_axis(cand_parent_bc.astype(jnp.int32), sel, axis=-1)

    # Candidate index -> node index (0 where the candidate was not kept; the root is node 0).
    rows = jnp.arange(b)[:, None]
    node_ids = jnp.arange(1, m + 1, dtype=jnp.int32)
    node_of_cand = jnp.zeros((b, c), jnp.int32).at[rows, sel].set(jnp.broadcast_to(node_ids, (b, m)))
    kept = jnp.zeros((b, c), bool).at[rows, sel].set(True)
    safe_parent = jnp.clip(sel_parent, 0, max(c - 1, 0))
    is_root_child = sel_parent < 0
    parent_kept = jnp.take_along_axis(kept, safe_parent, axis=-1) & (sel_parent < sel)
    parent_node = jnp.where(is_root_child, 0, jnp.take_along_axis(node_of_cand, safe_parent, axis=-1))
    ok = (sel_scores > -jnp.inf) & (is_root_child | parent_kept)

    # Close validity under ancestry by pointer jumping: after s rounds each node has checked its
    # ancestors at distances < 2^s; the root (node 0) is its own ancestor and always valid.
    ok_n = jnp.concatenate([jnp.ones((b, 1), bool), ok], axis=-1)
    anc_n = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.where(ok, parent_node, 0)], axis=-1)
    for _ in range(max(m, 1).bit_length()):
        ok_n = ok_n & jnp.take_along_axis(ok_n, anc_n, axis=-1)
        anc_n = jnp.take_along_axis(anc_n, anc_n, axis=-1)

    live = ok_n[:, 1:]
    tokens = jnp.concatenate([root_token_b.astype(jnp.int32)[:, None], jnp.where(live, sel_tokens, 0)],
                             axis=-1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), jnp.where(live, parent_node, 0)], axis=-1)
    return tokens, parents, ok_n
