"""Prompt-lookup branches: a chain of tokens copied from the context, grafted onto a draft tree.

Small targets repeat themselves and their prompts (a name, a signature, a phrase said twice). The
head's tree often misses such a run where a plain n-gram lookup gets it whole, so a step may add one
chain of `L` tokens found by lookup to the head's tree: the last `n` committed tokens (the root
included, n = max_ngram … min_ngram, longest first) are searched for in the committed sequence,
and the `L` tokens that followed their latest earlier occurrence are proposed.

Grafting keeps siblings distinct (the tree contract): the chain walks down the head's tree while
its tokens match an existing child and is attached as new nodes from where it leaves the tree.
Verification is unchanged and stays lossless for greedy and sampled rows alike: every tree node is
a deterministic candidate (`tree.acceptance`), whichever proposer put it there. Where the rows go
is the caller's choice (`speculative.propose_tree`): a dynamic tree keeps its size, the chain
taking the rows of the head's weakest nodes in the batch rows where it adds any.

Shapes are static: `lookup_chain` compares B×S windows for each n-gram length (no host loop), and
`graft_chain` appends exactly `L` nodes, invalid where the chain ran along the tree, had no match,
or would run past the committed tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .buffers import effective_parents


def lookup_chain(tokens_bs: jax.Array, length_b: jax.Array, num: int, max_ngram: int = 3, min_ngram: int = 1):
    """The continuation of the latest earlier occurrence of the sequence's last n tokens.

    tokens_bs [B, S] holds each row's tokens in [0, length); the last one is the root. For n from
    `max_ngram` down to `min_ngram` the first n with an occurrence ending before the root wins. Returns
    (tokens [B, num] int32, valid [B, num] bool); valid is a prefix (no match, or the copy reaching
    the root's position, ends it)."""
    if num < 1 or not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need num >= 1 and 1 <= min_ngram <= max_ngram, got {num}, {min_ngram}, {max_ngram}")
    b, s = tokens_bs.shape
    tokens = tokens_bs.astype(jnp.int32)
    length = length_b.astype(jnp.int32)
    pos = jnp.arange(s, dtype=jnp.int32)[None, :]
    start = jnp.full((b,), -1, jnp.int32)  # where the copied continuation begins
    for n in range(max_ngram, min_ngram - 1, -1):
        pat = jnp.take_along_axis(tokens, jnp.clip(length[:, None] - n + jnp.arange(n)[None, :], 0, s - 1), axis=1)
        hit = (pos + n < length[:, None]) & (length[:, None] > n)  # the window ends before the root
        for k in range(n):  # window at st: tokens[st + k] == pat[k]
            shifted = jnp.pad(tokens[:, k:], ((0, 0), (0, k)), constant_values=-1)
            hit = hit & (shifted == pat[:, k:k + 1])
        latest = jnp.max(jnp.where(hit, pos, -1), axis=1)
        start = jnp.where((start < 0) & (latest >= 0), latest + n, start)
    idx = start[:, None] + jnp.arange(num, dtype=jnp.int32)[None, :]
    valid = (start[:, None] >= 0) & (idx < length[:, None])
    return jnp.take_along_axis(tokens, jnp.clip(idx, 0, s - 1), axis=1), valid


def graft_chain(tokens_bn: jax.Array, parents_bn: jax.Array, valid_bn: jax.Array, chain_bl: jax.Array,
                chain_valid_bl: jax.Array):
    """A tree of N + L nodes: the draft tree (nodes 0..N-1, unchanged) and the chain's new nodes.

    Chain token l sits at depth l + 1 below the root. While it equals a valid child of the node the
    chain has reached, the chain follows that child (node N + l stays invalid); from the first
    token that is not in the tree on, node N + l is a new child of the previous chain node. Returns
    (tokens [B, N+L], parents [B, N+L], valid [B, N+L])."""
    b, n = tokens_bn.shape
    num = chain_bl.shape[1]
    tokens = tokens_bn.astype(jnp.int32)
    eff = effective_parents(parents_bn, valid_bn)
    cur = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    new_tok, new_par, new_valid = [], [], []
    for l in range(num):
        t = chain_bl[:, l].astype(jnp.int32)
        alive = alive & chain_valid_bl[:, l]
        match = (eff == cur[:, None]) & (tokens == t[:, None])  # appended nodes have no tree children
        in_tree = jnp.any(match, axis=1)
        new_tok.append(t)
        new_par.append(cur)
        new_valid.append(alive & ~in_tree)
        cur = jnp.where(in_tree, jnp.argmax(match, axis=1).astype(jnp.int32), n + l)
    stack = lambda xs: jnp.stack(xs, axis=1)
    return (jnp.concatenate([tokens, stack(new_tok)], axis=1),
            jnp.concatenate([parents_bn.astype(jnp.int32), stack(new_par)], axis=1),
            jnp.concatenate([valid_bn.astype(bool), stack(new_valid)], axis=1))
