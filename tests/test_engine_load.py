"""What an Engine's start skips: the model configs (and PyTorch) that `AutoTokenizer` imports, where
the directory already names its tokenizer class (`text_codec.load_tokenizer`), and, under int8 rows of
x, the float32 layer weights that the GGUF blocks replace (`load_hf_dir(omit=...)`, checked against
the checkpoint instead, `attach_gguf_blocks(reference=...)`). The model and the tokenizer come out
the same as without the shortcuts; a GGUF that leaves a projection unquantized gets everything read."""

import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from eagle_jax.engine import Engine
from eagle_jax.text_codec import BACKEND_TOKENIZER_TYPES, load_tokenizer
from eagle_jax.kernels import cpu_qx
from eagle_jax.models import checkpoint
from eagle_jax.models.checkpoint import load_hf_dir, read_safetensors_dir
from eagle_jax.models.decoder import unstack_layers
from eagle_jax.models.gguf_loader import convert_gguf_to_hf_dir
from eagle_jax.models.quantized import (QuantizedLayoutError, attach_gguf_blocks, drop_shadowed_kernels,
                                        gguf_kernel_paths, kernels_without_blocks, regroup_for_int8)
from conftest import write_tiny_tokenizer
from gguf_util import block_types, tiny_config, write_tiny_gguf

MESSAGES = [{"role": "user", "content": "w5 w6 w7"}, {"role": "assistant", "content": "w8"},
            {"role": "user", "content": "w9 w10"}]


def _tokenizer_dir(path, model_type):
    path.mkdir()
    write_tiny_tokenizer(path, 40)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


@pytest.mark.parametrize("model_type", [*BACKEND_TOKENIZER_TYPES, "qwen2"])
def test_tokenizer_is_autotokenizers_class_and_output(tmp_path, model_type):
    from transformers import AutoTokenizer

    d = _tokenizer_dir(tmp_path / model_type, model_type)
    assert json.loads((d / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    ours, auto = load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))
    assert type(ours) is type(auto)
    text = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    for s in (text, "w3 w4 zz w39", ""):
        assert ours(s).input_ids == auto(s).input_ids
        assert ours(s, add_special_tokens=False).input_ids == auto(s, add_special_tokens=False).input_ids
    ids = auto(text).input_ids
    assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == auto.eos_token_id == 2


def test_real_tokenizer_is_autotokenizers(smollm2_engine):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(smollm2_engine.path))
    ours = smollm2_engine.tokenizer
    assert type(ours) is type(auto)
    prompt = [{"role": "user", "content": "Écris un haïku sur le décodage spéculatif, s'il te plaît. 🦅"}]
    text = auto.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert smollm2_engine.encode(prompt) == auto(text, add_special_tokens=False).input_ids
    assert smollm2_engine.encode("x = [1, 2]\n\tdef f():", raw=True) == auto("x = [1, 2]\n\tdef f():").input_ids


def test_tokenizer_start_imports_no_model_configs(tmp_path):
    """AutoTokenizer imports every model config, and PyTorch where it is installed (4-5 s); the
    directory's own class does not."""
    d = _tokenizer_dir(tmp_path / "tok", "llama")
    code = ("import sys; from eagle_jax.text_codec import load_tokenizer; load_tokenizer(sys.argv[1]); "
            "print(sorted(m for m in ('torch', 'transformers.models.auto.configuration_auto') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------------------- float32 weights left unread
@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """A tiny GGUF with every projection in Q4_1, another whose layer-1 up_proj stays float32."""
    cfg = tiny_config("llama", tied=True)
    types = block_types(cfg)
    d = tmp_path_factory.mktemp("omit")
    write_tiny_gguf(d / "all.gguf", cfg, types, seed=3)
    write_tiny_gguf(d / "other.gguf", cfg, types, seed=4)
    write_tiny_gguf(d / "mixed.gguf", cfg, {**types, "model.layers.1.mlp.up_proj.weight": "F32"}, seed=3)
    for name in ("all", "mixed"):
        convert_gguf_to_hf_dir(d / f"{name}.gguf", d / name, progress=False)
    return d


def test_omitted_kernels_are_placeholders_and_the_blocks_still_checked(ggufs):
    cfg, full = load_hf_dir(ggufs / "all")
    paths = gguf_kernel_paths()
    cfg, slim = load_hf_dir(ggufs / "all", omit=paths)
    flat_full, flat_slim = (dict(jax.tree_util.tree_flatten_with_path(p)[0]) for p in (full, slim))
    omitted = {tuple(jax.tree_util.DictKey(k) for k in p) for p in paths}
    assert set(flat_full) == set(flat_slim) and omitted <= set(flat_slim)
    for key, leaf in flat_slim.items():
        if key in omitted:
            assert leaf.shape == (cfg.num_layers, 0)
        else:
            np.testing.assert_array_equal(leaf, flat_full[key])
    _, get = read_safetensors_dir(ggufs / "all")
    with pytest.raises(ValueError, match="reference"):
        attach_gguf_blocks(slim, cfg, ggufs / "all.gguf", check="rows")
    with pytest.raises(QuantizedLayoutError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        attach_gguf_blocks(slim, cfg, ggufs / "other.gguf", check="rows", reference=get)
    with_blocks = attach_gguf_blocks(slim, cfg, ggufs / "all.gguf", check="all", reference=get)
    assert kernels_without_blocks(with_blocks, paths) == []
    want = drop_shadowed_kernels(attach_gguf_blocks(full, cfg, ggufs / "all.gguf"))
    jax.tree.map(np.testing.assert_array_equal, drop_shadowed_kernels(with_blocks), want)

    cfg, mixed = load_hf_dir(ggufs / "mixed", omit=paths)
    _, get = read_safetensors_dir(ggufs / "mixed")
    left = kernels_without_blocks(attach_gguf_blocks(mixed, cfg, ggufs / "mixed.gguf", reference=get), paths)
    assert left == [("layers", "mlp", "up_proj", "kernel")]  # the others hold blocks, gate_proj its own


@pytest.mark.skipif(not cpu_qx.available(), reason="the CPU kernel has no int8 rows of x here")
@pytest.mark.parametrize("name", ["all", "mixed"])
def test_int8_engine_loads_the_same_model_without_the_replaced_weights(ggufs, tmp_path, monkeypatch, name):
    """Engine(activations="int8") reads none of the float32 projections when the GGUF replaces them
    all, and everything when it does not; either way its params are those of loading every tensor."""
    gguf = tmp_path / f"{name}.gguf"
    shutil.copy(ggufs / f"{name}.gguf", gguf)
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path / "cache"))
    loads = []
    real = checkpoint.params_from_hf_state_dict
    monkeypatch.setattr(checkpoint, "params_from_hf_state_dict",
                        lambda *a, omit=(), **k: loads.append(tuple(omit)) or real(*a, omit=omit, **k))
    engine = Engine(str(gguf), activations="int8", progress=False, compile_cache=False)
    assert engine.activations == "int8"
    assert loads == ([gguf_kernel_paths()] if name == "all" else [gguf_kernel_paths(), ()])
    cfg, full = load_hf_dir(engine.path)
    cfg = cfg.replace(matmul_impl="cpu_kernel")
    want = unstack_layers(drop_shadowed_kernels(regroup_for_int8(attach_gguf_blocks(full, cfg, gguf))))
    jax.tree.map(np.testing.assert_array_equal, engine.params, want)
    up = engine.params["layers"][1]["mlp"]["up_proj"]["kernel"]
    assert up.shape == ((0,) if name == "all" else (cfg.hidden_size, cfg.intermediate_size))
    assert len(engine.generate_ids([1, 5, 9], 4).tokens) == 4
