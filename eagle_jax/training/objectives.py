"""Training objectives of the EAGLE heads.

Indexing (both kinds): tokens t_0..t_{L-1}; target features f_j are computed by the target over
t_0..t_j. The head at position j reads (f_j, t_{j+1}) and predicts what follows t_{j+1}, i.e. the
target's feature/distribution at position j+1 (the next token t_{j+2}); a position counts when
t_{j+2} is an assistant token.

EAGLE-1:  loss = v_weight · SmoothL1(h'_j, f_{j+1}) + p_weight · CE(p_target(j+1), p_head(j)), with
          uniform noise U(-a, a) on the input features (a = noise).
EAGLE-3:  training-time test — `ttt_length` rollout steps; step 0 reads the fused target features,
          step i reads the head's own step-(i-1) outputs with tokens shifted by i, at positions j+i.
          Step i at index j attends to the step-0 keys at indices ≤ j (the real prefix) and to the
          step-s keys at index j for 1 ≤ s ≤ i (its own drafted chain: the "diagonal" mask).
          It runs on the compact `RolloutKeys` layout: one [L, L] score block plus i diagonal scores
          a query, not a dense [L, n·L] mask (the same softmax; tested against step-by-step drafting
          through the inference cache). Loss: soft cross-entropy against the target's
          distribution restricted to the draft vocabulary, weighted step_decay**i; positions whose
          target argmax is outside the draft vocabulary are left out of the loss (as SpecForge does).
Both:     `greedy_weight` w mixes the target's greedy token into the distribution the head learns,
          (1 - w) · p_target + w · onehot(argmax p_target). 0 (the default) is the papers' soft
          target; w > 0 trains the head's top-1 (and its confidences, which rank a dynamic tree's
          nodes) toward the event greedy verification accepts — the target's argmax — rather than
          toward the target's whole distribution, which a small head cannot match.
Metrics: `loss`, `acc_i` (top-1 of rollout step i against the target's argmax; EAGLE-1 has acc_0
only), `ploss_i`, and for EAGLE-1 `vloss`. EAGLE-3's `acc_i` is over every scored position (assistant
target, same segment), as in SpecForge: a position whose target argmax is outside the draft vocabulary
stays in the denominator and counts as a miss (the head cannot name it), although the loss skips it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ..draft.heads import DraftHead, fuse_features, head_logits, head_step
from ..models.config import ModelConfig
from ..models.decoder import forward, lm_logits
from ..models.layers import RolloutKeys


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    kind: str = "eagle3"  # "eagle1" | "eagle3"
    ttt_length: int = 7  # EAGLE-3 rollout steps
    step_decay: float = 0.8  # EAGLE-3 weight of step i: step_decay**i
    noise: float = 0.2  # EAGLE-1 uniform feature noise amplitude (0 = off)
    v_weight: float = 1.0  # EAGLE-1 SmoothL1 weight
    p_weight: float = 0.1  # EAGLE-1 cross-entropy weight
    # The head's matmuls run in this dtype (mixed precision: the trained params, the optimizer and
    # the loss stay float32; the head sees a cast copy). "bfloat16" is several times faster where the
    # CPU has bf16 matrix units (AMX, AVX512-BF16) and on TPUs/GPUs.
    compute_dtype: str = "float32"
    greedy_weight: float = 0.0  # weight of onehot(target argmax) in the learned distribution

    def __post_init__(self):
        if self.kind not in ("eagle1", "eagle3"):
            raise ValueError(f"objective kind must be eagle1 or eagle3, got {self.kind!r}")
        if self.compute_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"compute_dtype must be float32, bfloat16 or float16, got {self.compute_dtype!r}")
        if self.ttt_length < 1:
            raise ValueError("ttt_length must be >= 1")
        if not 0.0 <= self.greedy_weight <= 1.0:
            raise ValueError(f"greedy_weight must lie in [0, 1], got {self.greedy_weight}")


def _with_greedy(t_p_blv, argmax_bl, w: float):
    """(1 - w) · t_p + w · onehot(argmax) over the last axis (argmax indexes that axis; an index
    outside it adds nothing: such positions are masked out of the loss)."""
    if not w:
        return t_p_blv
    onehot = argmax_bl[..., None] == jnp.arange(t_p_blv.shape[-1], dtype=argmax_bl.dtype)
    return (1.0 - w) * t_p_blv + w * onehot.astype(t_p_blv.dtype)


def teacher(target_params, tcfg: ModelConfig, head_cfg, input_ids_bl, segment_ids_bl=None, positions_bl=None):
    """The frozen target's view of a batch: (features for the head [B, L, F], final-norm hidden [B, L, D]).
    Packed rows (segment ids and per-segment positions given): each example sees only itself."""
    capture = tuple(head_cfg.target_layers) if head_cfg.kind == "eagle3" else (tcfg.num_layers,)
    mask = None if segment_ids_bl is None else _causal_in_segment(segment_ids_bl)
    out = forward(jax.lax.stop_gradient(target_params), tcfg, input_ids_bl, positions_bl, block_mask_btt=mask,
                  capture=capture)
    feats = out.captured[0] if len(capture) == 1 else jnp.concatenate(out.captured, axis=-1)
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(out.hidden)


def _shift(x, n: int, fill=0):
    """x[:, j + n] at index j (padded with `fill` past the end)."""
    if n == 0:
        return x
    pad = [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad, constant_values=fill)[:, n:]


def _segments(batch):
    """(segment ids [B, L], positions [B, L]): a packed batch's own, else one segment per row."""
    if "segment_ids" in batch:
        return batch["segment_ids"], batch["positions"]
    b, l = batch["input_ids"].shape
    return _valid(batch).astype(jnp.int32), jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None], (b, l))


def _causal_in_segment(seg_bl):
    """[B, L, L]: causal visibility restricted to the query's own segment."""
    l = seg_bl.shape[1]
    return jnp.tril(jnp.ones((l, l), bool))[None] & (seg_bl[:, :, None] == seg_bl[:, None, :])


def _same_segment(seg_bl, n: int):
    """[B, L] float: index j + n lies in j's segment (so a target n ahead belongs to j's example)."""
    return ((seg_bl == _shift(seg_bl, n, fill=-1)) & (seg_bl > 0)).astype(jnp.float32)


def _masked_mean(x, m):
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def _valid(batch):
    b, l = batch["input_ids"].shape
    return (jnp.arange(l)[None, :] < batch["lengths"][:, None]).astype(jnp.float32)


def eagle1_loss(head: DraftHead, target_params, tcfg: ModelConfig, batch, feats_bld, rng, ocfg: ObjectiveConfig):
    ids = batch["input_ids"]
    seg, pos = _segments(batch)
    # t_{j+2} is an assistant token of j's own example
    mask = _shift(batch["loss_mask"] * _valid(batch), 2) * _same_segment(seg, 2)
    noise = jax.random.uniform(rng, feats_bld.shape, jnp.float32, -ocfg.noise, ocfg.noise) if ocfg.noise else 0.0
    embed = target_params["embed_tokens"]["embedding"]
    h, _ = head_step(head, embed, _shift(ids, 1), (feats_bld + noise).astype(feats_bld.dtype), pos,
                     mask_bts=_causal_in_segment(seg))
    target_f = _shift(feats_bld, 1)
    diff = jnp.abs(h.astype(jnp.float32) - target_f.astype(jnp.float32))
    vloss = _masked_mean(jnp.mean(jnp.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5), -1), mask)
    t_logits = lm_logits(target_params, tcfg, target_f)
    logits = lm_logits(target_params, tcfg, h)
    t_arg = jnp.argmax(t_logits, -1)
    t_p = _with_greedy(jax.nn.softmax(t_logits, -1), t_arg, ocfg.greedy_weight)
    ploss_tok = -jnp.sum(t_p * jax.nn.log_softmax(logits, -1), -1)
    ploss = _masked_mean(ploss_tok, mask)
    acc = _masked_mean((jnp.argmax(logits, -1) == t_arg).astype(jnp.float32), mask)
    loss = ocfg.v_weight * vloss + ocfg.p_weight * ploss
    return loss, {"loss": loss, "vloss": vloss, "ploss_0": ploss, "acc_0": acc, "tokens": jnp.sum(mask)}


def target_top1(target_params, tcfg: ModelConfig, hidden_bld):
    """(the target's top-1 probability, its greedy token) at every position: the full-vocabulary LM
    head one row at a time (a [B, L, V] block of logits would be too big)."""

    def row(h_ld):
        logits = lm_logits(target_params, tcfg, h_ld).astype(jnp.float32)
        return jnp.exp(jnp.max(logits, -1) - jax.nn.logsumexp(logits, -1)), jnp.argmax(logits, -1)

    return jax.lax.map(row, hidden_bld)


def target_argmax(target_params, tcfg: ModelConfig, hidden_bld):
    """The target's greedy token at every position."""
    return target_top1(target_params, tcfg, hidden_bld)[1]


def _draft_logits(target_params, tcfg: ModelConfig, hidden_bld, draft_ids):
    """The target's logits restricted to the draft vocabulary (only those LM-head rows are computed)."""
    if tcfg.tie_word_embeddings:
        w = jnp.take(target_params["embed_tokens"]["embedding"], draft_ids, axis=0)  # Vd D
        return jnp.einsum("bld,vd->blv", hidden_bld, w, preferred_element_type=jnp.float32)
    w = jnp.take(target_params["lm_head"]["kernel"], draft_ids, axis=1)
    return jnp.einsum("bld,dv->blv", hidden_bld, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def soft_ce_ahead(logits_blv, t_p_blv, n: int):
    """[B, L]: the soft cross-entropy -Σ_v t_p[j + n, v] · log_softmax(logits[j])_v (0 for the
    last n indices), computed in float32 from the logits as lse_j · Σ_v t_p - Σ_v t_p · logits.

    The same numbers as `log_softmax` followed by a product with `_shift(t_p, n)`, in far fewer
    passes over the [B, L, V] arrays: no padded copy of t_p, no log-probabilities written out, and
    a backward pass that is one fused sweep, d logits = g · (Σ t_p · softmax(logits) - t_p). On a
    CPU these sweeps (≈ 100 MB each at batch 8 × 384 × 8192) cost more than the LM head's matmuls.
    t_p gets no gradient (the target's distribution is a constant)."""
    return _soft_ce_fwd(logits_blv, t_p_blv, n)[0]


def _soft_ce_parts(logits_blv, t_p_blv, n: int):
    l = logits_blv.shape[1]
    x = logits_blv[:, :l - n].astype(jnp.float32)
    tp = t_p_blv[:, n:].astype(jnp.float32)
    lse = jax.nn.logsumexp(x, -1)
    return x, tp, lse, jnp.sum(tp, -1)


def _soft_ce_fwd(logits_blv, t_p_blv, n: int):
    x, tp, lse, mass = _soft_ce_parts(logits_blv, t_p_blv, n)
    ce = lse * mass - jnp.sum(tp * x, -1)
    return jnp.pad(ce, [(0, 0), (0, n)]), (logits_blv, t_p_blv, lse, mass)


def _soft_ce_bwd(n: int, res, g_bl):
    logits_blv, t_p_blv, lse, mass = res
    l = logits_blv.shape[1]
    x = logits_blv[:, :l - n].astype(jnp.float32)
    tp = t_p_blv[:, n:].astype(jnp.float32)
    g = g_bl[:, :l - n, None]
    d = g * (mass[..., None] * jnp.exp(x - lse[..., None]) - tp)
    return jnp.pad(d, [(0, 0), (0, n), (0, 0)]).astype(logits_blv.dtype), jnp.zeros_like(t_p_blv)


soft_ce_ahead.defvjp(_soft_ce_fwd, _soft_ce_bwd)


def eagle3_loss(head: DraftHead, target_params, tcfg: ModelConfig, batch, feats_blf, hidden_bld, rng,
                ocfg: ObjectiveConfig):
    """`batch` may carry "target_argmax" (cached offline); otherwise it is computed here."""
    del rng
    ids = batch["input_ids"]
    n = ocfg.ttt_length
    embed = target_params["embed_tokens"]["embedding"]
    draft_ids = jnp.arange(head.cfg.draft_vocab_size) + head.d2t  # target id of each draft token
    t_argmax = batch["target_argmax"] if "target_argmax" in batch else target_argmax(target_params, tcfg, hidden_bld)
    # target id → draft id (-1: not in the draft vocabulary)
    draft_index = jnp.full((tcfg.vocab_size,), -1, jnp.int32).at[draft_ids].set(jnp.arange(draft_ids.shape[0]))
    in_draft = draft_index >= 0
    t_p = jax.nn.softmax(_draft_logits(target_params, tcfg, hidden_bld, draft_ids), -1)  # B L Vd
    t_p = _with_greedy(t_p, draft_index[t_argmax], ocfg.greedy_weight)
    base_mask = batch["loss_mask"] * _valid(batch)
    seg, pos0 = _segments(batch)
    # step-0 keys: causal, and only the query's own segment (a packed row's other examples stay
    # invisible); later steps add their own key at each index (RolloutKeys)
    keys = RolloutKeys(_causal_in_segment(seg))
    h = fuse_features(head, feats_blf)
    loss, metrics = 0.0, {}
    for i in range(n):
        h, keys = head_step(head, embed, _shift(ids, 1 + i), h, pos0 + i, keys)
        logits = head_logits(head, target_params, tcfg, h)
        tgt_arg = _shift(t_argmax, 1 + i)
        scored = _shift(base_mask, 2 + i) * _same_segment(seg, 2 + i)
        ploss = _masked_mean(soft_ce_ahead(logits, t_p, 1 + i), scored * in_draft[tgt_arg])
        pred = draft_ids[jnp.argmax(logits, -1)]
        metrics[f"ploss_{i}"] = ploss
        # every scored position counts: a target token outside the draft vocabulary is a miss (SpecForge)
        metrics[f"acc_{i}"] = _masked_mean((pred == tgt_arg).astype(jnp.float32), scored)
        loss = loss + ocfg.step_decay ** i * ploss
    metrics["loss"] = loss
    metrics["tokens"] = jnp.sum(_shift(base_mask, 2) * _same_segment(seg, 2))
    return loss, metrics


def make_loss_fn(ocfg: ObjectiveConfig, head_cfg, tcfg: ModelConfig) -> Callable:
    """`loss_fn(params, aux, batch, rng) -> (loss, metrics)` for the trainer.

    aux: {"target": target params, "d2t": draft→target offsets (EAGLE-3)}. Features come from the
    batch when it carries them (offline: "features", "hidden") or from the frozen target (online).
    """
    if ocfg.kind != head_cfg.kind:
        raise ValueError(f"objective {ocfg.kind} does not fit a {head_cfg.kind} head")

    run_cfg = head_cfg
    if ocfg.compute_dtype != head_cfg.layer.dtype:
        run_cfg = head_cfg.replace(layer=head_cfg.layer.replace(dtype=ocfg.compute_dtype))

    def loss_fn(params, aux, batch, rng):
        if run_cfg is not head_cfg:  # a cast copy: gradients flow back to the float32 params
            params = jax.tree.map(lambda x: x.astype(run_cfg.layer.jnp_dtype), params)
        head = DraftHead(params, aux.get("d2t"), run_cfg)
        if "features" in batch:
            feats, hidden = batch["features"], batch.get("hidden")
        else:
            feats, hidden = teacher(aux["target"], tcfg, head_cfg, batch["input_ids"], batch.get("segment_ids"),
                                    batch.get("positions"))
        if ocfg.kind == "eagle1":
            return eagle1_loss(head, aux["target"], tcfg, batch, feats, rng, ocfg)
        return eagle3_loss(head, aux["target"], tcfg, batch, feats, hidden, rng, ocfg)

    return loss_fn
