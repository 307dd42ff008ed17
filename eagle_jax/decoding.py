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

from .models.config import ModelConfig
from .models.decoder import KVCache, forward, lm_logits
from .sampling import SamplingParams, sample

# Incremented each time a generation function is traced; tests use it to prove compile-once.
TRACE_COUNTS: dict[str, int] = {}


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, S] prompt followed by generated tokens (padding after `length`)
    length: jax.Array  # [B] prompt + generated
    num_new: jax.Array  # [B] generated tokens (EOS included when produced)
    target_calls: jax.Array  # [] target passes that produced tokens (the prefill pass, then one per step)


def count_trace(name: str):
    TRACE_COUNTS[name] = TRACE_COUNTS.get(name, 0) + 1


def prefill(params, cfg: ModelConfig, tokens_bs, prompt_len_b, cache: KVCache, chunk: int, capture=()):
    """Run the prompt through the target in chunks of `chunk` tokens.

    Returns (cache with length = prompt_len, last-token logits [B, V], captured features per
    capture index [B, S, D] for every prompt position (zeros past the prompt)).
    """
    b, s = tokens_bs.shape
    n_chunks = (jnp.max(prompt_len_b) + chunk - 1) // chunk
    padded = jnp.pad(tokens_bs, ((0, 0), (0, chunk)))
    last_idx = prompt_len_b - 1
    feats0 = tuple(jnp.zeros((b, s + chunk, cfg.hidden_size), cfg.jnp_dtype) for _ in capture)
    logits0 = jnp.zeros((b, cfg.vocab_size), jnp.float32)

    def body(state):
        i, cache, logits, feats = state
        start = i * chunk
        toks = jax.lax.dynamic_slice_in_dim(padded, start, chunk, axis=1)
        n_valid = jnp.clip(prompt_len_b - start, 0, chunk)
        pos = start + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        out = forward(params, cfg, toks, jnp.broadcast_to(pos, (b, chunk)), cache, capture=capture)
        rel = jnp.clip(last_idx - start, 0, chunk - 1)
        h_last = jnp.take_along_axis(out.hidden, rel[:, None, None], axis=1)[:, 0]
        in_chunk = (last_idx >= start) & (last_idx < start + chunk)
        logits = jnp.where(in_chunk[:, None], lm_logits(params, cfg, h_last), logits)
        feats = tuple(jax.lax.dynamic_update_slice_in_dim(f, c.astype(f.dtype), start, axis=1)
                      for f, c in zip(feats, out.captured))
        return i + 1, out.cache.advance(n_valid), logits, feats

    _, cache, logits, feats = jax.lax.while_loop(
        lambda st: st[0] < n_chunks, body, (jnp.int32(0), cache, logits0, feats0))
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
           prefill_chunk: int) -> DecodeState:
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


@functools.partial(jax.jit, static_argnames=("cfg", "prefill_chunk"))
def generate_tokens(params, cfg: ModelConfig, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp: SamplingParams,
                    key, prefill_chunk: int = 64) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row after each row's prompt.

    tokens_bs: [B, S] prompts left-aligned; S is the cache length (static). eos_ids: [E] int32
    (pad with -1). A row stops at EOS (kept in the output), after max_new_tokens, or when full.
    """
    count_trace("generate")
    st = _start(params, cfg, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp, key, prefill_chunk)
    st = jax.lax.while_loop(lambda st: ~jnp.all(st.done),
                            lambda st: _step(params, cfg, st, max_new_tokens, eos_ids, sp, key), st)
    return _output(st, max_new_tokens)


# -- streaming: the same computation cut into calls, so a server can emit tokens as they come and
# stop a generation between calls. Same key ⇒ same tokens as `generate_tokens`.

@functools.partial(jax.jit, static_argnames=("cfg", "prefill_chunk"))
def decode_start(params, cfg: ModelConfig, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp: SamplingParams,
                 key, prefill_chunk: int = 64) -> DecodeState:
    """Prefill and the first token; continue with `decode_advance`."""
    count_trace("decode_start")
    return _start(params, cfg, tokens_bs, prompt_len_b, max_new_tokens, eos_ids, sp, key, prefill_chunk)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def decode_advance(params, cfg: ModelConfig, state: DecodeState, max_new_tokens, eos_ids, sp: SamplingParams, key,
                   n_steps) -> DecodeState:
    """Up to `n_steps` (dynamic) more decoding steps; stops early when every row is done."""
    count_trace("decode_advance")
    stop = state.step + n_steps
    return jax.lax.while_loop(lambda st: ~jnp.all(st.done) & (st.step < stop),
                              lambda st: _step(params, cfg, st, max_new_tokens, eos_ids, sp, key), state)


def decode_output(state: DecodeState, max_new_tokens) -> GenerateOutput:
    """The `generate_tokens` result of a streamed generation."""
    return _output(state, max_new_tokens)


@functools.partial(jax.jit, static_argnames=("cfg", "prefill_chunk"), donate_argnames=("state",))
def decode_refill(params, cfg: ModelConfig, state: DecodeState, rows_r, tokens_rs, prompt_len_r, max_new_tokens,
                  eos_ids, sp: SamplingParams, key, prefill_chunk: int = 64) -> DecodeState:
    """Continuous batching: start new prompts in rows `rows_r` of a running batch.

    The R prompts (tokens_rs [R, S] with the batch's cache length S; sp for R rows) are prefilled in
    a batch of their own, then their cache, tokens, lengths and flags replace those rows' (the other
    rows keep decoding untouched). A row index >= B is padding and writes nothing. A refilled row
    generates what `generate_tokens` would for its prompt alone, except for the sampling key.
    """
    count_trace("decode_refill")
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
