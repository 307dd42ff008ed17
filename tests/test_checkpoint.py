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
