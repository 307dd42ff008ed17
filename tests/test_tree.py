"""Draft trees: static tree validation and layout, device buffers against a pure-Python reference
on random padded trees, and EAGLE-2 reranking against a numpy re-implementation of the reference
`topK_genrate` selection (ties and -inf candidates included)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.tree import (DEFAULT_STATIC_TREE, PRIORITY_PATHS, StaticTree, ancestor_mask, expand_level, is_leaf,
                            level_offset, node_depths, num_candidates, path_to, rerank, retrieve_indices,
                            select_frontier, static_tree_of_size, tree_buffers, tree_positions)

expand_jit = jax.jit(expand_level, static_argnums=(4, 5))
rerank_jit = jax.jit(rerank, static_argnums=4)
HAND = [(1, 0), (0,), (0, 0, 0), (1,), (0, 1), (0, 0)]  # deliberately out of order


# ---- static trees ----------------------------------------------------------------------------

@pytest.mark.parametrize("paths,msg", [
    ([(0,), (0, 0, 0)], "prefix"),
    ([(0,), (1, 0)], "prefix"),
    ([(0,), (0,)], "duplicate"),
    ([(0,), (-1,)], ">= 0"),
    ([(0,), ()], "root"),
    ([(0,), (0.5,)], "integers"),
    ([(0,), "01"], "sequence"),
    ([], "at least one"),
])
def test_static_tree_rejects_malformed_paths(paths, msg):
    with pytest.raises(ValueError, match=msg):
        StaticTree(paths)


def test_static_tree_layout_of_a_hand_written_tree():
    t = StaticTree(HAND)
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (t.num_nodes, t.depth, t.top_k, t.max_width) == (7, 3, 2, 3)
    np.testing.assert_array_equal(t.parents, [-1, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(t.ranks, [0, 0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(t.depths, [0, 1, 1, 2, 2, 2, 3])
    assert [lv.tolist() for lv in t.levels()] == [[1, 2], [3, 4, 5], [6]]
    plan = t.level_plan()
    assert [p.frontier.tolist() for p in plan] == [[0], [1, 2], [3]]
    assert [p.frontier_pos.tolist() for p in plan] == [[0], [0, 1], [0]]
    assert [p.parent_pos.tolist() for p in plan] == [[0, 0], [0, 0, 1], [0]]
    assert [p.parent_frontier_pos.tolist() for p in plan] == [[0, 0], [0, 0, 1], [0]]
    assert [p.ranks.tolist() for p in plan] == [[0, 1], [0, 1, 0], [0]]
    assert t.path_of(5) == (1, 0) and t.path_of(0) == ()
    # canonical: order of the input does not matter for equality, hashing or the json form
    same = StaticTree(tuple(reversed(HAND)))
    assert same == t and hash(same) == hash(t)
    assert StaticTree.from_json(t.to_json()) == t
    assert StaticTree.from_json(json.dumps(t.to_json())) == t
    with pytest.raises(ValueError):
        t.parents[0] = 3  # cached arrays are read-only


@pytest.mark.parametrize("tree", [DEFAULT_STATIC_TREE, StaticTree(HAND)])
def test_level_plan_is_consistent(tree):
    assert 16 <= DEFAULT_STATIC_TREE.num_nodes <= 26 and 5 <= DEFAULT_STATIC_TREE.depth <= 6
    assert DEFAULT_STATIC_TREE.top_k <= 4
    par, idx = tree.parents, np.arange(tree.num_nodes)
    assert par[0] == -1 and np.all(par[1:] < idx[1:])
    prev = np.array([0])
    covered = [0]
    for p in tree.level_plan():
        np.testing.assert_array_equal(prev[p.parent_pos], par[p.nodes])
        np.testing.assert_array_equal(p.frontier[p.parent_frontier_pos], par[p.nodes])
        np.testing.assert_array_equal(prev[p.frontier_pos], p.frontier)
        np.testing.assert_array_equal(p.ranks, tree.ranks[p.nodes])
        assert np.all(tree.depths[p.nodes] == p.depth)
        for f in p.frontier:  # siblings: distinct ranks, in rank order
            r = tree.ranks[p.nodes[par[p.nodes] == f]]
            assert np.all(np.diff(r) > 0)
        covered += p.nodes.tolist()
        prev = p.nodes
    assert covered == list(range(tree.num_nodes))


def test_sized_static_trees_are_prefixes_of_the_default_tree():
    """Every size from 2 to 20 nodes is a tree (each path after its parent), the next size adds one
    path, and 20 nodes are the default tree."""
    assert set(PRIORITY_PATHS) == set(DEFAULT_STATIC_TREE.paths) and len(PRIORITY_PATHS) == len(set(PRIORITY_PATHS))
    prev = set()
    for n in range(2, 21):
        tree = static_tree_of_size(n)
        assert tree.num_nodes == n and prev < set(tree.paths) and len(set(tree.paths) - prev) == 1
        prev = set(tree.paths)
    assert static_tree_of_size(20) == DEFAULT_STATIC_TREE
    assert static_tree_of_size(2).paths == ((0,),) and static_tree_of_size(3).paths == ((0,), (1,))
    for bad in (1, 21):
        with pytest.raises(ValueError, match="2 to 20 nodes"):
            static_tree_of_size(bad)


def test_static_tree_is_a_jit_static_argument():
    traces = []

    def f(tree, x):
        traces.append(tree)
        par = jnp.broadcast_to(jnp.asarray(tree.parents), (x.shape[0], tree.num_nodes))
        return node_depths(par, jnp.ones_like(par, bool), tree.depth) + x[:, None]

    g = jax.jit(f, static_argnums=0)
    out = g(StaticTree(HAND), jnp.zeros((2,), jnp.int32))
    g(StaticTree(list(reversed(HAND))), jnp.ones((2,), jnp.int32))
    assert len(traces) == 1
    np.testing.assert_array_equal(out[0], StaticTree(HAND).depths)


# ---- buffers on random padded trees ----------------------------------------------------------

def random_trees(rng, b, n, d, p_valid=0.7):
    """Padded random trees: invalid nodes interleaved, with garbage parents (even >= own index)."""
    parents = np.zeros((b, n), np.int32)
    valid = np.zeros((b, n), bool)
    for r in range(b):
        parents[r, 0], valid[r, 0] = -1, True
        depth = {0: 0}
        for i in range(1, n):
            if rng.random() < p_valid:
                choices = [j for j in depth if depth[j] < d]
                j = int(rng.choice(choices))
                parents[r, i], valid[r, i], depth[i] = j, True, depth[j] + 1
            else:
                parents[r, i] = rng.integers(-1, n)
    return parents, valid


def reference_buffers(parents, valid):
    """Pure-Python mask, depths, leaves and leaf paths of one tree."""
    n = len(parents)
    paths = {}
    for i in range(n):
        if valid[i]:
            path, j = [i], i
            while j != 0:
                j = parents[j]
                path.append(j)
            paths[i] = path[::-1]
    mask = np.eye(n, dtype=bool)
    for i, path in paths.items():
        mask[i, path] = True
    depth = np.array([len(paths[i]) - 1 if i in paths else 0 for i in range(n)])
    children = {parents[i] for i in paths if i != 0}
    leaves = {i for i in paths if i not in children}
    return mask, depth, leaves, paths


def test_buffers_match_reference_on_random_padded_trees():
    rng = np.random.default_rng(0)
    b, n, d = 24, 13, 4
    parents, valid = random_trees(rng, b, n, d)
    bufs = jax.jit(tree_buffers, static_argnums=2)(jnp.asarray(parents), jnp.asarray(valid), d)
    mask, depth, leaf, ri = (np.asarray(x) for x in (bufs.mask_bnn, bufs.depth_bn, bufs.is_leaf_bn, bufs.ri_bnd))
    # the stand-alone functions agree with the bundled computation
    p_j, v_j = jnp.asarray(parents), jnp.asarray(valid)
    np.testing.assert_array_equal(jax.jit(ancestor_mask, static_argnums=2)(p_j, v_j, d), mask)
    np.testing.assert_array_equal(jax.jit(node_depths, static_argnums=2)(p_j, v_j, d), depth)
    np.testing.assert_array_equal(jax.jit(retrieve_indices, static_argnums=2)(p_j, v_j, d), ri)
    np.testing.assert_array_equal(jax.jit(is_leaf)(p_j, v_j), leaf)
    assert ri.shape == (b, n, d + 1)
    positions = np.asarray(tree_positions(bufs.depth_bn, 17 + jnp.arange(b)))

    for r in range(b):
        ref_mask, ref_depth, ref_leaves, ref_paths = reference_buffers(parents[r], valid[r])
        np.testing.assert_array_equal(mask[r], ref_mask)
        np.testing.assert_array_equal(depth[r], ref_depth)
        assert set(np.flatnonzero(leaf[r])) == ref_leaves
        rows = [tuple(x for x in row if x >= 0) for row in ri[r] if row[0] >= 0]
        assert sorted(rows) == sorted(tuple(ref_paths[i]) for i in ref_leaves)  # each leaf exactly once
        for i in range(n):
            assert np.all(ri[r, i] == -1) or (i in ref_leaves and ri[r, i, depth[r, i]] == i)
            if i in ref_paths:
                np.testing.assert_array_equal(np.asarray(bufs.paths_bnd)[r, i][:depth[r, i] + 1], ref_paths[i])

        v = valid[r]
        m = mask[r].astype(int)
        assert np.all((m @ m > 0) <= mask[r])  # transitively closed
        assert np.all(mask[r][v, 0]) and np.all(np.diag(mask[r]))  # root and self
        assert not mask[r][np.ix_(v, ~v)].any()  # no valid row sees an invalid node
        assert np.all(mask[r][~v].sum(1) == 1)  # invalid rows: only themselves
        assert np.all(mask[r].sum(1) - 1 == depth[r])  # depth = number of strict ancestors
        np.testing.assert_array_equal(positions[r], 17 + r + ref_depth)
        assert not np.isin(np.flatnonzero(~v), ri[r]).any()  # invalid nodes never retrieved


def test_path_to_matches_reference():
    rng = np.random.default_rng(1)
    b, n, d = 16, 11, 5
    parents, valid = random_trees(rng, b, n, d)
    nodes = np.array([rng.choice(np.flatnonzero(valid[r])) for r in range(b)], np.int32)
    got = np.asarray(jax.jit(path_to, static_argnums=2)(jnp.asarray(nodes), jnp.asarray(parents), d))
    for r in range(b):
        path = reference_buffers(parents[r], valid[r])[3][nodes[r]]
        np.testing.assert_array_equal(got[r], path + [-1] * (d + 1 - len(path)))


# ---- EAGLE-2 rerank --------------------------------------------------------------------------

def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


def simulate_draft(rng, b, k, levels, vocab):
    """Random draft log-probs drafted with `expand_level` (batched) and, row by row, with a numpy
    transcription of the reference's topK_genrate bookkeeping (scores_list, ss_token, parents_list).
    Asserts both agree level by level; returns ours (tokens, scores, parents) and the reference's."""
    ours, refs = [], []
    fs, fc = jnp.zeros((b, 1)), jnp.full((b, 1), -1)
    ref_state = [None] * b
    for lvl in range(levels):
        lp = _log_softmax(rng.normal(size=(b, 1 if lvl == 0 else k, vocab)) * 2)
        topi = np.argsort(-lp, axis=-1, kind="stable")[..., :k]
        topp = np.take_along_axis(lp, topi, -1)
        e = expand_jit(fs, fc, jnp.asarray(topp), jnp.asarray(topi), level_offset(lvl + 1, k), k)
        ours.append(e)
        fs, fc = e.frontier_scores_bk, e.frontier_cand_bk
        for r in range(b):
            if lvl == 0:  # the root's top-k; the whole level is the first frontier
                scores, frontier = topp[r, 0], np.arange(k)
                ref_state[r] = ([scores], [topi[r, 0]], [np.zeros(1, np.int64)], scores, frontier)
            else:
                s_list, t_list, p_list, scores, frontier = ref_state[r]
                i = lvl - 1
                p_list.append(frontier + 1 + k * k * max(0, i - 1) + (k if i > 0 else 0))
                cu = (topp[r] + scores[:, None]).astype(np.float32)
                frontier = np.argsort(-cu.reshape(-1), kind="stable")[:k]
                scores = cu.reshape(-1)[frontier]
                s_list.append(cu.reshape(-1))
                t_list.append(topi[r].reshape(-1))
                ref_state[r] = (s_list, t_list, p_list, scores, frontier)
            np.testing.assert_array_equal(np.asarray(e.frontier_cand_bk)[r], level_offset(lvl + 1, k) + frontier)
            np.testing.assert_array_equal(np.asarray(e.frontier_scores_bk)[r], scores)
            src = np.asarray(e.frontier_src_bk)[r]
            np.testing.assert_array_equal(np.asarray(e.frontier_tokens_bk)[r], topi[r][src, frontier % k])
    cat = lambda name: np.concatenate([np.asarray(getattr(e, name)) for e in ours], axis=1)
    refs = [tuple(np.concatenate(x) for x in st[:3]) for st in ref_state]
    return (cat("tokens_bc"), cat("scores_bc"), cat("parents_bc")), refs


def reference_select(scores, tokens, parents_list, root, total_tokens, k):
    """The reference's final selection: tokens, parent node indices and tree position ids."""
    m = total_tokens - 1
    top = np.sort(np.argsort(-scores, kind="stable")[:m])
    draft_parents = parents_list[top // k]
    mask_index = np.searchsorted(top, draft_parents - 1)
    mask_index[draft_parents == 0] = -1
    mask_index = mask_index + 1
    tree_mask = np.eye(total_tokens, dtype=bool)
    tree_mask[:, 0] = True
    for i in range(m):
        tree_mask[i + 1] |= tree_mask[mask_index[i]]
    return np.r_[root, tokens[top]], np.r_[-1, mask_index], tree_mask.sum(1) - 1


def test_rerank_matches_reference_selection():
    rng = np.random.default_rng(2)
    k, levels, vocab, b = 4, 5, 50, 4
    (tokens, scores, parents), refs = simulate_draft(rng, b, k, levels, vocab)
    assert scores.shape == (b, num_candidates(levels, k))
    for r in range(b):
        np.testing.assert_array_equal(scores[r], refs[r][0])
        np.testing.assert_array_equal(tokens[r], refs[r][1])
    root = rng.integers(0, vocab, size=b)
    fn = rerank_jit
    for total in (8, 21, 30):
        tok, par, val = (np.asarray(x) for x in fn(jnp.asarray(tokens), jnp.asarray(scores), jnp.asarray(parents),
                                                   jnp.asarray(root), total))
        assert val.all()
        depth = np.asarray(node_depths(jnp.asarray(par), jnp.asarray(val), levels))
        for r in range(b):
            ref_tok, ref_par, ref_pos = reference_select(*refs[r], root[r], total, k)
            np.testing.assert_array_equal(tok[r], ref_tok)
            np.testing.assert_array_equal(par[r], ref_par)
            np.testing.assert_array_equal(depth[r], ref_pos)


def random_candidates(rng, b, c, step_choices):
    """Random candidate forests: parent < child (or -1), score = parent's score + a step <= 0."""
    parents = np.zeros((b, c), np.int32)
    scores = np.zeros((b, c), np.float32)
    for r in range(b):
        for i in range(c):
            parents[r, i] = rng.integers(-1, i)
            base = 0.0 if parents[r, i] < 0 else scores[r, parents[r, i]]
            scores[r, i] = base + rng.choice(step_choices)
    return parents, scores


def _check_closed(tok, par, val):
    for r in range(len(val)):
        for i in np.flatnonzero(val[r])[1:]:
            assert 0 <= par[r, i] < i and val[r, par[r, i]], (r, i)
        assert np.all(tok[r][~val[r]] == 0) and np.all(par[r][~val[r]] == 0)


@pytest.mark.parametrize("steps", [(0.0,), (0.0, 0.0, -1.0), (0.0, -0.5, -1.0, -jnp.inf)])
def test_rerank_is_ancestor_closed_under_ties_and_masks(steps):
    rng = np.random.default_rng(3)
    b, c, total = 16, 40, 25
    cand_par, scores = random_candidates(rng, b, c, steps)
    tokens = rng.integers(1, 100, size=(b, c))
    tok, par, val = (np.asarray(x) for x in rerank_jit(
        jnp.asarray(tokens), jnp.asarray(scores), jnp.asarray(cand_par), jnp.zeros(b, jnp.int32), total))
    _check_closed(tok, par, val)
    for r in range(b):  # the kept set is the stable top-(N-1), mapped in candidate order
        top = np.sort(np.argsort(-scores[r], kind="stable")[:total - 1])
        finite = np.isfinite(scores[r][top])
        np.testing.assert_array_equal(val[r, 1:], finite)
        np.testing.assert_array_equal(tok[r, 1:][finite], tokens[r][top][finite])
    if steps == (0.0,):  # all ties: the first N-1 candidates
        np.testing.assert_array_equal(tok[:, 1:], tokens[:, :total - 1])


@pytest.mark.parametrize("total,val,tok,par", [
    # candidates 0, 2, 3, 5, 6 kept: 2, 3 hang off the masked (dropped) 1, 5 off the dropped 4
    (6, [1, 1, 0, 0, 0, 1], [7, 10, 0, 0, 0, 16], [-1, 0, 0, 0, 0, 1]),
    # candidates 0..6 kept: the masked 1 is kept but invalid, and so is its finite subtree
    (8, [1, 1, 0, 0, 0, 1, 1, 1], [7, 10, 0, 0, 0, 14, 15, 16], [-1, 0, 0, 0, 0, 0, 5, 1]),
])
def test_rerank_drops_subtrees_of_masked_or_dropped_parents(total, val, tok, par):
    # candidate 1 is masked (-inf) but its children 2, 3 carry finite (non-monotone) scores;
    # candidate 4 scores low, 7 is NaN (treated as -inf).
    cand_par = np.array([[-1, -1, 1, 1, -1, 4, 0, 6]])
    scores = np.array([[-0.1, -np.inf, -0.2, -0.3, -5.0, -0.4, -0.5, np.nan]], np.float32)
    tokens = np.arange(10, 18)[None]
    got_tok, got_par, got_val = (np.asarray(x) for x in rerank_jit(
        jnp.asarray(tokens), jnp.asarray(scores), jnp.asarray(cand_par), jnp.array([7]), total))
    np.testing.assert_array_equal(got_val[0], np.array(val, bool))
    np.testing.assert_array_equal(got_tok[0], tok)
    np.testing.assert_array_equal(got_par[0], par)
    _check_closed(got_tok, got_par, got_val)
    mask = np.asarray(ancestor_mask(jnp.asarray(got_par), jnp.asarray(got_val), 3))[0]
    assert not mask[np.ix_(got_val[0], ~got_val[0])].any()


def test_select_frontier_breaks_ties_by_lower_index():
    scores = jnp.asarray([[[0.0, -1.0], [0.0, 0.0]], [[-np.inf, np.nan], [-2.0, -2.0]]], jnp.float32)
    idx, val = select_frontier(scores, 3)
    np.testing.assert_array_equal(idx, [[0, 2, 3], [2, 3, 0]])
    np.testing.assert_array_equal(val[1], [-2.0, -2.0, -np.inf])
    with pytest.raises(ValueError, match="total_tokens"):
        rerank(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4)), jnp.full((1, 4), -1), jnp.zeros(1, jnp.int32), 6)
