"""Building blocks of a Llama-family decoder layer (Flax linen, applied functionally).

Parameter names follow Hugging Face's module names (`self_attn.q_proj`, `mlp.gate_proj`, ...)
so checkpoint conversion is a transpose and a stack, never a lookup table.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .lowp_dense import LowpDense, use_lowp_dense


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as Hugging Face's LlamaRMSNorm does.

    `kernel` (the model under `matmul_impl == "cpu_kernel"`): the sum of squares goes through
    `kernels.cpu_matmul` (a product with a row of ones), which sums every row in one fixed order.
    XLA:CPU's own reduction changes its order with the number of rows (from about 10 rows of 256 on),
    so a token's norm, and with it its logits, would depend on how many tokens share the pass."""

    dim: int
    eps: float
    dtype: jnp.dtype = jnp.float32
    kernel: bool = False

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (self.dim,), self.dtype)
        xf = x.astype(jnp.float32)
        if self.kernel:
            from ..kernels.cpu_matmul import ANY_ROWS, matmul

            ones = jnp.ones((1, self.dim), jnp.float32)
            mean_sq = matmul(xf * xf, ones, "nk", max_rows=ANY_ROWS) / self.dim
        else:
            mean_sq = jnp.mean(xf * xf, axis=-1, keepdims=True)
        xf = xf * jax.lax.rsqrt(mean_sq + self.eps)
        return scale * xf.astype(x.dtype)


def rms_norm(cfg: ModelConfig, dim: int, name: Optional[str] = None) -> RMSNorm:
    """The model's RMSNorm over `dim`: through the CPU kernel's fixed-order sums under "cpu_kernel"."""
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.jnp_dtype, kernel=cfg.matmul_impl == "cpu_kernel", name=name)


def rope_cos_sin(cfg: ModelConfig, positions_bt: jax.Array):
    """cos, sin [B, T, head_dim] in float32 for integer positions (rotate-half layout)."""
    inv = jnp.asarray(cfg.rope_inv_freq())  # [Dh/2]
    freqs = positions_bt.astype(jnp.float32)[..., None] * inv  # B T Dh/2
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if cfg.matmul_impl != "cpu_kernel":
        return jnp.cos(emb), jnp.sin(emb)
    # XLA:CPU fuses cos and sin into every layer's rotation of q and k and evaluates them once per
    # head there (a 5-token tree's q: 13 µs a layer, 2 µs with them computed once). A conditional's
    # results are buffers, so they are computed here once; both branches are the same, so the
    # predicate (which XLA cannot fold) changes nothing. Only on the CPU kernel path: a GPU would
    # read the predicate on the host.
    both = lambda e: (jnp.cos(e), jnp.sin(e))
    return jax.lax.cond(jnp.all(positions_bt >= 0), both, both, emb)


def apply_rope(x_bthd: jax.Array, cos_btd: jax.Array, sin_btd: jax.Array, exact: bool = False) -> jax.Array:
    """x cos + rotate_half(x) sin. `exact` (float32 only): the same sum from exact products, so that
    a token's result does not depend on how the compiler contracts multiplies into adds (below)."""
    half = x_bthd.shape[-1] // 2
    rot = jnp.concatenate([-x_bthd[..., half:], x_bthd[..., :half]], axis=-1)
    cos = cos_btd[:, :, None, :].astype(x_bthd.dtype)
    sin = sin_btd[:, :, None, :].astype(x_bthd.dtype)
    if exact and x_bthd.dtype == jnp.float32:
        return _exact_product(x_bthd, cos) + _exact_product(rot, sin)
    return x_bthd * cos + rot * sin


# XLA:CPU lets LLVM contract a multiply and an add into one fused multiply-add wherever it likes
# (CompilerTargetOptions: AllowFPOpFusion = Fast, with no flag to turn it off), and `a * b + c * d`
# can become fma(a, b, c * d), fma(c, d, a * b) or neither. Which one a given element gets depends on
# how LLVM compiled the fused loop, and that changes with the loop's length: measured on SmolLM2 at
# XLA's backend optimisation levels 1 and 2 (XLA_FLAGS=--xla_backend_optimization_level=1|2), the
# rotated keys of a token differed in 56 of 192 values between a one-token decoding step and a
# three-token tree verification, so 10 of 16 benchmark prompts decoded speculatively drifted from
# plain decoding (levels 0 and 3 happened to compile both alike). A product that is exact leaves
# nothing for a contraction to change: fma(a, b, c) and (a * b) + c round the same exact sum once.
# So each factor is split into two halves of 12 significant bits (hi + lo, exactly), whose four
# products are exact in float32 (24 bits), and they are summed in a fixed order, paired so that no
# two products of a sum share a factor (XLA would be free to factor those). The result is x cos to
# within an ulp; only the decoding path whose bits must match across programs uses it.
def _split12(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 a = hi + lo exactly, each with at most 12 significant bits."""
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(a, jnp.int32) & jnp.int32(-4096), jnp.float32)
    return hi, a - hi


def _exact_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b (float32, broadcasting) summed from four exact products (see above)."""
    ah, al = _split12(a)
    bh, bl = _split12(b)
    return (ah * bh + al * bl) + (ah * bl + al * bh)


def _softmax_or_zeros(scores):
    """Softmax over the last axis of float32 scores with -inf for hidden keys; all-hidden rows → 0."""
    mx = jnp.max(scores, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(scores - mx)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def dense_attention(q_bthd, k_bshd, v_bshd, mask_bts):
    """Reference attention: softmax(q k^T / sqrt(d)) v over all S keys, masked by `mask_bts`.

    GQA: q has `num_heads` heads, k/v `num_kv_heads`; query head h reads kv head h // group.
    Scores and softmax are float32. Rows with no visible key return zeros (never NaN).
    """
    b, t, h, d = q_bthd.shape
    kvh = k_bshd.shape[2]
    g = h // kvh
    q = q_bthd.reshape(b, t, kvh, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k_bshd, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / jnp.sqrt(jnp.float32(d)))
    mask = mask_bts[:, None, None, :, :]
    p = _softmax_or_zeros(jnp.where(mask, scores, -jnp.inf))
    # The output keeps the scores' (b, k, g, t) order, then moves t forward: a small transpose of the
    # output instead of one of p or v inside the dot (on XLA:CPU 1.2-1.6x faster attention at every
    # shape measured, decode, tree and prefill; the same math, though XLA may order the float sums
    # differently: results agree to ~1e-6, and SmolLM2's greedy tokens were unchanged).
    out = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v_bshd.dtype), v_bshd, preferred_element_type=jnp.float32)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, d).astype(q_bthd.dtype)


def _cpu_attention():
    from ..kernels import cpu_attention  # imported on use: kernels/ imports this module

    return cpu_attention


class RolloutKeys(NamedTuple):
    """The keys an EAGLE-3 training-time-test step attends to, kept compact (pass it as `cache`).

    Rollout step i at index j sees the step-0 keys at the indices `mask0_btt` allows (causal, its
    own segment) and, for 1 <= s <= i, step s's key at index j itself (the "diagonal"). A dense
    [L, n·L] mask over all steps' keys would spend n times the score work on masked entries;
    here step i costs one [L, L] score block plus i scores per query.
    """

    mask0_btt: jax.Array  # [B, L, L] visibility among step-0 keys
    k0: Optional[jax.Array] = None  # [B, L, Hkv, Dh] step-0 keys and values (None before step 0)
    v0: Optional[jax.Array] = None
    kd: Optional[jax.Array] = None  # [B, L, S, Hkv, Dh] keys and values of steps 1..S at each index
    vd: Optional[jax.Array] = None

    def step(self, q_bthd, k_bthd, v_bthd):
        """This step's attention output, and the keys with this step's own added."""
        if self.k0 is None:  # step 0: causal attention over its own keys
            b, t, kvh, d = k_bthd.shape
            empty = jnp.zeros((b, t, 0, kvh, d), k_bthd.dtype)
            return (dense_attention(q_bthd, k_bthd, v_bthd, self.mask0_btt),
                    self._replace(k0=k_bthd, v0=v_bthd, kd=empty, vd=empty))
        keys = self._replace(kd=jnp.concatenate([self.kd, k_bthd[:, :, None]], axis=2),
                             vd=jnp.concatenate([self.vd, v_bthd[:, :, None]], axis=2))
        return rollout_attention(q_bthd, keys.k0, keys.v0, keys.kd, keys.vd, self.mask0_btt), keys


def rollout_attention(q_bthd, k0_bshd, v0_bshd, kd_btshd, vd_btshd, mask0_bts):
    """softmax over [the step-0 keys under `mask0_bts`; the S diagonal keys of query t's own index]
    — `dense_attention`'s math (float32 scores and softmax, GQA) on the compact TTT layout."""
    b, t, h, d = q_bthd.shape
    kvh = k0_bshd.shape[2]
    g = h // kvh
    l0 = k0_bshd.shape[1]
    q = q_bthd.reshape(b, t, kvh, g, d)
    scale = 1.0 / jnp.sqrt(jnp.float32(d))
    # Scores in (b, k, t, g, s) order — the order the dot produces from q's (t, g) — so neither the
    # [B, Hkv, T, G, S] float32 scores nor their gradient is transposed (the output, 1/S the size,
    # is): the same numbers, 15% faster forward and backward on XLA:CPU at the training shapes.
    s0 = jnp.einsum("btkgd,bskd->bktgs", q, k0_bshd, preferred_element_type=jnp.float32) * scale
    s0 = jnp.where(mask0_bts[:, None, :, None, :], s0, -jnp.inf)
    sd = jnp.einsum("btkgd,btskd->bktgs", q, kd_btshd, preferred_element_type=jnp.float32) * scale
    p = _softmax_or_zeros(jnp.concatenate([s0, sd], axis=-1))
    p0, pd = p[..., :l0].astype(v0_bshd.dtype), p[..., l0:].astype(vd_btshd.dtype)
    out = jnp.einsum("bktgs,bskd->bktgd", p0, v0_bshd, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bktgs,btskd->bktgd", pd, vd_btshd, preferred_element_type=jnp.float32)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, h, d).astype(q_bthd.dtype)


class KernelDense(nn.Module):
    """`nn.Dense` (same parameters: kernel [in, out], optional bias) whose product goes through
    `kernels.cpu_matmul` (few rows, float32, AVX-512 or AVX2); larger products fall back to XLA's dot.
    When the params also hold the layer's GGUF blocks ("q4_1" / "q8_0", `models/quantized.py`),
    few-row products read those instead: the same float32 result from a fifth of the bytes. A draft
    head's compact rows (`models.quantized.attach_draft_rows`: bfloat16 tiles "b16", int8 tiles
    "i8", Q8_0 blocks, or float16 rows "f16") are read the same way."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    max_rows: int = ModelConfig.kernel_rows  # the model's kernel_rows: larger products go through XLA's dot

    @nn.compact
    def __call__(self, x):
        from ..kernels.cpu_matmul import bmatmul, hmatmul, imatmul, matmul, qmatmul, quant_kind

        held = self.variables.get("params", {})
        kind = quant_kind(held)
        few = math.prod(x.shape[:-1]) <= self.max_rows
        if kind is not None and few:  # GGUF blocks (models/quantized.py)
            y = qmatmul(x, self.get_variable("params", kind), kind,
                        self.get_variable("params", f"{kind}_scales")).astype(self.dtype)
        elif "b16" in held and few:  # a draft head's bfloat16 tiles (approximate products)
            y = bmatmul(x.astype(jnp.float32), self.get_variable("params", "b16"), self.features).astype(self.dtype)
        elif "i8" in held and few:  # a draft head's int8 tiles (approximate products)
            y = imatmul(x.astype(jnp.float32), self.get_variable("params", "i8"),
                        self.get_variable("params", "i8_scales"), self.features).astype(self.dtype)
        elif "f16" in held and few and self.dtype == jnp.float32:  # the float16 values of a head's kernel
            y = hmatmul(x.astype(jnp.float32), self.get_variable("params", "f16"))
        else:  # only this path reads the float32 weights (`models.quantized.drop_shadowed_kernels`)
            kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                                self.param_dtype)
            y = matmul(x.astype(self.dtype), kernel.astype(self.dtype), max_rows=self.max_rows).astype(self.dtype)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype)
        return y


def fused_product(module: nn.Module, cfg: ModelConfig, name: str, x):
    """x through the GGUF blocks of several projections concatenated along their outputs (`name`:
    "qkv_proj" or "gate_up_proj", made by `models.quantized.attach_gguf_blocks`): one kernel call
    instead of three or two, each output summed exactly as its own projection's call would. None
    when the params hold no such blocks or the rows are too many for the kernel (then each
    projection's own `dense`, which has the float32 weights)."""
    if cfg.matmul_impl != "cpu_kernel" or math.prod(x.shape[:-1]) > cfg.kernel_rows:
        return None
    from ..kernels.cpu_matmul import qmatmul, quant_kind

    node = module.variables.get("params", {}).get(name)
    kind = quant_kind(node) if node is not None else None
    if kind is None:
        return None
    return qmatmul(x, node[kind], kind, node.get(f"{kind}_scales")).astype(cfg.jnp_dtype)


def _bias(module: nn.Module, name: str):
    return module.variables["params"][name]["bias"]


def dense(cfg: ModelConfig, name: Optional[str], features: int, use_bias: bool) -> nn.Module:
    """The model's linear layer: `nn.Dense`, `KernelDense` when `cfg.matmul_impl == "cpu_kernel"`, or
    `LowpDense` (the same parameters) for bfloat16/float16 compute on the CPU backend."""
    dt = cfg.jnp_dtype
    if cfg.matmul_impl == "cpu_kernel":
        return KernelDense(features, use_bias=use_bias, dtype=dt, param_dtype=dt, max_rows=cfg.kernel_rows, name=name)
    cls = LowpDense if use_lowp_dense(dt) else nn.Dense
    return cls(features, use_bias=use_bias, dtype=dt, param_dtype=dt, name=name)


class BlockStart(NamedTuple):
    """Cache slots `start_b[b] + t` for a block's T keys, one contiguous run per row, from a caller
    that guarantees the run lies inside the cache (0 <= start_b and start_b + T <= S in every row):
    tree verification, whose cache has room for the tree past the committed length, and the draft
    head's levels and re-feed, whose cache has room for the scratch and the longest path. Prefill
    chunks, whose padding may run past the end, give slots as a [B, T] array instead (slots past
    the end are dropped). Before stop 71 the head's writes were scatters: as windows they had made
    the SmolLM2 oracle drafter's tests run 4-5x as long, while drafting wrote into a copy of the
    head's cache (for the oracle, the 30-layer target's); without that copy
    (`drafting.draft_tree_and_cache`) they take as long as the scatters did."""

    start_b: jax.Array  # [B] int32


def block_slots(slots, t: int) -> jax.Array:
    """Slots [B, T] of a block, from a `BlockStart` or as given."""
    if isinstance(slots, BlockStart):
        return slots.start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return slots


def write_block(all_lbshd, layer, slots, x_bthd):
    """`all_lbshd` [L, B, S, Hkv, Dh] with layer `layer`'s slots of the block set to `x_bthd` [B, T,
    Hkv, Dh].

    Slots as a [B, T] array go through a scatter that drops slots outside [0, S). A `BlockStart`
    block of T > 1 keys in one row, in an unrolled layer (`layer` a Python int), is written as one
    window: a dynamic-update-slice. Several rows, or layers under `lax.scan` (a traced index), keep
    the scatter: with them the SmolLM2 speculative tests (3 rows, scanned layers) ran 1.4-2.7x as
    long in CI. With the decoding programs' options (`cpu_jit`) XLA:CPU
    expands a scatter into a loop over its T keys, a few operations each, and a 3-token verification
    of SmolLM2 ran 60 of them a step (keys and values of 30 layers). A window cannot drop the keys
    past the end (its start is clamped instead), hence `BlockStart`'s guarantee; keeping the old
    contents there by reading the window back made XLA copy the whole stacked cache at every layer
    (stops 55 and 65). One key (T = 1), which XLA writes as one update anyway, keeps the scatter."""
    b, t = x_bthd.shape[:2]
    x_bthd = x_bthd.astype(all_lbshd.dtype)
    if not isinstance(slots, BlockStart) or t == 1 or b != 1 or not isinstance(layer, int):
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        return all_lbshd.at[layer, rows, block_slots(slots, t)].set(x_bthd, mode="drop")
    zero = jnp.int32(0)
    start = slots.start_b.astype(jnp.int32)[0]
    return jax.lax.dynamic_update_slice(all_lbshd, x_bthd[None], (jnp.int32(layer), zero, start, zero, zero))


class Attention(nn.Module):
    """Grouped-query self-attention with optional q/k/v bias, q/k RMSNorm and a shared KV cache.

    `cache` is None (attend within the block only), a `RolloutKeys` (an EAGLE-3 training-time-test
    step; returned with this step's keys added) or `(k, v, layer, slots)`: the full stacked
    cache `[L, B, S, Hkv, Dh]`, this layer's index, and the cache slots the block's keys go to
    ([B, T], or a `BlockStart`). The new keys are written in place (`write_block`; array slots past
    the end are dropped) and the queries attend to all S slots of this layer under `mask_bts`, or,
    when `mask_bts` is a `kernels.BlockMask` (compact: committed length, block bitmask, positions),
    through the Pallas tree-attention kernel.
    Under `matmul_impl == "cpu_kernel"` few-query blocks attend through `kernels.cpu_attention`,
    which reads the layer's keys and values where they lie in the stacked cache.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_btd, cos, sin, mask_bts, cache=None, keys_only: bool = False):
        cfg = self.cfg
        b, t, _ = x_btd.shape
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = fused_product(self, cfg, "qkv_proj", x_btd)
        if qkv is not None:
            q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
            if cfg.qkv_bias:
                q, k, v = (y + _bias(self, n).astype(y.dtype)
                           for y, n in zip((q, k, v), ("q_proj", "k_proj", "v_proj")))
        else:
            q = None if keys_only else dense(cfg, "q_proj", nq, cfg.qkv_bias)(x_btd)
            k = dense(cfg, "k_proj", nkv, cfg.qkv_bias)(x_btd)
            v = dense(cfg, "v_proj", nkv, cfg.qkv_bias)(x_btd)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = rms_norm(cfg, cfg.head_dim, "k_norm")(k)
        exact = cfg.matmul_impl == "cpu_kernel"  # the path that promises the same bits in every program
        k = apply_rope(k, cos, sin, exact)
        if keys_only:  # the block's keys and values written to the cache, no queries (a prompt's positions
            # whose outputs no one reads: `speculative.draft_prefill`)
            k_all, v_all, layer, slots = cache
            return None, (write_block(k_all, layer, slots, k), write_block(v_all, layer, slots, v))
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(cfg, cfg.head_dim, "q_norm")(q)
        q = apply_rope(q, cos, sin, exact)
        if cache is None:
            out = dense_attention(q, k, v, mask_bts)
        elif isinstance(cache, RolloutKeys):
            out, cache = cache.step(q, k, v)
        else:
            k_all, v_all, layer, slots = cache
            k_all, v_all = write_block(k_all, layer, slots, k), write_block(v_all, layer, slots, v)
            if isinstance(mask_bts, tuple):  # kernels.BlockMask: the Pallas kernel, new keys read from k/v
                from ..kernels.tree_attention import tree_attention

                length_b, bits_btw, q_pos_bt = mask_bts
                out = tree_attention(q, k_all[layer], v_all[layer], length_b, k, v, bits_btw, q_pos_bt,
                                     window=cfg.sliding_window, impl="pallas")
            elif cfg.matmul_impl == "cpu_kernel" and _cpu_attention().usable(q, k_all, cfg.kernel_rows):  # in place
                mask_bts = jnp.broadcast_to(mask_bts, (b, t, k_all.shape[2]))
                out = _cpu_attention().cache_attention(q, k_all, v_all, layer, mask_bts)
            else:
                out = dense_attention(q, k_all[layer], v_all[layer], mask_bts)
            cache = (k_all, v_all)
        out = dense(cfg, "o_proj", cfg.hidden_size, cfg.o_bias)(out.reshape(b, t, cfg.num_heads * cfg.head_dim))
        return out, cache


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate_up = fused_product(self, cfg, "gate_up_proj", x)
        if gate_up is not None:
            gate, up = gate_up[..., :cfg.intermediate_size], gate_up[..., cfg.intermediate_size:]
            if cfg.mlp_bias:
                gate = gate + _bias(self, "gate_proj").astype(gate.dtype)
                up = up + _bias(self, "up_proj").astype(up.dtype)
        else:
            gate = dense(cfg, "gate_proj", cfg.intermediate_size, cfg.mlp_bias)(x)
            up = dense(cfg, "up_proj", cfg.intermediate_size, cfg.mlp_bias)(x)
        return dense(cfg, "down_proj", cfg.hidden_size, cfg.mlp_bias)(jax.nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)); then + mlp(norm(x)).

    `input_norm=False` drops the first norm (the EAGLE-1 draft layer feeds fc's output straight in)."""

    cfg: ModelConfig
    input_norm: bool = True

    @nn.compact
    def __call__(self, x_btd, cos, sin, mask_bts, cache: Optional[tuple] = None, keys_only: bool = False):
        cfg = self.cfg
        h = rms_norm(cfg, cfg.hidden_size, "input_layernorm")(x_btd) if self.input_norm else x_btd
        a, cache = Attention(cfg, name="self_attn")(h, cos, sin, mask_bts, cache, keys_only)
        if keys_only:
            return None, cache
        x_btd = x_btd + a
        h = rms_norm(cfg, cfg.hidden_size, "post_attention_layernorm")(x_btd)
        return x_btd + MLP(cfg, name="mlp")(h), cache
