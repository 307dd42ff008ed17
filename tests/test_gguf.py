"""GGUF loading (eagle_jax.models.gguf_loader): every tensor type read as gguf dequantises it, in
Hugging Face shapes; conversion to an HF directory; errors that name the tensor; parity against
transformers' own GGUF loader (names, shapes and the q/k un-permutation end to end), on tiny random
files (gguf_util.py) and on the real SmolLM2."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf_util import (BOS, EOS, MIXED_TYPES, QT, REAL_ALIAS, TOKENS, _eagle_logits, _hf_gguf_model,  # noqa: E402
                       _torch_logits, gguf, hf_layout, tiny_config, to_file_order, write_tiny_gguf)

from eagle_jax.models import registry  # noqa: E402
from eagle_jax.models.checkpoint import CheckpointError, load_hf_dir, params_from_hf_state_dict  # noqa: E402
from eagle_jax.models.config import ModelConfig  # noqa: E402
from eagle_jax.models.gguf_loader import (  # noqa: E402
    GGUFError, convert_gguf_to_hf_dir, gguf_tokenizer, read_gguf)

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
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
                 "model.layers.1.input_layernorm.weight"):
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
    ("llama", True, {"model.layers.0.self_attn.q_proj.weight": "Q8_0",
                     "model.layers.1.self_attn.k_proj.weight": "Q4_K"}),
    ("qwen2", False, {"model.layers.0.self_attn.q_proj.weight": "Q4_0", "model.layers.1.mlp.up_proj.weight": "Q6_K"}),
    ("qwen3", True, {"model.layers.0.self_attn.k_proj.weight": "Q4_1",
                     "model.layers.1.self_attn.o_proj.weight": "Q4_K"}),
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
