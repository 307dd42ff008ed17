"""Prompt-lookup chains: the n-gram search against a plain Python one, and the graft onto a draft
tree keeping the tree contract (parents first, distinct siblings, the chain's tokens on one path)."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.draft import TreeBudget
from eagle_jax.tree import DEFAULT_STATIC_TREE, effective_parents, node_depths
from eagle_jax.tree.lookup import graft_chain, lookup_chain


def _lookup_ref(seq: list[int], num: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """The continuation of the latest earlier occurrence of the longest matching suffix n-gram."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(seq) <= n:
            continue
        for st in range(len(seq) - n - 1, -1, -1):
            if seq[st:st + n] == seq[-n:]:
                return seq[st + n:st + n + num]
    return []


@pytest.mark.parametrize("num,max_ngram,min_ngram", [(1, 1, 1), (4, 2, 1), (6, 3, 1), (4, 3, 2), (5, 3, 3)])
def test_lookup_chain_matches_a_plain_search(num, max_ngram, min_ngram):
    rng = np.random.default_rng(num * 10 + max_ngram)
    b, s = 64, 40
    tokens = rng.integers(0, {1: 5, 2: 3, 3: 2}[min_ngram], (b, s))  # few symbols: many repeats, some rows without any
    tokens[:8] = np.arange(s)[None] + 100  # no repeats at all: no chain
    length = rng.integers(1, s + 1, b)
    toks, ok = lookup_chain(jnp.asarray(tokens), jnp.asarray(length), num, max_ngram, min_ngram)
    toks, ok = np.asarray(toks), np.asarray(ok)
    for i in range(b):
        want = _lookup_ref(tokens[i, :length[i]].tolist(), num, max_ngram, min_ngram)
        k = int(ok[i].sum())
        assert ok[i].tolist() == [True] * k + [False] * (num - k)  # a prefix
        assert toks[i, :k].tolist() == want, (i, tokens[i, :length[i]].tolist())
    assert not ok[:8].any()
    assert ok.any(axis=1).mean() > 0.5


def test_lookup_chain_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num"):
        lookup_chain(jnp.zeros((1, 4), jnp.int32), jnp.array([3]), 0)
    with pytest.raises(ValueError, match="lookup"):
        TreeBudget("dynamic", total_tokens=4, depth=2, top_k=2, lookup=-1)


def _tree():
    """Root 7 with children 1, 2; 1 → 3, 4; 3 → 5; one padding node (index 6, token 9)."""
    tokens = [7, 1, 2, 3, 4, 5, 9]
    parents = [-1, 0, 0, 1, 1, 3, 2]
    valid = [True] * 6 + [False]
    return (jnp.asarray([tokens]), jnp.asarray([parents]), jnp.asarray([valid]))


@pytest.mark.parametrize("chain,chain_ok,new", [
    ([1, 3, 5, 8], [1, 1, 1, 1], [False, False, False, True]),  # along 1 → 3 → 5, then a new 8
    ([1, 4, 4, 4], [1, 1, 1, 1], [False, False, True, True]),   # along 1 → 4, then new below 4
    ([2, 9, 9, 9], [1, 1, 1, 0], [False, True, True, False]),  # 9 under 2 is padding, not a child
    ([6, 1, 3, 5], [1, 1, 1, 1], [True, True, True, True]),    # off the tree at once: all new
    ([1, 3, 5, 8], [0, 0, 0, 0], [False, False, False, False]),  # no chain
])
def test_graft_chain_follows_the_tree_then_adds_nodes(chain, chain_ok, new):
    tokens, parents, valid = _tree()
    t, p, v = graft_chain(tokens, parents, valid, jnp.asarray([chain]), jnp.asarray([chain_ok], bool))
    t, p, v = np.asarray(t)[0], np.asarray(p)[0], np.asarray(v)[0]
    assert t[:7].tolist() == np.asarray(tokens)[0].tolist() and p[:7].tolist() == np.asarray(parents)[0].tolist()
    assert v[:7].tolist() == np.asarray(valid)[0].tolist()
    assert v[7:].tolist() == new
    # The contract: parents first and valid, siblings distinct.
    eff = np.asarray(effective_parents(jnp.asarray([p]), jnp.asarray([v])))[0]
    for i in np.flatnonzero(v)[1:]:
        assert 0 <= eff[i] < i and v[p[i]]
    kids = [(eff[i], t[i]) for i in np.flatnonzero(v)[1:]]
    assert len(kids) == len(set(kids))
    # The valid chain prefix is one root path; its last node sits at depth = prefix length.
    k = int(np.asarray(chain_ok).sum())
    if k:
        depth = np.asarray(node_depths(jnp.asarray([p]), jnp.asarray([v]), 4))[0]
        ends = [i for i in np.flatnonzero(v) if depth[i] == k]
        paths = []
        for i in ends:
            path, j = [], i
            while j > 0:
                path.append(int(t[j]))
                j = p[j]
            paths.append(path[::-1])
        assert chain[:k] in paths


def test_budget_counts_the_chain():
    b = TreeBudget("dynamic", total_tokens=8, depth=2, top_k=2, lookup=5)  # the chain takes rows of the tree
    assert (b.num_nodes, b.draft_depth, b.max_depth) == (8, 3, 5)
    b = TreeBudget("dynamic", total_tokens=12, depth=4, top_k=3, lookup=2)
    assert (b.num_nodes, b.max_depth) == (12, 5)
    s = TreeBudget("static", static_tree=DEFAULT_STATIC_TREE, lookup=3)  # a static tree's chain comes on top
    assert (s.num_nodes, s.max_depth) == (DEFAULT_STATIC_TREE.num_nodes + 3, max(DEFAULT_STATIC_TREE.depth, 3))
    with pytest.raises(ValueError, match="root and one node"):
        TreeBudget("dynamic", total_tokens=4, depth=2, top_k=2, lookup=3)
    with pytest.raises(ValueError, match="lookup_min_ngram"):
        TreeBudget("dynamic", total_tokens=8, depth=2, top_k=2, lookup=3, lookup_min_ngram=4)  # above lookup_ngram
    with pytest.raises(ValueError, match="lookup_min_ngram"):
        TreeBudget("dynamic", total_tokens=8, depth=2, top_k=2, lookup=3, lookup_min_ngram=0)
    # without a chain the n-gram minimum changes nothing, so it is one budget (one compiled program)
    assert TreeBudget("dynamic", total_tokens=8, depth=2, top_k=2, lookup_min_ngram=3) == TreeBudget(
        "dynamic", total_tokens=8, depth=2, top_k=2)
