"""EAGLE draft heads as Flax modules applied functionally.

EAGLE-1/2:  h' = layer(fc(concat(embed(t_{i+1}), f_i)))      logits = target_lm_head(h')
EAGLE-3:    h  = fc(concat(low, mid, high)) at step 1, else the head's own previous output
            h' = midlayer(embed(t_{i+1}), h)                  logits = lm_head(norm(h')) over the draft vocab

Both heads reuse the target's frozen token embedding. The head's output h' is what the next draft
step consumes (EAGLE-3: pre-norm). `DraftHead` carries the config as static pytree metadata, so a
head passes through `jit` as one argument and its config is part of the compiled signature.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from ..models.decoder import KVCache, forward, lm_logits
from ..models.layers import (MLP, Attention, BlockStart, DecoderLayer, RMSNorm, RolloutKeys, block_slots, dense,
                             rope_cos_sin)
from .config import DraftConfig


class Eagle3Layer(nn.Module):
    """EAGLE-3's mid layer: attention over concat(input_norm(embedding), hidden_norm(h)) (width 2d)
    with residual h, then the usual post-norm MLP block."""

    cfg: Any  # ModelConfig

    @nn.compact
    def __call__(self, emb_btd, h_btd, cos, sin, mask_bts, cache=None, keys_only=False):
        cfg = self.cfg
        dt = cfg.jnp_dtype
        norm = lambda n: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, name=n)
        x = jnp.concatenate([norm("input_layernorm")(emb_btd), norm("hidden_norm")(h_btd)], axis=-1)
        a, cache = Attention(cfg, name="self_attn")(x, cos, sin, mask_bts, cache, keys_only)
        if keys_only:
            return None, cache
        h_btd = h_btd + a
        return h_btd + MLP(cfg, name="mlp")(norm("post_attention_layernorm")(h_btd)), cache


class Eagle1Module(nn.Module):
    cfg: DraftConfig

    @nn.compact
    def __call__(self, emb_btd, h_btd, cos, sin, mask_bts, cache=None, keys_only=False):
        lc = self.cfg.layer
        x = dense(lc, "fc", lc.hidden_size, self.cfg.fc_bias)(jnp.concatenate([emb_btd, h_btd], axis=-1))
        return DecoderLayer(lc, input_norm=False, name="layer")(x, cos, sin, mask_bts, cache, keys_only)


class Eagle3Module(nn.Module):
    cfg: DraftConfig

    def setup(self):
        lc = self.cfg.layer
        self.fc = dense(lc, None, lc.hidden_size, self.cfg.fc_bias)
        self.midlayer = Eagle3Layer(lc)
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps, lc.jnp_dtype)
        self.lm_head = dense(lc, None, self.cfg.draft_vocab_size, False)

    def __call__(self, emb_btd, h_btd, cos, sin, mask_bts, cache=None, keys_only=False):
        return self.midlayer(emb_btd, h_btd, cos, sin, mask_bts, cache, keys_only)

    def fuse(self, feats_btf):
        return self.fc(feats_btf)

    def logits(self, h_btd):
        return self.lm_head(self.norm(h_btd))

    def init_all(self, emb, h, feats, cos, sin, mask):
        return self(emb, h, cos, sin, mask), self.fuse(feats), self.logits(h)


def _module(cfg: DraftConfig):
    return Eagle3Module(cfg) if cfg.kind == "eagle3" else Eagle1Module(cfg)


@flax.struct.dataclass
class DraftHead:
    """A draft head: trainable `params`, EAGLE-3's `d2t` map (target id = i + d2t[i]), static config."""

    params: Any
    d2t: Optional[jax.Array] = None
    cfg: DraftConfig = flax.struct.field(pytree_node=False, default=None)


def init_head(cfg: DraftConfig, key: jax.Array, d2t=None) -> DraftHead:
    """Random head (normal 0.02 weights, unit norms). EAGLE-3 default d2t: the first Vd target ids."""
    lc = cfg.layer
    d = lc.hidden_size
    emb = jnp.zeros((1, 1, d), lc.jnp_dtype)
    cos = sin = jnp.zeros((1, 1, lc.head_dim), jnp.float32)
    mask = jnp.ones((1, 1, 1), bool)
    m = _module(cfg)
    if cfg.kind == "eagle3":
        feats = jnp.zeros((1, 1, cfg.feature_size), lc.jnp_dtype)
        p = m.init(key, emb, emb, feats, cos, sin, mask, method=Eagle3Module.init_all)["params"]
        if d2t is None:
            d2t = jnp.zeros((cfg.draft_vocab_size,), jnp.int32)
    else:
        p = m.init(key, emb, emb, cos, sin, mask)["params"]
    leaves, treedef = jax.tree_util.tree_flatten_with_path(p)
    keys = jax.random.split(key, len(leaves))
    p = jax.tree_util.tree_unflatten(treedef, [
        a if path[-1].key == "scale" else 0.02 * jax.random.normal(k, a.shape, a.dtype)
        for (path, a), k in zip(leaves, keys)])
    return DraftHead(p, None if d2t is None else jnp.asarray(d2t, jnp.int32), cfg)


def widen_mlp(head: DraftHead, intermediate_size: int, key: jax.Array) -> DraftHead:
    """The same function with a wider MLP: the new gate/up columns are those `init_head` draws for
    the wider head and the matching down_proj rows are zero, so every new unit outputs 0 until
    training moves it (a warm-started head gains capacity without losing what it had learned)."""
    old = head.cfg.layer.intermediate_size
    if intermediate_size < old:
        raise ValueError(f"cannot narrow the head's MLP from {old} to {intermediate_size}")
    if intermediate_size == old:
        return head
    if head.cfg.kind != "eagle3":
        raise ValueError(f"widen_mlp supports EAGLE-3 heads, not {head.cfg.kind}")
    cfg = head.cfg.replace(layer=head.cfg.layer.replace(intermediate_size=intermediate_size))
    fresh = init_head(cfg, key).params["midlayer"]["mlp"]
    mlp = head.params["midlayer"]["mlp"]
    grow = lambda name: jnp.concatenate([mlp[name]["kernel"], fresh[name]["kernel"][:, old:]], 1)
    down = mlp["down_proj"]["kernel"]
    new_mlp = {"gate_proj": {"kernel": grow("gate_proj")}, "up_proj": {"kernel": grow("up_proj")},
               "down_proj": {"kernel": jnp.concatenate([down, jnp.zeros_like(fresh["down_proj"]["kernel"][old:])], 0)}}
    params = {**head.params, "midlayer": {**head.params["midlayer"], "mlp": new_mlp}}
    return DraftHead(params, head.d2t, cfg)


def oracle_head(target_cfg, target_params, d2t=None) -> DraftHead:
    """The target drafting for itself: every draft token is the target's own top-k, so greedy
    speculation accepts whole paths. A drop-in `DraftHead` for tests and upper-bound measurements
    (with `d2t` it drafts over a reduced vocabulary, like an EAGLE-3 head)."""
    vd = None if d2t is None else int(np.shape(d2t)[0])
    cfg = DraftConfig("oracle", target_cfg, draft_vocab_size=vd)
    return DraftHead(target_params, None if d2t is None else jnp.asarray(d2t, jnp.int32), cfg)


def create_draft_cache(cfg: DraftConfig, batch: int, max_len: int) -> KVCache:
    """The head's KV cache (the oracle's keeps all target layers and one extra slot for t_0)."""
    return KVCache.create(cfg.layer, batch, max_len + (cfg.kind == "oracle"))


def seed_draft_cache(head: DraftHead, tokens_bs, cache: KVCache) -> KVCache:
    """Draft position j consumes token t_{j+1}; only the oracle also needs t_0 (its slot 0)."""
    if head.cfg.kind != "oracle":
        return cache
    b = tokens_bs.shape[0]
    out = forward(head.params, head.cfg.layer, tokens_bs[:, :1], jnp.zeros((b, 1), jnp.int32), cache,
                  slots_bt=jnp.zeros((b, 1), jnp.int32), attn_mask_bts=jnp.arange(cache.max_len)[None, None] == 0)
    return out.cache


def fuse_features(head: DraftHead, feats_btf):
    """The head's first-step input from target features (EAGLE-3: fc over the fused layers)."""
    if head.cfg.kind == "oracle":
        return feats_btf
    if head.cfg.kind == "eagle3":
        return _module(head.cfg).apply({"params": head.params}, feats_btf.astype(head.cfg.layer.jnp_dtype),
                                       method=Eagle3Module.fuse)
    return feats_btf


def head_step(head: DraftHead, embed_vd, tokens_bt, h_btd, positions_bt, cache: Optional[KVCache] = None,
              slots_bt=None, mask_bts=None, keys_only: bool = False):
    """One pass of the head over T (token, hidden) pairs.

    With a `RolloutKeys` (EAGLE-3 training-time test), the block attends as that structure says and
    it comes back with the block's keys added. With a cache, the block's keys go to `slots_bt`
    ([B, T] slots, dropped past the end, or a `layers.BlockStart` from a caller that guarantees the
    block fits: one window a layer, `layers.write_block`; default: cache.length + t) and the
    queries see the slots `mask_bts` allows (default: committed slots + causal inside the block);
    the cache's length is not advanced. Without a cache,
    `mask_bts` is [B, T, T] (default causal).
    Returns (h' [B, T, d], cache). `keys_only` (with a cache; not the oracle, whose keys need every
    layer's outputs): only the block's keys and values are computed and written, and h' is None.
    """
    lc = head.cfg.layer
    b, t = tokens_bt.shape
    if keys_only and (head.cfg.kind == "oracle" or not isinstance(cache, KVCache)):
        raise ValueError("keys_only needs a head with its own layer (not the oracle) and a KVCache")
    if head.cfg.kind == "oracle":
        return _oracle_step(head, tokens_bt, positions_bt, cache, slots_bt, mask_bts)
    emb = jnp.take(embed_vd, tokens_bt, axis=0).astype(lc.jnp_dtype)
    cos, sin = rope_cos_sin(lc, positions_bt)
    m = _module(head.cfg)
    if cache is None:
        if mask_bts is None:
            mask_bts = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
        out, _ = m.apply({"params": head.params}, emb, h_btd.astype(lc.jnp_dtype), cos, sin, mask_bts, None)
        return out, None
    if isinstance(cache, RolloutKeys):  # a training-time-test step: its own mask, its keys appended
        return m.apply({"params": head.params}, emb, h_btd.astype(lc.jnp_dtype), cos, sin, None, cache)
    if slots_bt is None:
        slots_bt = block_slots(BlockStart(cache.length), t)
    if mask_bts is None:
        mask_bts = _default_mask(cache, t)
    out, (k, v) = m.apply({"params": head.params}, emb, h_btd.astype(lc.jnp_dtype), cos, sin, mask_bts,
                          (cache.k, cache.v, 0, slots_bt), keys_only)
    return out, cache.replace(k=k, v=v)


def _default_mask(cache: KVCache, t: int):
    """Committed slots plus causal visibility inside a block written at cache.length."""
    rel = jnp.arange(cache.max_len)[None, None, :] - cache.length[:, None, None]
    return (rel < 0) | ((rel >= 0) & (rel <= jnp.arange(t)[None, :, None]))


def _oracle_step(head, tokens_bt, positions_bt, cache, slots_bt, mask_bts):
    """The target at draft positions: draft slot s is oracle slot s + 1 and position j + 1."""
    b, t = tokens_bt.shape
    tcfg = head.cfg.layer
    if cache is None:
        out = forward(head.params, tcfg, tokens_bt, positions_bt + 1, None,
                      block_mask_btt=mask_bts if mask_bts is not None else None)
        return out.hidden, None
    if slots_bt is None:
        slots_bt = block_slots(BlockStart(cache.length), t)
    if mask_bts is None:
        mask_bts = _default_mask(cache, t)
    mask = jnp.concatenate([jnp.ones((b, t, 1), bool), mask_bts[..., :-1]], axis=-1)
    slots = BlockStart(slots_bt.start_b + 1) if isinstance(slots_bt, BlockStart) else slots_bt + 1
    out = forward(head.params, tcfg, tokens_bt, positions_bt + 1, cache, slots_bt=slots, attn_mask_bts=mask)
    return out.hidden, out.cache


def head_logits(head: DraftHead, target_params, target_cfg, h_btd) -> jax.Array:
    """Float32 logits over the head's output vocabulary (draft vocab for EAGLE-3)."""
    if head.cfg.kind == "oracle":
        logits = lm_logits(head.params, head.cfg.layer, h_btd)
        if head.d2t is None:
            return logits
        return jnp.take(logits, jnp.arange(head.d2t.shape[0]) + head.d2t, axis=-1)
    if head.cfg.kind == "eagle3":
        return _module(head.cfg).apply({"params": head.params}, h_btd, method=Eagle3Module.logits).astype(jnp.float32)
    return lm_logits(target_params, target_cfg, h_btd)


def to_target_ids(head: DraftHead, draft_ids):
    """Map head-vocabulary ids to target ids (identity for EAGLE-1)."""
    if head.d2t is not None:
        return draft_ids + jnp.take(head.d2t, draft_ids)
    return draft_ids
