"""Plain (non-speculative) generation: chunked prefill, then one token per target call.

The whole generation — prefill and decode loop — is one jitted function with static shapes
(batch, cache length, prefill chunk), so a shape compiles once and every step runs without going
back to Python. Prompts of different lengths share the batch: each row keeps its own length.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .cpu_jit import cpu_stable_jit
from .models.config import ModelConfig
from .models.decoder import KVCache, forward, lm_logits
from .sampling import SamplingParams, sample


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, S] prompt followed by generated tokens (padding after `length`)
    length: jax.Array  # [B] prompt + generated
    num_new: jax.Array  # [B] generated tokens (EOS included when produced)
    target_calls: jax.Array  # [] target passes that produced tokens (the prefill pass, then one per step)


def prefill_plan(chunk) -> tuple[int, int]:
    """A `prefill_chunk` as (big, tail). An int is (chunk, 0): every chunk that long. (big, tail):
    chunks of `big` tokens while at least 3/4 of one remains, then chunks of `tail` for the rest, so
    a short prompt (or a long one's remainder) is not padded to a whole big chunk. On a CPU with the
    few-row kernels a tail chunk of up to 16 tokens runs through them at nearly a big chunk's cost
    per token (`Engine`'s default there); padding a 40-token prompt to 64 rows would waste 24."""
    big, tail = (chunk, 0) if isinstance(chunk, (int, np.integer)) else tuple(chunk)
    if big < 1 or tail < 0 or tail >= big:
        raise ValueError(f"prefill chunks need big >= 1 and 0 <= tail < big, got {chunk!r}")
    return int(big), int(tail)


def chunk_counts(total, chunk):
    """(big chunks, tail chunks) that cover `total` tokens under `prefill_plan(chunk)` (traced or not)."""
    big, tail = prefill_plan(chunk)
    if not tail:
        return (total + big - 1) // big, total * 0
    keep = big - big // 4  # a big chunk runs while at least this many tokens remain
    n_big = jnp.where(total >= keep, (total - keep) // big + 1, 0)
    rest = jnp.maximum(total - n_big * big, 0)
    return n_big, (rest + tail - 1) // tail


def run_chunks(body, state, total, chunk):
    """state = body(state, start, size) over chunks covering [0, total): `prefill_plan(chunk)`'s big
    chunks, then its tail chunks (`size` is static: each size traces `body` once)."""
    big, tail = prefill_plan(chunk)
    n_big, n_tail = chunk_counts(total, chunk)
    start = jnp.int32(0)
    for size, n in ((big, n_big), (tail, n_tail)):
        if not size:
            continue

        def step(st, size=size):
            i, start, state = st
            return i + 1, start + size, body(state, start, size)

        _, start, state = jax.lax.while_loop(lambda st, n=n: st[0] < n, step, (jnp.int32(0), start, state))
    return state


def prefill(params, cfg: ModelConfig, tokens_bs, prompt_len_b, cache: KVCache, chunk, capture=()):
    """Run the prompt through the target in chunks (`prefill_plan(chunk)`: an int, or (big, tail)).

    Returns (cache with length = prompt_len, last-token logits [B, V], captured features per
    capture index [B, S, D] for every prompt position (zeros past the prompt)).
    """
    b, s = tokens_bs.shape
    pad = prefill_plan(chunk)[0]
    padded = jnp.pad(tokens_bs, ((0, 0), (0, pad)))
    last_idx = prompt_len_b - 1
    feats0 = tuple(jnp.zeros((b, s + pad, cfg.hidden_size), cfg.jnp_dtype) for _ in capture)
    h0 = jnp.zeros((b, cfg.hidden_size), cfg.jnp_dtype)

    def body(state, start, size):
        cache, h_last, feats = state
        toks = jax.lax.dynamic_slice_in_dim(padded, start, size, axis=1)
        n_valid = jnp.clip(prompt_len_b - start, 0, size)
        pos = start + jnp.arange(size, dtype=jnp.int32)[None, :]
        out = forward(params, cfg, toks, jnp.broadcast_to(pos, (b, size)), cache, capture=capture)
        rel = jnp.clip(last_idx - start, 0, size - 1)
        in_chunk = (last_idx >= start) & (last_idx < start + size)
        h = jnp.take_along_axis(out.hidden, rel[:, None, None], axis=1)[:, 0]
        h_last = jnp.where(in_chunk[:, None], h.astype(h_last.dtype), h_last)
        feats = tuple(jax.lax.dynamic_update_slice_in_dim(f, c.astype(f.dtype), start, axis=1)
                      for f, c in zip(feats, out.captured))
        return out.cache.advance(n_valid), h_last, feats

    cache, h_last, feats = run_chunks(body, (cache, h0, feats0), jnp.max(prompt_len_b), chunk)
    logits = lm_logits(params, cfg, h_last)  # once, for the last prompt token of every row
    valid = (jnp.arange(s)[None, :] < prompt_len_b[:, None])[..., None]
    feats = tuple(jnp.where(valid, f[:, :s], 0) for f in feats)
    return cache, logits, feats


class DecodeState(NamedTuple):
    """Plain decoding between steps (a pytree): what `decode_start`/`decode_advance` pass along."""

    step: jax.Array  # [] RNG fold index of the next step
    cache: KVCache
    tokens: jax.Array  # [B, S] prompt then generated tokens
    length: jax.Array  # [B]
    done: jax.Array  # [B]
    num_new: jax.Array  # [B]
    last: jax.Array  # [B] the newest token (not yet in the cache)
    calls: jax.Array  # [] target passes after prefill


def _emit(st: DecodeState, tok, max_new_tokens, eos_ids, s: int):
    """Append `tok` to the rows still running; update their stop flags."""
    rows = jnp.arange(tok.shape[0])
    write = ~st.done
    tokens = st.tokens.at[rows, jnp.where(write, st.length, s)].set(tok, mode="drop")
    length, num_new = st.length + write, st.num_new + write
    is_eos = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)
    done = st.done | (write & is_eos) | (num_new >= max_new_tokens) | (length >= s)
    return st._replace(tokens=tokens, length=length, num_new=num_new, done=done, last=tok)


def _start(params, cfg: ModelConfig, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp, key,
           prefill_chunk) -> DecodeState:
    b, s = tokens_bs.shape
    cache = KVCache.create(cfg, b, s)
    cache, logits, _ = prefill(params, cfg, tokens_bs, prompt_len_b, cache, prefill_chunk)
    tok = sample(jax.random.fold_in(key, 0), logits, sp)
    zeros = jnp.zeros((b,), jnp.int32)
    st = DecodeState(jnp.int32(1), cache, tokens_bs, prompt_len_b, zeros.astype(bool) | (max_new_tokens <= 0),
                     zeros, zeros, jnp.int32(0))
    return _emit(st, tok, max_new_tokens, eos_ids, s)


def _step(params, cfg: ModelConfig, st: DecodeState, max_new_tokens, eos_ids, sp, key) -> DecodeState:
    b, s = st.tokens.shape
    cfg = cfg.for_rows(b)  # any batch through the kernels, as tree verification (ModelConfig.for_rows)
    out = forward(params, cfg, st.last[:, None], (st.length - 1)[:, None], st.cache)
    tok = sample(jax.random.fold_in(key, st.step), lm_logits(params, cfg, out.hidden[:, 0]), sp)
    st = st._replace(step=st.step + 1, cache=out.cache.advance(jnp.ones((b,), jnp.int32)), calls=st.calls + 1)
    return _emit(st, tok, max_new_tokens, eos_ids, s)


def _output(st: DecodeState, max_new_tokens) -> GenerateOutput:
    # The prefill pass produced the first token: it counts as a call, so vanilla tau is exactly 1.
    return GenerateOutput(st.tokens, st.length, st.num_new, st.calls + (max_new_tokens > 0))


@functools.partial(cpu_stable_jit, trace_name="generate", static_argnames=("cfg", "prefill_chunk"))
def generate_tokens(params, cfg: ModelConfig, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp: SamplingParams,
                    key, prefill_chunk=64) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row after each row's prompt.

    tokens_bs: [B, S] prompts left-aligned; S is the cache length (static). eos_ids: [E] int32
    (pad with -1). A row stops at EOS (kept in the output), after max_new_tokens, or when full.
    """
    st = _start(params, cfg, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp, key, prefill_chunk)
    st = jax.lax.while_loop(lambda st: ~jnp.all(st.done),
                            lambda st: _step(params, cfg, st, max_new_tokens, eos_ids, sp, key), st)
    return _output(st, max_new_tokens)


# -- streaming: the same computation cut into calls, so a server can emit tokens as they come and
# stop a generation between calls. Same key ⇒ same tokens as `generate_tokens`.

@functools.partial(cpu_stable_jit, trace_name="decode_start", static_argnames=("cfg", "prefill_chunk"))
def decode_start(params, cfg: ModelConfig, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp: SamplingParams,
                 key, prefill_chunk=64) -> DecodeState:
    """Prefill and the first token; continue with `decode_advance`."""
    return _start(params, cfg, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp, key, prefill_chunk)


@functools.partial(cpu_stable_jit, trace_name="decode_advance", static_argnames=("cfg",),
                   donate_argnames=("state",))
def decode_advance(params, cfg: ModelConfig, state: DecodeState, max_new_tokens, eos_ids, sp: SamplingParams, key,
                   n_steps) -> DecodeState:
    """Up to `n_steps` (dynamic) more decoding steps; stops early when every row is done."""
    stop = state.step + n_steps
    return jax.lax.while_loop(lambda st: ~jnp.all(st.done) & (st.step < stop),
                              lambda st: _step(params, cfg, st, max_new_tokens, eos_ids, sp, key), state)


def decode_output(state: DecodeState, max_new_tokens) -> GenerateOutput:
    """The `generate_tokens` result of a streamed generation."""
    return _output(state, max_new_tokens)


@functools.partial(cpu_stable_jit, trace_name="decode_refill", static_argnames=("cfg", "prefill_chunk"),
                   donate_argnames=("state",))
def decode_refill(params, cfg: ModelConfig, state: DecodeState, rows_r, tokens_rs, prompt_len_r, max_new_tokens,
                  eos_ids, sp: SamplingParams, key, prefill_chunk=64) -> DecodeState:
    """Continuous batching: start new prompts in rows `rows_r` of a running batch.

    The R prompts (tokens_rs [R, S] with the batch's cache length S; sp for R rows) are prefilled in
    a batch of their own, then their cache, tokens, lengths and flags replace those rows' (the other
    rows keep decoding untouched). A row index >= B is padding and writes nothing. A refilled row
    generates what `generate_tokens` would for its prompt alone, except for the sampling key.
    """
    sub = _start(params, cfg, tokens_rs, prompt_len_r, max_new_tokens, eos_ids, sp, key, prefill_chunk)

    def put(full, part, lead=0):
        idx = (slice(None),) * lead + (rows_r,)
        return full.at[idx].set(part, mode="drop")

    cache = KVCache(put(state.cache.k, sub.cache.k, 1), put(state.cache.v, sub.cache.v, 1),
                    put(state.cache.length, sub.cache.length))
    return state._replace(cache=cache, tokens=put(state.tokens, sub.tokens), length=put(state.length, sub.length),
                          done=put(state.done, sub.done), num_new=put(state.num_new, sub.num_new),
                          last=put(state.last, sub.last))


def cache_length_for(prompt_len: int, max_new_tokens: int, bucket: int = 128) -> int:
    """The static cache length that fits prompt + new tokens, rounded up to `bucket` (fewer compiles)."""
    need = prompt_len + max_new_tokens
    return int(-(-need // bucket) * bucket)


def pack_prompts(prompts: list[list[int]], cache_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-align token lists into a [B, cache_len] int32 array; raise if a prompt does not fit."""
    out = np.zeros((len(prompts), cache_len), np.int32)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) >= cache_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens, which does not fit the cache of {cache_len} "
                             f"tokens (prompt + at least one new token)")
        out[i, :len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)
