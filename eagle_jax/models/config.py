"""Target-model configuration: one frozen dataclass for every Llama-family decoder.

Llama 2/3, Qwen2, Qwen3 and Mistral differ only in a handful of switches (biases, q/k norms,
RoPE scaling, sliding window), so one config and one decoder cover them all. `from_hf_config`
maps a Hugging Face `config.json` (dict or `PretrainedConfig`) onto it and raises on any field
it does not understand, instead of silently computing something else.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np


class UnsupportedConfigError(ValueError):
    """A Hugging Face config asks for something this decoder does not implement."""


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

# Fields that carry no numerical meaning for inference (metadata, training-only switches).
_IGNORED_HF_FIELDS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
    "unk_token_id", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
    "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "max_window_layers",  # only consulted when use_sliding_window is true (rejected below)
    "_attn_implementation_autoset", "quantization_config_applied", "tie_encoder_decoder",
})
# Fields that this config maps (possibly after validation).
_MAPPED_HF_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "attention_bias", "mlp_bias", "pretraining_tp", "sliding_window", "use_sliding_window",
    "layer_types",
})
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind`: default (none), linear (position interpolation) or llama3."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self):
        if self.kind not in _ROPE_TYPES:
            raise UnsupportedConfigError(
                f"rope scaling type {self.kind!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
        if self.factor <= 0:
            raise UnsupportedConfigError(f"rope scaling factor must be positive, got {self.factor}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    `dtype` is the parameter/activation dtype ("float32" is the fast one on CPU, "bfloat16" on
    TPU/GPU); attention softmax and RMSNorm always accumulate in float32. `attention_impl` picks the
    attention used for tree verification ("reference" jnp or "pallas"); `matmul_impl` the weight
    products ("xla", or "cpu_kernel": the AVX-512/AVX2 custom call of `kernels.cpu_matmul` for products
    of at most `kernel_rows` rows, and `kernels.cpu_attention` for blocks of at most `kernel_rows`
    queries a row; an inference path without gradients). Larger products (prefill chunks) go
    through XLA; decoding steps and tree verifications raise `kernel_rows` to their own row count
    (`for_rows`), so a token's logits come from the same kernels whatever the batch or tree size.
    """

    family: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None  # Mistral: keys further back than this are masked
    dtype: str = "float32"
    attention_impl: str = "reference"
    matmul_impl: str = "xla"  # "cpu_kernel": few-row products through kernels/cpu_matmul (inference on x86 CPUs)
    kernel_rows: int = 16  # with "cpu_kernel": the most rows a product takes the kernels for (= cpu_matmul.MAX_ROWS)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UnsupportedConfigError(f"model family {self.family!r} is not supported ({', '.join(FAMILIES)})")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.attention_impl not in ("reference", "pallas"):
            raise UnsupportedConfigError(f"attention_impl must be 'reference' (jnp) or 'pallas' (the tree-attention "
                                         f"kernel), got {self.attention_impl!r}")
        if self.matmul_impl not in ("xla", "cpu_kernel"):
            raise UnsupportedConfigError(f"matmul_impl must be 'xla' or 'cpu_kernel' (the few-row CPU matmul), "
                                         f"got {self.matmul_impl!r}")
        if self.kernel_rows < 1:
            raise UnsupportedConfigError(f"kernel_rows must be at least 1, got {self.kernel_rows}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise UnsupportedConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise UnsupportedConfigError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def jnp_dtype(self):
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def for_rows(self, rows: int) -> "ModelConfig":
        """This config with the CPU kernels taking products of up to `rows` rows (and blocks of up to
        `rows` queries a row): what a decoding step ([B, 1]) and a tree verification ([B, N]) run
        with, so that each token's logits are the kernels' one-row results bit for bit whatever
        the batch or tree size (the kernels sum every row in one order, whatever rows share a
        call). Without the kernels, or for rows within `kernel_rows`, the config itself."""
        if self.matmul_impl != "cpu_kernel" or rows <= self.kernel_rows:
            return self
        return dataclasses.replace(self, kernel_rows=int(rows))

    # ------------------------------------------------------------------ RoPE
    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] (float64 numpy; static per config)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = self.rope_scaling
        if rs.kind == "linear":
            inv = inv / rs.factor
        elif rs.kind == "llama3":
            low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
            high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor)
            smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)

    # ------------------------------------------------------------------ HF mapping
    @classmethod
    def from_hf_config(cls, hf: Any, **overrides) -> "ModelConfig":
        """Build from a Hugging Face config (dict or `PretrainedConfig`); raise on anything unsupported."""
        d = dict(hf.to_dict() if hasattr(hf, "to_dict") else hf)
        unknown = sorted(k for k in d if k not in _MAPPED_HF_FIELDS and k not in _IGNORED_HF_FIELDS)
        if unknown:
            raise UnsupportedConfigError(f"unsupported config field(s): {', '.join(unknown)}")
        family = d.get("model_type", "llama")
        if family not in FAMILIES:
            raise UnsupportedConfigError(f"model_type {family!r} is not supported ({', '.join(FAMILIES)})")
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedConfigError(f"hidden_act {d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedConfigError("pretraining_tp > 1 is not supported")
        if d.get("use_sliding_window") and family != "mistral":
            raise UnsupportedConfigError("use_sliding_window=true is not supported for " + family)
        layer_types = d.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            if family != "mistral":
                raise UnsupportedConfigError(
                    f"layer_types other than full_attention are not supported: {set(layer_types)}")

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope = dict(rope)
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        # "type" is the older spelling; a config that went through transformers can carry both
        kinds = {str(rope.pop(k)) for k in ("rope_type", "type") if rope.get(k) is not None}
        if len(kinds) > 1:
            raise UnsupportedConfigError(f"rope scaling names two types: {' and '.join(sorted(kinds))}")
        kind = kinds.pop() if kinds else "default"
        unknown_rope = sorted(set(rope) - {"factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings"})
        if unknown_rope:
            raise UnsupportedConfigError(f"unsupported rope scaling field(s): {', '.join(unknown_rope)}")
        if kind == "default":
            rope.pop("factor", None)
        scaling = RopeScaling(kind=kind, **{k: (float(v) if k != "original_max_position_embeddings" else int(v))
                                            for k, v in rope.items()})

        heads = d["num_attention_heads"]
        bias = bool(d.get("attention_bias", False))
        sliding = d.get("sliding_window") if family == "mistral" else None
        kwargs = dict(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else bias,
            o_bias=bias if family in ("llama", "mistral") else False,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
        )
        if family == "qwen3" and bias:
            kwargs["qkv_bias"] = True
            kwargs["o_bias"] = True
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_config(self) -> dict:
        """The Hugging Face `config.json` dict for this config (loadable by transformers)."""
        rs = self.rope_scaling
        rope = {"rope_type": rs.kind, "rope_theta": self.rope_theta}
        if rs.kind == "linear":
            rope["factor"] = rs.factor
        elif rs.kind == "llama3":
            rope.update(factor=rs.factor, low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                        original_max_position_embeddings=rs.original_max_position_embeddings)
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM"}[self.family]
        d = {
            "architectures": [arch], "model_type": self.family, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.family in ("llama", "qwen3"):
            d["attention_bias"] = self.o_bias if self.family == "llama" else self.qkv_bias
        if self.family == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.family == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.family in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        return d
