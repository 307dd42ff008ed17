"""Loading and exporting Hugging Face checkpoints; bad checkpoints name the bad tensor."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from conftest import make_hf_model, twin
from eagle_jax.models.checkpoint import (CheckpointError, load_hf_dir, params_from_hf_state_dict,
                                         params_to_hf_state_dict, save_hf_dir)
from eagle_jax.models.config import ModelConfig, UnsupportedConfigError
from eagle_jax.models.decoder import forward, lm_logits


def _sd(model):
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def qwen2():
    model = make_hf_model("qwen2")
    return model, ModelConfig.from_hf_config(model.config.to_diff_dict())


def test_missing_tensor_is_named(qwen2):
    model, cfg = qwen2
    sd = _sd(model)
    del sd["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.bias'"):
        params_from_hf_state_dict(cfg, sd)


def test_wrong_shape_is_named(qwen2):
    model, cfg = qwen2
    sd = _sd(model)
    sd["model.layers.2.mlp.up_proj.weight"] = np.zeros((95, 64), np.float32)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' has shape \(95, 64\), "
                                              r"expected \(96, 64\)"):
        params_from_hf_state_dict(cfg, sd)


def test_unexpected_tensor_is_named(qwen2):
    model, cfg = qwen2
    sd = _sd(model)
    sd["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        params_from_hf_state_dict(cfg, sd)


@pytest.mark.parametrize("field,value,msg", [
    ("rope_scaling_yarn", None, "rope scaling type 'yarn'"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("model_type", "gpt2", "model_type 'gpt2'"),
    ("quantization_config", {"bits": 4}, "unsupported config field\\(s\\): quantization_config"),
    ("pretraining_tp", 2, "pretraining_tp"),
])
def test_unsupported_config_is_rejected(qwen2, field, value, msg):
    d = qwen2[0].config.to_diff_dict()
    if field == "rope_scaling_yarn":
        d["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    else:
        d[field] = value
    with pytest.raises(UnsupportedConfigError, match=msg):
        ModelConfig.from_hf_config(d)


def test_rope_scaling_with_both_type_spellings():
    """transformers keeps the legacy "type" beside "rope_type" when it fills one in from the other."""
    d = make_hf_model("llama_bias_untied").config.to_diff_dict()
    d.pop("rope_parameters", None)
    d["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": 2.0}
    assert ModelConfig.from_hf_config(d).rope_scaling.kind == "linear"
    assert ModelConfig.from_hf_config(d).rope_scaling.factor == 2.0
    d["rope_scaling"] = {"type": "linear", "rope_type": "llama3", "factor": 2.0}
    with pytest.raises(UnsupportedConfigError, match="names two types: linear and llama3"):
        ModelConfig.from_hf_config(d)


def test_hf_config_round_trip():
    for name in ["llama", "llama_bias_untied", "qwen2", "qwen3", "mistral"]:
        cfg = ModelConfig.from_hf_config(make_hf_model(name).config.to_diff_dict())
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


@pytest.mark.parametrize("name", ["llama_bias_untied", "qwen3"])
def test_save_load_export_reload(tmp_path, name, rng):
    """eagle_jax → safetensors dir → transformers and eagle_jax both load it → same logits."""
    from transformers import AutoModelForCausalLM

    model = make_hf_model(name)
    cfg, params = twin(model)
    save_hf_dir(tmp_path, cfg, params)
    cfg2, params2 = load_hf_dir(tmp_path)
    assert cfg2 == cfg
    sd = params_to_hf_state_dict(cfg2, params2)
    for k, v in _sd(model).items():
        np.testing.assert_array_equal(sd[k], v, err_msg=k)
    ids = rng.integers(0, cfg.vocab_size, (1, 9))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    got = np.asarray(lm_logits(params2, cfg2, forward(params2, cfg2, jnp.asarray(ids)).hidden))
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_sharded_safetensors_and_missing_shard(tmp_path):
    from safetensors.numpy import save_file

    model = make_hf_model("llama")
    cfg, _ = twin(model)
    sd = _sd(model)
    names = sorted(sd)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for f, ks in shards.items():
        save_file({k: np.ascontiguousarray(sd[k]) for k in ks}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_diff_dict()))
    cfg2, params = load_hf_dir(tmp_path)
    assert cfg2 == cfg
    np.testing.assert_array_equal(np.asarray(params["norm"]["scale"]), sd["model.norm.weight"])
    (tmp_path / "b.safetensors").unlink()
    with pytest.raises(CheckpointError, match="b.safetensors"):
        load_hf_dir(tmp_path)


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_dir(tmp_path)


def _save_torch_bin(model, path, shards: int = 1):
    """The model's weights as transformers < 5 wrote them with `save_pretrained(safe_serialization=False)`
    (transformers 5 writes safetensors whatever it is told): `pytorch_model.bin`, or shards
    `pytorch_model-0000i-of-0000n.bin` with a `pytorch_model.bin.index.json` (lmsys/vicuna-7b-v1.3's
    layout), saved by torch itself (some tensors stay views of one shared storage)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_diff_dict()))
    sd = model.state_dict()
    if shards == 1:
        torch.save(sd, path / "pytorch_model.bin")
        return
    names = list(sd)
    weight_map = {}
    for i, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({names[j]: sd[names[j]] for j in part}, path / file)
        weight_map.update({names[j]: file for j in part})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


@pytest.mark.parametrize("name,shards", [("llama_bias_untied", 1), ("qwen2", 3)])
def test_pytorch_bin_target_loads_like_safetensors(tmp_path, name, shards, rng):
    """A target shipped only as torch `.bin` files (single or sharded) loads without torch and gives
    the logits of the same model saved as safetensors (and transformers' own)."""
    model = make_hf_model(name)
    model.save_pretrained(tmp_path / "st")
    _save_torch_bin(model, tmp_path / "pt", shards)
    assert not list((tmp_path / "pt").glob("*.safetensors"))
    assert len(list((tmp_path / "pt").glob("*.bin"))) == shards
    cfg_s, params_s = load_hf_dir(tmp_path / "st")
    cfg_b, params_b = load_hf_dir(tmp_path / "pt")
    assert cfg_b == cfg_s
    ids = rng.integers(0, cfg_s.vocab_size, (1, 9))
    got_s, got_b = (np.asarray(lm_logits(p, cfg_s, forward(p, cfg_s, jnp.asarray(ids)).hidden))
                    for p in (params_s, params_b))
    np.testing.assert_array_equal(got_b, got_s)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got_b, ref, atol=1e-4, rtol=0)


def test_missing_weights_and_torch_shards_are_named(tmp_path):
    model = make_hf_model("llama")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_diff_dict()))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*pytorch_model\.bin"):
        load_hf_dir(tmp_path)
    _save_torch_bin(model, tmp_path, 2)
    (tmp_path / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(CheckpointError, match=r"'pytorch_model-00002-of-00002\.bin' listed in "
                                              r"pytorch_model\.bin\.index\.json is missing"):
        load_hf_dir(tmp_path)
