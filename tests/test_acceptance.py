"""Tree acceptance: greedy against a pure-Python walk, greedy == sampling on one-hot targets, and
a chi-square losslessness test of sampled acceptance that is shown to reject biased samplers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from eagle_jax.sampling import SamplingParams, target_probs
from eagle_jax.tree import accept_from_logits, emitted_tokens, greedy_accept, path_tokens, sample_accept

greedy_jit = jax.jit(greedy_accept, static_argnums=4)
sample_jit = jax.jit(sample_accept, static_argnums=5)


def random_draft_trees(rng, b, n, d, vocab, p_valid=0.8):
    """Padded random trees whose valid siblings carry distinct tokens; invalid nodes have garbage
    parents and tokens."""
    tokens = rng.integers(0, vocab, size=(b, n)).astype(np.int32)
    parents = rng.integers(-1, n, size=(b, n)).astype(np.int32)
    valid = np.zeros((b, n), bool)
    for r in range(b):
        parents[r, 0], valid[r, 0] = -1, True
        depth, used = {0: 0}, {0: set()}
        for i in range(1, n):
            open_ = [j for j in depth if depth[j] < d and len(used[j]) < vocab]
            if rng.random() < p_valid and open_:
                j = int(rng.choice(open_))
                t = int(rng.choice(sorted(set(range(vocab)) - used[j])))
                used[j].add(t)
                tokens[r, i], parents[r, i], valid[r, i] = t, j, True
                depth[i], used[i] = depth[j] + 1, set()
    return tokens, parents, valid


def reference_greedy(tokens, parents, valid, argmax, d):
    """Walk from the root, following the child whose token is the target argmax."""
    path = [0]
    while True:
        kids = [i for i in range(1, len(tokens)) if valid[i] and parents[i] == path[-1]
                and tokens[i] == argmax[path[-1]]]
        if not kids:
            break
        path.append(kids[0])
    return path + [-1] * (d + 1 - len(path)), len(path) - 1, argmax[path[-1]]


def test_greedy_matches_reference_walk():
    rng = np.random.default_rng(0)
    b, n, d, vocab = 64, 12, 4, 3
    tokens, parents, valid = random_draft_trees(rng, b, n, d, vocab)
    argmax = rng.integers(0, vocab, size=(b, n)).astype(np.int32)
    acc = greedy_jit(*map(jnp.asarray, (tokens, parents, valid, argmax)), d)
    path, m, bonus = (np.asarray(x) for x in acc)
    assert np.bincount(m).size > 3  # the random trees exercise deep acceptances
    for r in range(b):
        ref_path, ref_m, ref_bonus = reference_greedy(tokens[r], parents[r], valid[r], argmax[r], d)
        np.testing.assert_array_equal(path[r], ref_path)
        assert (m[r], bonus[r]) == (ref_m, ref_bonus)
    toks = np.asarray(path_tokens(jnp.asarray(tokens), acc.path_bd))
    emitted = np.asarray(emitted_tokens(jnp.asarray(tokens), acc))
    for r in range(b):
        np.testing.assert_array_equal(emitted[r, :m[r]], toks[r, 1:m[r] + 1])
        assert emitted[r, m[r]] == bonus[r] and np.all(emitted[r, m[r] + 1:] == -1)


def test_sampling_with_one_hot_targets_is_greedy():
    rng = np.random.default_rng(1)
    b, n, d, vocab = 64, 12, 4, 3
    tokens, parents, valid = random_draft_trees(rng, b, n, d, vocab)
    argmax = rng.integers(0, vocab, size=(b, n))
    probs = jax.nn.one_hot(argmax, vocab)
    args = tuple(map(jnp.asarray, (tokens, parents, valid)))
    greedy = greedy_jit(*args, jnp.asarray(argmax), d)
    sampled = sample_jit(jax.random.key(0), *args, probs, d)
    for g, s in zip(greedy, sampled):
        np.testing.assert_array_equal(g, s)


def test_rows_are_independent_given_per_row_keys():
    rng = np.random.default_rng(2)
    b, n, d, vocab = 8, 10, 3, 4
    tokens, parents, valid = random_draft_trees(rng, b, n, d, vocab)
    probs = jnp.asarray(rng.dirichlet(np.ones(vocab), size=(b, n)), jnp.float32)
    keys = jax.random.split(jax.random.key(3), b)
    args = tuple(map(jnp.asarray, (tokens, parents, valid)))
    full = sample_jit(keys, *args, probs, d)
    for r in (0, 5):
        one = sample_jit(keys[r:r + 1], *(a[r:r + 1] for a in args), probs[r:r + 1], d)
        for x, y in zip(full, one):
            np.testing.assert_array_equal(x[r:r + 1], y)


def test_accept_from_logits_picks_greedy_or_sampling_per_row():
    rng = np.random.default_rng(3)
    b, n, d, vocab = 6, 10, 3, 5
    tokens, parents, valid = (jnp.asarray(x) for x in random_draft_trees(rng, b, n, d, vocab))
    logits = jnp.asarray(rng.normal(size=(b, n, vocab)) * 2, jnp.float32)
    key = jax.random.key(4)
    fn = jax.jit(accept_from_logits, static_argnums=6)
    greedy = greedy_jit(tokens, parents, valid, jnp.argmax(logits, -1), d)
    for g, x in zip(greedy, fn(key, tokens, parents, valid, logits, SamplingParams.create(b), d)):
        np.testing.assert_array_equal(g, x)
    sp = SamplingParams(temperature=jnp.array([0.0, 0.7, 0.0, 1.3, 1.0, 0.0]), top_p=jnp.full(b, 0.9),
                        top_k=jnp.array([0, 3, 0, 0, 2, 1], jnp.int32))
    probs = jax.jit(target_probs)(logits.reshape(b * n, vocab), jax.tree.map(lambda x: jnp.repeat(x, n), sp))
    sampled = sample_jit(key, tokens, parents, valid, probs.reshape(b, n, vocab), d)
    got = fn(key, tokens, parents, valid, logits, sp, d)
    rows = np.asarray(sp.greedy)
    for g, s, x in zip(greedy, sampled, got):
        np.testing.assert_array_equal(np.asarray(x)[rows], np.asarray(g)[rows])
        np.testing.assert_array_equal(np.asarray(x)[~rows], np.asarray(s)[~rows])


# ---- losslessness ----------------------------------------------------------------------------
# Target model: the next-token distribution after a prefix depends on (position, last token) via a
# fixed random table with zeros. The draft tree below includes a zero-probability draft (node 4),
# the same token under different parents (nodes 5 and 7), padding nodes with garbage parents, and
# up to three ranked children per node, so rejections and residual sampling all matter.

V, ROOT, L, DRAWS = 6, 2, 3, 40_000
TREE_PARENTS = np.array([-1, 0, 0, 9, 0, 1, 1, 2, 5, 11, 5, 7, 6])
TREE_VALID = np.array([1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1], bool)
TREE_RANKS = np.array([0, 0, 1, 0, -1, 0, 1, -2, 0, 0, 1, 0, 0])  # -1: zero-probability, -2: node 5's
DEPTH = 3


def target_table():
    rng = np.random.default_rng(4)
    table = rng.dirichlet(np.full(V, 0.8), size=(DEPTH + 1, V))
    table[rng.random(table.shape) < 0.25] = 0.0
    table[..., 0] += 1e-3  # every row keeps some mass
    table[0, ROOT, V - 1] = 0.0  # the root's context has a zero-probability token to draft
    return table / table.sum(-1, keepdims=True)


def lossless_setup():
    """Tree tokens (each node's rank-r most likely token under its parent's context) and the
    target distribution at every node."""
    table = target_table()
    n = len(TREE_PARENTS)
    tokens, depth = np.zeros(n, np.int64), np.zeros(n, np.int64)
    tokens[0] = ROOT
    for i in range(1, n):
        p = max(TREE_PARENTS[i], 0)
        depth[i] = depth[p] + 1
        dist = table[depth[p], tokens[p]]
        order = np.argsort(-dist, kind="stable")
        rank = TREE_RANKS[i]
        tokens[i] = order[rank] if rank >= 0 else np.flatnonzero(dist == 0)[0] if rank == -1 else tokens[5]
    probs = table[depth, tokens]
    for j in range(n):  # the contract: valid siblings carry distinct tokens
        sib = tokens[TREE_VALID & (TREE_PARENTS == j) & (np.arange(n) > 0)]
        assert len(set(sib)) == len(sib)
    assert probs[0, tokens[4]] == 0 and probs[0, tokens[1]] > 0 and probs[0, tokens[2]] > 0
    return table, tokens, probs


def exact_prefix_distribution(table):
    """P(y1..yL) of plain autoregressive sampling from the target after the root."""
    joint = np.ones((1,))
    prev = np.array([ROOT])
    for pos in range(L):
        joint = (joint[:, None] * table[pos, prev]).reshape(-1)
        prev = np.tile(np.arange(V), V ** pos)
    return joint  # index: y1 * V^(L-1) + ... + yL


def complete_and_count(emitted, table, rng):
    """Extend each draw's emitted tokens (>= 1 of them) to L tokens by sampling the target itself,
    then count the L-token prefixes. Lossless iff these are distributed as the exact target."""
    seq = np.full((len(emitted), L), -1)
    k = min(L, emitted.shape[1])
    seq[:, :k] = emitted[:, :k]
    prev = np.full(len(emitted), ROOT)
    for pos in range(L):
        need = seq[:, pos] < 0
        cdf = np.cumsum(table[pos, prev[need]], axis=-1)
        u = rng.random(need.sum())[:, None] * cdf[:, -1:]
        seq[need, pos] = np.minimum((u >= cdf).sum(-1), V - 1)
        prev = seq[:, pos]
    return np.bincount(seq @ (V ** np.arange(L - 1, -1, -1)), minlength=V ** L)


def chi2_pvalue(counts, probs):
    expected = probs * counts.sum()
    if counts[expected == 0].any():  # a sequence the target can never produce
        return 0.0
    big = expected >= 5
    obs = np.r_[counts[big], counts[~big].sum()]
    exp = np.r_[expected[big], expected[~big].sum()]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def numpy_specinfer(tokens, probs, rng, bug=None):
    """The textbook sequential recursive rejection sampler (vectorised over draws), optionally
    with a bug: 'no_renorm' (acceptance ratio uses the original, not the residual, mass),
    'no_residual' (bonus drawn from p, rejected drafts not zeroed) or 'always' (accept any child
    with p(x) > 0)."""
    n = len(tokens)
    kids = [[i for i in range(1, n) if TREE_VALID[i] and TREE_PARENTS[i] == j] for j in range(n)]
    width = max(map(len, kids))
    kid_table = np.array([k + [-1] * (width - len(k)) for k in kids])
    out = np.full((DRAWS, DEPTH + 1), -1)
    cur = np.zeros(DRAWS, np.int64)
    done = np.zeros(DRAWS, bool)
    rows = np.arange(DRAWS)
    for depth in range(DEPTH + 1):
        p = probs[cur].copy()
        total0 = p.sum(-1)
        chosen = np.full(DRAWS, -1)
        for slot in range(width if depth < DEPTH else 0):
            ch = kid_table[cur, slot]
            active = ~done & (chosen < 0) & (ch >= 0)
            x = tokens[np.maximum(ch, 0)]
            px = p[rows, x]
            ratio = px / (total0 if bug == "no_renorm" else np.maximum(p.sum(-1), 1e-300))
            ok = active & ((px > 0) if bug == "always" else (rng.random(DRAWS) < ratio))
            chosen[ok] = ch[ok]
            p[active & ~ok, x[active & ~ok]] = 0.0
        step = ~done & (chosen >= 0)
        out[step, depth] = tokens[chosen[step]]
        cur[step] = chosen[step]
        stop = ~done & ~step
        cdf = np.cumsum((probs[cur] if bug == "no_residual" else p)[stop], -1)
        out[stop, depth] = (rng.random(stop.sum())[:, None] * cdf[:, -1:] >= cdf).sum(-1)
        done |= stop
    return out


@pytest.fixture(scope="module")
def lossless():
    return lossless_setup()


def test_sample_accept_is_lossless(lossless):
    table, tokens, probs = lossless
    bcast = lambda x: jnp.broadcast_to(jnp.asarray(x), (DRAWS,) + np.shape(x))
    acc = sample_jit(jax.random.key(5), bcast(tokens), bcast(TREE_PARENTS), bcast(TREE_VALID),
             bcast(probs.astype(np.float32)), DEPTH)
    emitted = np.asarray(emitted_tokens(bcast(tokens), acc))
    m = np.asarray(acc.num_accepted_b)
    assert np.bincount(m, minlength=DEPTH + 1).min() > 100  # every acceptance length occurs
    path = np.asarray(acc.path_bd)
    assert not np.isin(np.flatnonzero(~TREE_VALID), path).any() and not (path == 4).any()
    counts = complete_and_count(emitted, table, np.random.default_rng(6))
    assert chi2_pvalue(counts, exact_prefix_distribution(table)) > 1e-3


@pytest.mark.parametrize("bug,passes", [(None, True), ("no_renorm", False), ("no_residual", False),
                                       ("always", False)])
def test_chi_square_accepts_specinfer_and_rejects_biased_samplers(lossless, bug, passes):
    table, tokens, probs = lossless
    rng = np.random.default_rng(7)
    emitted = numpy_specinfer(tokens, probs, rng, bug)
    pvalue = chi2_pvalue(complete_and_count(emitted, table, rng), exact_prefix_distribution(table))
    assert pvalue > 1e-3 if passes else pvalue < 1e-6
