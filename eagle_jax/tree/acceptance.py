"""Lossless acceptance of a draft tree given the target's outputs at every tree node.

The target is run once on all N tree tokens; row i of its output is the target's next-token
distribution after the path root..i. Acceptance walks the tree from the root:

* greedy: a node is accepted iff its token is the target argmax at its parent and its parent is
  accepted; the deepest accepted node ends the path and the target argmax there is the bonus.
* sampling: recursive rejection sampling (SpecInfer). Drafts are deterministic (top-k), so the
  draft distribution of each child is one-hot. Trying the children x_1..x_k of the current node in
  order, accepting x_j with probability p(x_j) / (remaining mass), zeroing p(x_j) on rejection and
  finally sampling the bonus from the residual, accepts x_j with total probability exactly p(x_j)
  and emits the bonus with probability p(y) for every y not among the children. That is the law
  of one draw t ~ p matched against the children: if t is a child's token move to that child,
  otherwise t is the bonus. `sample_accept` implements that form: one categorical draw per depth,
  the same output distribution (exactly the target's, i.e. lossless), and no sequential loop over
  children, no renormalisation round-off and no empty residual to guard against.

Both return `Accepted`. Rows are independent; `max_depth` (D) is static; everything is jittable.
`accept_from_logits` is the entry point for a decode step: it turns the target's logits into
exactly the distribution plain decoding samples from (`sampling.target_probs`, per-row settings)
and picks greedy or sampled verification per row.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..sampling import SamplingParams, argmax_last, categorical_probs, target_probs
from .buffers import ancestor_chains, chains_to_paths, effective_parents


class Accepted(NamedTuple):
    """The outcome of one verification step, per batch row."""

    path_bd: jax.Array  # int32 [B, D+1]: root-to-last-accepted node indices, -1 padded
    num_accepted_b: jax.Array  # int32 [B]: accepted draft nodes m in 0..D (the root not counted)
    bonus_b: jax.Array  # int32 [B]: the target's token after the last accepted node


def _gather_nodes(x_bn: jax.Array, idx_b_: jax.Array) -> jax.Array:
    """x[b, idx[b, ...]] for any trailing index shape; idx is clipped into range."""
    b, n = x_bn.shape[:2]
    flat = jnp.clip(idx_b_.reshape(b, -1), 0, n - 1)
    return jnp.take_along_axis(x_bn, flat, axis=1).reshape(idx_b_.shape)


def path_tokens(tokens_bn: jax.Array, path_bd: jax.Array, pad: int = -1) -> jax.Array:
    """int32 [B, D+1]: the tokens along `path_bd` (root token first), `pad` where the path is -1."""
    return jnp.where(path_bd >= 0, _gather_nodes(tokens_bn.astype(jnp.int32), path_bd), pad)


def emitted_tokens(tokens_bn: jax.Array, acc: Accepted, pad: int = -1) -> jax.Array:
    """int32 [B, D+1]: the new tokens of this step, accepted drafts then the bonus, `pad` after.

    The root is excluded (it was emitted by the previous step), so row b holds m + 1 tokens."""
    toks = path_tokens(tokens_bn, acc.path_bd, pad)[:, 1:]
    d = toks.shape[1]
    toks = jnp.concatenate([toks, jnp.full((toks.shape[0], 1), pad, jnp.int32)], axis=1)
    at_bonus = jnp.arange(d + 1)[None, :] == acc.num_accepted_b[:, None]
    return jnp.where(at_bonus, acc.bonus_b[:, None], toks)


def greedy_accept(tokens_bn: jax.Array, parents_bn: jax.Array, valid_bn: jax.Array,
                  target_argmax_bn: jax.Array, max_depth: int) -> Accepted:
    """Greedy verification: the longest root path whose every token is the target argmax.

    Invalid nodes are never accepted. Siblings are distinct, so accepted nodes form one chain and
    the deepest is unique (otherwise the lowest node index among the deepest wins)."""
    b, n = tokens_bn.shape
    eff = effective_parents(parents_bn, valid_bn)
    argmax = target_argmax_bn.astype(jnp.int32)
    edge_ok = (eff >= 0) & (tokens_bn.astype(jnp.int32) == _gather_nodes(argmax, eff))
    edge_ok = edge_ok.at[:, 0].set(True)
    chain = ancestor_chains(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), eff, max_depth)
    on_path_ok = jnp.where(chain >= 0, _gather_nodes(edge_ok, chain), True)
    accepted = valid_bn.astype(bool) & jnp.all(on_path_ok, axis=-1)
    accepted = accepted.at[:, 0].set(True)
    depth = jnp.sum(chain >= 0, axis=-1) - 1
    best = jnp.argmax(jnp.where(accepted, depth, -1), axis=-1).astype(jnp.int32)  # first max
    best_chain = jnp.take_along_axis(chain, best[:, None, None], axis=1)[:, 0]
    return Accepted(
        path_bd=chains_to_paths(best_chain),
        num_accepted_b=_gather_nodes(depth, best).astype(jnp.int32),
        bonus_b=_gather_nodes(argmax, best),
    )


def _row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One key per row: a single key is split B ways; a batch of B keys is used as given."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    single = key.ndim == (0 if typed else 1)
    return jax.random.split(key, batch) if single else key


def sample_accept(key: jax.Array, tokens_bn: jax.Array, parents_bn: jax.Array, valid_bn: jax.Array,
                  target_probs_bnv: jax.Array, max_depth: int) -> Accepted:
    """Lossless sampled verification (recursive rejection sampling with one-hot drafts).

    `key` is one PRNG key (split per row) or B keys (one per row, for batch-invariant results).
    `target_probs_bnv` [B, N, V] is the target's (filtered) next-token distribution at each node;
    it need not be normalised, but must be >= 0 with a positive sum on rows that are reached.
    At depth d (static loop over D + 1 steps): draw t ~ p(current node); if a valid child of the
    current node has token t, accept it and continue from it; otherwise t is the bonus and the
    walk stops. At depth D no child is considered. One-hot `target_probs` reproduce
    `greedy_accept` exactly."""
    b, n, _ = target_probs_bnv.shape
    d = max_depth
    eff = effective_parents(parents_bn, valid_bn)
    tokens = tokens_bn.astype(jnp.int32)
    step_keys = jax.vmap(lambda k: jax.random.split(k, d + 1))(_row_keys(key, b))  # [B, D+1]
    probs = target_probs_bnv.astype(jnp.float32)  # 0: never drawn
    draw = jax.vmap(lambda k, p: categorical_probs(k, p[None])[0])

    def step(i, carry):
        cur, done, path, m, bonus = carry
        p = jnp.take_along_axis(probs, cur[:, None, None], axis=1)[:, 0]  # [B, V]
        t = draw(step_keys[:, i], p)
        match = (eff == cur[:, None]) & (tokens == t[:, None]) & (i < d)
        advance = ~done & jnp.any(match, axis=-1)
        stop = ~done & ~advance
        child = jnp.argmax(match, axis=-1).astype(jnp.int32)  # first matching child
        col = jnp.minimum(i + 1, d)
        path = path.at[:, col].set(jnp.where(advance, child, path[:, col]))
        return (jnp.where(advance, child, cur), done | stop, path, m + advance.astype(jnp.int32),
                jnp.where(stop, t, bonus))

    init = (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool),
            jnp.full((b, d + 1), -1, jnp.int32).at[:, 0].set(0), jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), jnp.int32))
    _, _, path, m, bonus = jax.lax.fori_loop(0, d + 1, step, init)
    return Accepted(path_bd=path, num_accepted_b=m, bonus_b=bonus)


def accept_from_logits(key: jax.Array, tokens_bn: jax.Array, parents_bn: jax.Array, valid_bn: jax.Array,
                       logits_bnv: jax.Array, sp: SamplingParams, max_depth: int) -> Accepted:
    """Verify a tree from the target's logits at every node under per-row sampling settings.

    Greedy rows (temperature 0) get `greedy_accept` on the argmax; the other rows get
    `sample_accept` on `target_probs` (temperature, top-k, top-p exactly as plain decoding), so
    both kinds of rows are lossless. A batch of greedy rows only skips the sampling work."""
    b, n, v = logits_bnv.shape
    greedy = greedy_accept(tokens_bn, parents_bn, valid_bn, argmax_last(logits_bnv), max_depth)

    def sampled(_):
        sp_n = jax.tree.map(lambda x: jnp.repeat(x, n), sp)  # one setting per (row, node)
        probs = target_probs(logits_bnv.reshape(b * n, v), sp_n).reshape(b, n, v)
        out = sample_accept(key, tokens_bn, parents_bn, valid_bn, probs, max_depth)
        pick = lambda g, s: jnp.where(sp.greedy.reshape((b,) + (1,) * (g.ndim - 1)), g, s)
        return Accepted(*(pick(g, s) for g, s in zip(greedy, out)))

    return jax.lax.cond(jnp.all(sp.greedy), lambda _: greedy, sampled, None)
