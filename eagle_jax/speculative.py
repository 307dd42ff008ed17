"""Speculative generation with an EAGLE head: draft a tree, verify it in one target pass, accept
losslessly, commit the accepted path, re-draft — one jitted function per (batch, cache length,
tree budget), every step on device.

Per step, with P the committed length and the root t_P already chosen (not yet in the cache):
  1. draft a tree of N nodes (root = t_P) from the head's state h_root, with an optional chain
     copied from the context by n-gram lookup grafted onto it (`TreeBudget.lookup`);
  2. one target pass over the N nodes at positions P + depth under the ancestor mask (keys/values
     land in cache slots P..P+N-1);
  3. accept: greedy (longest path of target argmaxes) or lossless sampling (drafts are deterministic
     top-k tokens, so recursive rejection over a node's children reduces to drawing t ~ p and
     following the child whose token is t); the result is m accepted draft tokens plus a bonus;
  4. move the accepted path's keys/values to slots P..P+m; the committed length becomes P+m+1;
  5. run the head over the m+1 new positions (target features of the path, tokens shifted by one),
     which commits its own KV and gives the next h_root; the bonus becomes the next root.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .cpu_jit import cpu_stable_jit
from .decoding import prefill, prefill_plan, run_chunks
from .draft.drafting import Tree, TreeBudget, draft_candidates, draft_tree_and_cache
from .draft.heads import DraftHead, create_draft_cache, fuse_features, head_step, seed_draft_cache
from .models.config import ModelConfig
from .models.decoder import KVCache, forward, lm_logits
from .models.layers import BlockStart
from .sampling import SamplingParams, sample
from .tree import accept_from_logits, ancestor_mask, node_depths, rerank
from .tree.lookup import graft_chain, lookup_chain


class SpecOutput(NamedTuple):
    tokens: jax.Array  # [B, S] prompt then generated tokens
    length: jax.Array  # [B]
    num_new: jax.Array  # [B] generated tokens (EOS included)
    target_calls: jax.Array  # [B] target passes that produced tokens (prefill's included)
    accept_lengths: jax.Array  # [B, S] tokens produced per verification step (0 after the last)
    steps: jax.Array  # [] verification steps run


def target_capture(tcfg: ModelConfig, head: DraftHead) -> tuple[int, ...]:
    """Target hidden states the head consumes: final-norm output (EAGLE-1) or the fused layers."""
    return tuple(head.cfg.target_layers) if head.cfg.kind == "eagle3" else (tcfg.num_layers,)


def _features(captured) -> jax.Array:
    return captured[0] if len(captured) == 1 else jnp.concatenate(captured, axis=-1)


def draft_prefill(head: DraftHead, target_params, feats_bsf, tokens_bs, prompt_len_b, root_b, cache: KVCache,
                  chunk):
    """Run the head over prompt positions 0..P-1: feature f_j with token t_{j+1} (t_P = root), in the
    target prefill's chunks (`decoding.prefill_plan`).

    Only the last position's output is read (h_root), so positions 0..P-2 only write their keys and
    values (`head_step(keys_only=True)`: no queries, attention or MLP, about a third of a full pass's
    products for an EAGLE-3 head), and position P-1 then runs whole, one row a prompt. The oracle
    (whose keys need every target layer) runs every position whole.

    Returns (draft cache with length P, h_root [B, d] = the head's output at position P-1)."""
    b, s = tokens_bs.shape
    embed = target_params["embed_tokens"]["embedding"]
    rows = jnp.arange(b)
    pad = prefill_plan(chunk)[0]
    nxt = jnp.concatenate([tokens_bs[:, 1:], jnp.zeros((b, 1), tokens_bs.dtype)], axis=1)
    nxt = nxt.at[rows, prompt_len_b - 1].set(root_b)
    nxt = jnp.pad(nxt, ((0, 0), (0, pad)))
    feats = jnp.pad(feats_bsf, ((0, 0), (0, pad), (0, 0)))
    last = prompt_len_b - 1
    whole = head.cfg.kind == "oracle"
    n_keys = prompt_len_b if whole else last  # positions run in chunks (the rest: position P-1 alone)

    def body(state, start, size):
        cache, h_root = state
        toks = jax.lax.dynamic_slice_in_dim(nxt, start, size, axis=1)
        f = fuse_features(head, jax.lax.dynamic_slice_in_dim(feats, start, size, axis=1))
        pos = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32)[None, :], (b, size))
        h, cache = head_step(head, embed, toks, f, pos, cache, keys_only=not whole)
        if whole:
            rel = jnp.clip(last - start, 0, size - 1)
            in_chunk = (last >= start) & (last < start + size)
            h_root = jnp.where(in_chunk[:, None], h[rows, rel], h_root)
        return cache.advance(jnp.clip(n_keys - start, 0, size)), h_root

    h0 = jnp.zeros((b, head.cfg.hidden_size), head.cfg.layer.jnp_dtype)
    cache, h_root = run_chunks(body, (cache, h0), jnp.max(n_keys), chunk)
    if whole:
        return cache, h_root
    f = fuse_features(head, feats[rows, last][:, None])
    h, cache = head_step(head, embed, nxt[rows, last][:, None], f, last[:, None], cache)
    live = prompt_len_b > 0  # an empty row (none in practice) keeps an empty cache and a zero state
    return cache.advance(live.astype(jnp.int32)), jnp.where(live[:, None], h[:, 0], h0)


class SpecState(NamedTuple):
    """Speculative decoding between steps (a pytree): what `spec_start`/`spec_advance` pass along."""

    step: jax.Array  # [] verification steps run
    tcache: KVCache  # the target's cache, committed up to the root
    dcache: KVCache  # the head's cache
    root: jax.Array  # [B] the newest token (not yet in the caches)
    h_root: jax.Array  # [B, d] the head's state at the root
    tokens: jax.Array  # [B, S]
    length: jax.Array  # [B]
    num_new: jax.Array  # [B]
    done: jax.Array  # [B]
    calls: jax.Array  # [B] target passes that produced tokens
    acc: jax.Array  # [B, S] tokens produced per verification step


def _is_eos(t, eos_ids):
    return jnp.any(t[..., None] == eos_ids, axis=-1)


def _start(target_params, tcfg: ModelConfig, head: DraftHead, tokens_bs, prompt_len_b, max_new_tokens, eos_ids,
           sp: SamplingParams, key, budget: TreeBudget, prefill_chunk) -> SpecState:
    b, s = tokens_bs.shape
    rows = jnp.arange(b)
    capture = target_capture(tcfg, head)
    tcache = KVCache.create(tcfg, b, s + budget.num_nodes)
    tcache, logits, feats = prefill(target_params, tcfg, tokens_bs, prompt_len_b, tcache, prefill_chunk, capture)
    root = sample(jax.random.fold_in(key, 0), logits, sp)
    dcache = seed_draft_cache(head, tokens_bs,
                              create_draft_cache(head.cfg, b, s + budget.scratch + budget.max_depth + 1))
    dcache, h_root = draft_prefill(head, target_params, _features(feats), tokens_bs, prompt_len_b, root, dcache,
                                   prefill_chunk)
    live = max_new_tokens > 0
    tokens = tokens_bs.at[rows, jnp.where(live, prompt_len_b, s)].set(root, mode="drop")
    num_new = jnp.full((b,), live, jnp.int32)
    length = prompt_len_b + num_new
    done = ~live | _is_eos(root, eos_ids) | (num_new >= max_new_tokens) | (length >= s)
    return SpecState(jnp.int32(0), tcache, dcache, root, h_root, tokens, length, num_new, done, num_new,
                     jnp.zeros((b, s), jnp.int32))


def propose_tree(head: DraftHead, target_params, tcfg: ModelConfig, st: "SpecState", budget: TreeBudget) -> Tree:
    """The step's tree: the head's draft, with the lookup chain grafted on when `budget.lookup`
    (`TreeBudget`: a dynamic tree gives the chain the rows of its `lookup` weakest nodes in the
    batch rows where a chain adds nodes; a static tree gets `lookup` more rows)."""
    return propose_tree_and_cache(head, target_params, tcfg, st, budget)[0]


def propose_tree_and_cache(head: DraftHead, target_params, tcfg: ModelConfig, st: "SpecState",
                           budget: TreeBudget) -> tuple[Tree, KVCache]:
    """`propose_tree` and the head's cache with the drafting's scratch slots written: what step 5
    writes into (`drafting.draft_tree_and_cache`; no copy of the cache as it was)."""
    if not budget.lookup:
        return draft_tree_and_cache(head, target_params, tcfg, st.h_root, st.root, st.dcache, budget)
    chain, chain_ok = lookup_chain(st.tokens, st.length, budget.lookup, budget.lookup_ngram, budget.lookup_min_ngram)
    if budget.kind == "static":
        tree, dcache = draft_tree_and_cache(head, target_params, tcfg, st.h_root, st.root, st.dcache, budget)
        return Tree(*graft_chain(*tree, chain, chain_ok)), dcache
    *cands, dcache = draft_candidates(head, target_params, tcfg, st.h_root, st.dcache, budget)
    whole = rerank(*cands, st.root, budget.total_tokens)
    short = rerank(*cands, st.root, budget.total_tokens - budget.lookup)
    grafted = graft_chain(*short, chain, chain_ok)
    use = jnp.any(grafted[2][:, budget.total_tokens - budget.lookup:], axis=1)[:, None]
    return Tree(*(jnp.where(use, g, w) for g, w in zip(grafted, whole))), dcache


def verify_tree(target_params, tcfg: ModelConfig, head: DraftHead, tcache: KVCache, tree, depth: int):
    """The target's one pass over the padded tree (positions: committed length + node depth; the
    ancestor mask inside the tree): (decoder output with the head's features and the cache holding
    the tree's keys, float32 logits [B, N, V])."""
    depth_bn = node_depths(tree.parents_bn, tree.valid_bn, depth)
    tcfg = tcfg.for_rows(tree.tokens_bn.size)  # every node through the decoding step's kernels
    out = forward(target_params, tcfg, tree.tokens_bn, tcache.length[:, None] + depth_bn, tcache,
                  block_mask_btt=ancestor_mask(tree.parents_bn, tree.valid_bn, depth),
                  capture=target_capture(tcfg, head), block_fits=True)  # the cache has room for the tree
    return out, lm_logits(target_params, tcfg, out.hidden)


def _commit_path(all_lbshd, p_b, path_bd):
    """The stacked cache [L, B, S, Hkv, Dh] with slots P..P+D of each row set to its slots P + path
    (the accepted path's keys, root first; D = max_depth, all inside the tree's slots, which the
    cache has room for). One row writes them as one window: XLA:CPU expands a scatter into a loop
    over its keys under the decoding programs' options (`layers.write_block`), 2 loops of about
    25 us a step for SmolLM2 (30 layers, 3 slots)."""
    b, d1 = path_bd.shape
    rows = jnp.arange(b)[:, None]
    picked = all_lbshd[:, rows, p_b[:, None] + path_bd]  # [L, B, D+1, Hkv, Dh]
    if b == 1:
        zero = jnp.int32(0)
        return jax.lax.dynamic_update_slice(all_lbshd, picked, (zero, zero, p_b[0].astype(jnp.int32), zero, zero))
    return all_lbshd.at[:, rows, p_b[:, None] + jnp.arange(d1)[None, :]].set(picked, mode="drop")


def _step(target_params, tcfg: ModelConfig, head: DraftHead, st: SpecState, max_new_tokens, eos_ids,
          sp: SamplingParams, key, budget: TreeBudget) -> SpecState:
    """One draft → verify → accept → commit → re-feed-the-head step (rows already done stay put)."""
    step, tcache, dcache, root, h_root, tokens, length, num_new, done, calls, acc = st
    b, s = tokens.shape
    depth = budget.max_depth
    rows = jnp.arange(b)
    j = jnp.arange(depth + 1)
    embed = target_params["embed_tokens"]["embedding"]
    k_step = jax.random.fold_in(key, step + 1)
    p = tcache.length
    tree, dcache = propose_tree_and_cache(head, target_params, tcfg, st, budget)
    out, logits = verify_tree(target_params, tcfg, head, tcache, tree, depth)
    acc_res = accept_from_logits(k_step, *tree, logits, sp, depth)
    m = jnp.where(done, 0, acc_res.num_accepted_b)
    path = jnp.where(acc_res.path_bd >= 0, acc_res.path_bd, 0)

    # Commit the accepted path's keys/values to contiguous slots P..P+m.
    tcache = out.cache.replace(k=_commit_path(out.cache.k, p, path), v=_commit_path(out.cache.v, p, path),
                               length=p + jnp.where(done, 0, m + 1))

    # Tokens produced: the accepted drafts, then the bonus; cut at EOS, the budget, the buffer.
    path_tok = jnp.take_along_axis(tree.tokens_bn, path, axis=1)
    nxt = jnp.concatenate([path_tok[:, 1:], jnp.zeros((b, 1), path_tok.dtype)], axis=1)
    emitted = jnp.where(j < m[:, None], nxt, jnp.where(j == m[:, None], acc_res.bonus_b[:, None], 0))
    eos_hit = _is_eos(emitted, eos_ids) & (j <= m[:, None])
    count = jnp.where(jnp.any(eos_hit, 1), jnp.argmax(eos_hit, 1) + 1, m + 1)
    count = jnp.minimum(count, jnp.minimum(max_new_tokens - num_new, s - length))
    count = jnp.where(done, 0, count)
    write = jnp.where(j[None, :] < count[:, None], length[:, None] + j[None, :], s)
    tokens = tokens.at[rows[:, None], write].set(emitted, mode="drop")
    acc = acc.at[rows, jnp.where(done, s, step)].set(m + 1, mode="drop")
    calls = calls + ~done
    length, num_new = length + count, num_new + count
    new_done = done | jnp.any(eos_hit, 1) | (num_new >= max_new_tokens) | (length >= s)

    # The head consumes the path's target features with the next tokens (t_{P+1}..t_{P+m+1}).
    feat = jnp.take_along_axis(_features(out.captured), path[:, :, None], axis=1)
    h, dcache = head_step(head, embed, emitted, fuse_features(head, feat), p[:, None] + j[None, :], dcache,
                          slots_bt=BlockStart(p))  # fits: the head's cache has max_depth + 1 slots past s
    dcache = dcache.replace(length=tcache.length)
    h_root = jnp.where(new_done[:, None], h_root, h[rows, m])
    root = jnp.where(new_done, root, acc_res.bonus_b)
    return SpecState(step + 1, tcache, dcache, root, h_root, tokens, length, num_new, new_done, calls, acc)


def _output(st: SpecState) -> SpecOutput:
    return SpecOutput(st.tokens, st.length, st.num_new, st.calls, st.acc, st.step)


@functools.partial(cpu_stable_jit, trace_name="speculative", static_argnames=("tcfg", "budget", "prefill_chunk"))
def speculative_generate(target_params, tcfg: ModelConfig, head: DraftHead, tokens_bs, prompt_len_b, max_new_tokens,
                         eos_ids, sp: SamplingParams, key, budget: TreeBudget, prefill_chunk=64) -> SpecOutput:
    """Generate up to `max_new_tokens` per row with EAGLE speculation (same contract as
    `decoding.generate_tokens`: tokens_bs [B, S] left-aligned prompts, S static)."""
    st = _start(target_params, tcfg, head, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp, key, budget,
                prefill_chunk)
    st = jax.lax.while_loop(
        lambda st: ~jnp.all(st.done),
        lambda st: _step(target_params, tcfg, head, st, max_new_tokens, eos_ids, sp, key, budget), st)
    return _output(st)


# -- streaming: the same computation cut into calls (same key ⇒ same tokens as speculative_generate).

@functools.partial(cpu_stable_jit, trace_name="spec_start", static_argnames=("tcfg", "budget", "prefill_chunk"))
def spec_start(target_params, tcfg: ModelConfig, head: DraftHead, tokens_bs, prompt_len_b, max_new_tokens, eos_ids,
               sp: SamplingParams, key, budget: TreeBudget, prefill_chunk=64) -> SpecState:
    """Target and head prefill and the first token; continue with `spec_advance`."""
    return _start(target_params, tcfg, head, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp, key, budget,
                  prefill_chunk)


@functools.partial(cpu_stable_jit, trace_name="spec_advance", static_argnames=("tcfg", "budget"),
                   donate_argnames=("state",))
def spec_advance(target_params, tcfg: ModelConfig, head: DraftHead, state: SpecState, max_new_tokens, eos_ids,
                 sp: SamplingParams, key, budget: TreeBudget, n_steps) -> SpecState:
    """Up to `n_steps` (dynamic) more verification steps; stops early when every row is done."""
    stop = state.step + n_steps
    return jax.lax.while_loop(
        lambda st: ~jnp.all(st.done) & (st.step < stop),
        lambda st: _step(target_params, tcfg, head, st, max_new_tokens, eos_ids, sp, key, budget), state)


def spec_output(state: SpecState) -> SpecOutput:
    """The `speculative_generate` result of a streamed generation."""
    return _output(state)
