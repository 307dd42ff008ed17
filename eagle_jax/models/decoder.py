"""The target decoder: embedding → scanned decoder layers → final norm → LM head.

Functional API (params are plain pytrees, every shape static):

    cache = KVCache.create(cfg, batch=1, max_len=512)
    out = forward(params, cfg, tokens_bt, positions_bt, cache, block_mask_btt=..., capture=(2, 15))
    logits = lm_logits(params, cfg, out.hidden)

`forward` writes the block's keys/values at cache slots `cache.length[b] + t` but does not
advance `length`: the caller commits (plain decoding advances by the number of valid tokens; the
tree verifier gathers the accepted path first). Queries see every committed slot (`< length`)
and, inside the block, the keys that `block_mask_btt` allows (default: causal).
"""

from __future__ import annotations

import math

from typing import NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .layers import BlockStart, DecoderLayer, block_slots, rms_norm, rope_cos_sin


@flax.struct.dataclass
class KVCache:
    """Static-shape KV cache. k, v: [L, B, S, Hkv, Dh]; length: [B] committed slots per row."""

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        dt = dtype or cfg.jnp_dtype
        return cls(jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def advance(self, n_b: jax.Array) -> "KVCache":
        return self.replace(length=self.length + n_b)


class DecoderOutput(NamedTuple):
    hidden: jax.Array  # [B, T, D] final-norm output (the EAGLE-1 feature)
    captured: tuple  # one [B, T, D] per requested capture index (HF hidden_states indexing)
    cache: Optional[KVCache]


def causal_mask(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), bool))


def attention_mask(cfg: ModelConfig, positions_bt, length_b, block_mask_btt, max_len: int):
    """Boolean visibility [B, T, S] of cache slots for the block's queries.

    Slot s is visible to query t of row b when it is committed (s < length[b]) or it holds block
    key j = s - length[b] with block_mask[b, t, j]. Committed slot s is taken to hold position s
    (commits are contiguous); the sliding window, if any, compares positions.
    """
    b, t = positions_bt.shape
    s = jnp.arange(max_len)[None, None, :]  # 1 1 S
    length = length_b[:, None, None]
    committed = s < length
    rel = s - length
    in_block = (rel >= 0) & (rel < t)
    relc = jnp.clip(rel, 0, t - 1)
    blk = jnp.take_along_axis(block_mask_btt, jnp.broadcast_to(relc, (b, t, max_len)), axis=2)
    visible = committed | (in_block & blk)
    if cfg.sliding_window is not None:
        key_pos_blk = jnp.take_along_axis(positions_bt, jnp.clip(rel[:, 0, :], 0, t - 1), axis=1)  # B S
        key_pos = jnp.where(committed[:, 0, :], s[:, 0, :], key_pos_blk)
        visible &= (positions_bt[:, :, None] - key_pos[:, None, :]) < cfg.sliding_window
    return visible


def _block_only_mask(cfg: ModelConfig, positions_bt, block_mask_btt):
    if cfg.sliding_window is None:
        return block_mask_btt
    return block_mask_btt & ((positions_bt[:, :, None] - positions_bt[:, None, :]) < cfg.sliding_window)


def embed(params, cfg: ModelConfig, tokens_bt):
    return jnp.take(params["embed_tokens"]["embedding"], tokens_bt, axis=0).astype(cfg.jnp_dtype)


def forward(params, cfg: ModelConfig, tokens_bt, positions_bt=None, cache: Optional[KVCache] = None, *,
            block_mask_btt=None, capture: Sequence[int] = (), inputs_embeds_btd=None, slots_bt=None,
            attn_mask_bts=None, block_fits: bool = False) -> DecoderOutput:
    """Run the decoder over a block of T tokens per row.

    capture: HF `hidden_states` indices to return: i < num_layers is the input of layer i
    (0 = embeddings), num_layers is the final-norm output.
    slots_bt / attn_mask_bts (cached only): write the block's keys to these slots ([B, T] or a
    `layers.BlockStart`) instead of `length + t`, and use this [B, T, S] visibility instead of the
    committed-prefix + block mask (drafters that keep scratch slots past the committed length use both).
    block_fits (cached only): the caller guarantees `length + T <= S` in every row (tree
    verification), so the default slots are written as one window a row (`layers.write_block`)
    instead of a scatter that drops what runs past the end (a prefill chunk's padding).
    With `cfg.attention_impl == "pallas"` a cached forward with the default slots and mask (prefill
    chunks, decode steps, tree verification) runs the Pallas tree-attention kernel on the packed
    block mask; everything else uses the jnp reference.
    """
    b, t = tokens_bt.shape
    if positions_bt is None:
        base = cache.length[:, None] if cache is not None else jnp.zeros((b, 1), jnp.int32)
        positions_bt = base + jnp.arange(t, dtype=jnp.int32)[None, :]
    if block_mask_btt is None:
        block_mask_btt = jnp.broadcast_to(causal_mask(t), (b, t, t))
    for c in capture:
        if not 0 <= c <= cfg.num_layers:
            raise ValueError(f"capture index {c} out of range [0, {cfg.num_layers}]")
    x = embed(params, cfg, tokens_bt) if inputs_embeds_btd is None else inputs_embeds_btd
    cos, sin = rope_cos_sin(cfg, positions_bt)
    layer = DecoderLayer(cfg)
    layer_caps = tuple(c for c in capture if c < cfg.num_layers)
    caps0 = jnp.zeros((len(layer_caps),) + x.shape, x.dtype)

    if cache is None:
        mask = _block_only_mask(cfg, positions_bt, block_mask_btt)

        def body(carry, xs):
            h, caps = carry
            p, i = xs
            caps = _capture(caps, layer_caps, i, h)
            h, _ = layer.apply({"params": p}, h, cos, sin, mask, None)
            return (h, caps), None

        (x, caps), _ = _layer_loop(body, (x, caps0), params["layers"])
        new_cache = None
    else:
        if attn_mask_bts is None and slots_bt is None and cfg.attention_impl == "pallas":
            from ..kernels.tree_attention import BlockMask, pack_bits

            mask = BlockMask(cache.length, pack_bits(block_mask_btt), positions_bt.astype(jnp.int32))
        else:
            mask = attn_mask_bts if attn_mask_bts is not None else attention_mask(
                cfg, positions_bt, cache.length, block_mask_btt, cache.max_len)
        slots = slots_bt if slots_bt is not None else (
            BlockStart(cache.length) if block_fits else block_slots(BlockStart(cache.length), t))

        def body(carry, xs):
            h, caps, k_all, v_all = carry
            p, i = xs
            caps = _capture(caps, layer_caps, i, h)
            h, (k_all, v_all) = layer.apply({"params": p}, h, cos, sin, mask, (k_all, v_all, i, slots))
            return (h, caps, k_all, v_all), None

        (x, caps, k_all, v_all), _ = _layer_loop(body, (x, caps0, cache.k, cache.v), params["layers"])
        new_cache = cache.replace(k=k_all, v=v_all)

    hidden = rms_norm(cfg, cfg.hidden_size).apply({"params": params["norm"]}, x)
    layer_out = {c: caps[j] for j, c in enumerate(layer_caps)}
    captured = tuple(hidden if c == cfg.num_layers else layer_out[c] for c in capture)
    return DecoderOutput(hidden, captured, new_cache)


def _layer_loop(body, carry, layers):
    """Run `body(carry, (layer_params, i))` over the layers.

    Stacked layers (each leaf [L, ...], the checkpoint and training layout) go through `lax.scan`:
    one compiled layer, sharding-friendly. A list of per-layer pytrees (`unstack_layers`) is
    unrolled: each matmul reads its own weight buffer, where the scan's per-iteration slice of
    the stacked weights costs a copy on XLA:CPU (decoding SmolLM2 is ≈ 1.4× faster unrolled).
    """
    if isinstance(layers, (list, tuple)):
        for i, p in enumerate(layers):
            carry, _ = body(carry, (p, i))
        return carry, None
    n = jax.tree.leaves(layers)[0].shape[0]
    return jax.lax.scan(body, carry, (layers, jnp.arange(n)))


def unstack_layers(params):
    """The same parameters with `layers` as a list of per-layer pytrees (see `_layer_loop`). Arrays
    on the CPU are sliced on the host (numpy views, each copied once into its own buffer): indexing
    the jax arrays would dispatch one XLA slice per leaf and layer (SmolLM2: 390, 0.8 s)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]

    def take(a, i):
        if isinstance(a, jax.Array) and a.is_fully_addressable and {d.platform for d in a.devices()} == {"cpu"}:
            return jax.device_put(np.asarray(a)[i], next(iter(a.devices())))
        return a[i]

    out = dict(params)
    out["layers"] = [jax.tree.map(lambda a, i=i: take(a, i), layers) for i in range(n)]
    return out


def check_layer_layout(layers: str) -> str:
    if layers not in ("auto", "unroll", "scan"):
        raise ValueError(f"layers must be auto, unroll or scan, not {layers!r}")
    return layers


def with_layer_layout(params, layers: str = "auto"):
    """`params` in the layout `layers` names: "unroll" (`unstack_layers`), "scan" (`stack_layers`)
    or "auto" (unrolled on the CPU backend, where it decodes fastest; scanned elsewhere)."""
    if check_layer_layout(layers) == "unroll" or (layers == "auto" and jax.default_backend() == "cpu"):
        return unstack_layers(params)
    return stack_layers(params)


def stack_layers(params):
    """Inverse of `unstack_layers`: `layers` stacked along a leading axis."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    out = dict(params)
    out["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    return out


def _capture(caps, layer_caps, i, h):
    for j, c in enumerate(layer_caps):
        if isinstance(i, int):  # unrolled: the layer index is static
            caps = caps.at[j].set(h) if i == c else caps
        else:
            caps = caps.at[j].set(jnp.where(i == c, h, caps[j]))
    return caps


def lm_logits(params, cfg: ModelConfig, hidden_btd) -> jax.Array:
    """Float32 logits over the vocabulary (tied embeddings use the embedding matrix)."""
    if cfg.matmul_impl == "cpu_kernel":
        from ..kernels.cpu_matmul import matmul, qmatmul, quant_kind

        h = hidden_btd.astype(jnp.float32)
        head = params["embed_tokens"] if cfg.tie_word_embeddings else params["lm_head"]
        kind = quant_kind(head)
        if kind is not None and math.prod(h.shape[:-1]) <= cfg.kernel_rows:  # GGUF blocks (models/quantized.py)
            return qmatmul(h, head[kind], kind, head.get(f"{kind}_scales"))
        if cfg.tie_word_embeddings:
            return matmul(h, params["embed_tokens"]["embedding"].astype(jnp.float32), "nk", cfg.kernel_rows)
        return matmul(h, params["lm_head"]["kernel"].astype(jnp.float32), "kn", cfg.kernel_rows)
    if cfg.tie_word_embeddings:
        w = params["embed_tokens"]["embedding"]  # V D
        return jnp.einsum("...d,vd->...v", hidden_btd, w, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden_btd, params["lm_head"]["kernel"], preferred_element_type=jnp.float32)


def init_params(cfg: ModelConfig, key: jax.Array):
    """Random parameters (normal 0.02, ones for norms), layers stacked along a leading axis."""
    k_emb, k_layers, k_head = jax.random.split(key, 3)
    dt = cfg.jnp_dtype
    x = jnp.zeros((1, 1, cfg.hidden_size), dt)
    cos = sin = jnp.zeros((1, 1, cfg.head_dim), jnp.float32)
    mask = jnp.ones((1, 1, 1), bool)
    layer = DecoderLayer(cfg)

    def init_one(k):
        p = layer.init(k, x, cos, sin, mask)["params"]
        leaves, treedef = jax.tree_util.tree_flatten_with_path(p)
        keys = jax.random.split(k, len(leaves))
        return jax.tree_util.tree_unflatten(treedef, [
            a if path[-1].key == "scale" else 0.02 * jax.random.normal(kk, a.shape, a.dtype)
            for (path, a), kk in zip(leaves, keys)])

    params = {
        "embed_tokens": {"embedding": 0.02 * jax.random.normal(k_emb, (cfg.vocab_size, cfg.hidden_size), dt)},
        "layers": jax.vmap(init_one)(jax.random.split(k_layers, cfg.num_layers)),
        "norm": {"scale": jnp.ones((cfg.hidden_size,), dt)},
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": 0.02 * jax.random.normal(k_head, (cfg.hidden_size, cfg.vocab_size), dt)}
    return params
