"""Released EAGLE head checkpoints: heads written by torch in the reference layout load exactly and
compute what a PyTorch reimplementation of the reference forward computes; bad checkpoints name the
problem; exported heads round-trip and use the reference key names."""

import json
import math
import os
import pickle
import warnings
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file as torch_load_safetensors
from safetensors.torch import save_file as torch_save_safetensors

from eagle_jax.draft.checkpoint import (CheckpointError, UnsafeCheckpointError, load_drafter,
                                        load_torch_state_dict, save_drafter)
from eagle_jax.draft.config import DraftConfig, default_target_layers
from eagle_jax.draft.heads import fuse_features, head_logits, head_step, init_head, to_target_ids
from eagle_jax.models.config import ModelConfig, UnsupportedConfigError

TARGET = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4, num_kv_heads=2,
                     head_dim=16, max_position_embeddings=256)
D, HQ, HKV, HD, INTER, V, VD = 64, 4, 2, 16, 96, 101, 40
THETA, EPS = 5000.0, 1e-5  # the heads' config.json values (differ from TARGET's on purpose)


# ------------------------------------------------------------------------ reference-layout heads
def _draft_ids(seed=3):
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(V, VD, replace=False))


def _ref_state_dict(kind: str, seed: int = 0) -> dict:
    """A head's state dict as the reference `Model.state_dict()` would hold it (torch Linear
    [out, in]); some tensors are strided views or share one storage at an offset."""
    g = torch.Generator().manual_seed(seed)
    w = lambda *s: 0.1 * torch.randn(*s, generator=g)
    if kind == "eagle1":
        pre, width = "layers.0.", D
        sd = {"fc.weight": w(2 * D, D).t(), "fc.bias": w(D)}  # a transposed (non-contiguous) view
        norms = 1 + 0.2 * torch.randn(2 * D, generator=g)
        sd[pre + "post_attention_layernorm.weight"] = norms[D:]  # storage offset D
    else:
        pre, width = "midlayer.", 2 * D
        sd = {"fc.weight": w(D, 3 * D)}
        norms = 1 + 0.2 * torch.randn(4 * D, generator=g)
        for i, n in enumerate(("midlayer.input_layernorm", "midlayer.hidden_norm",
                               "midlayer.post_attention_layernorm", "norm")):
            sd[n + ".weight"] = norms[i * D:(i + 1) * D]
        sd["lm_head.weight"] = w(VD, D)
        ids = _draft_ids()
        sd["d2t"] = torch.from_numpy(ids - np.arange(VD)).long()
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.from_numpy(ids)] = True
        sd["t2d"] = t2d
    sd[pre + "self_attn.q_proj.weight"] = w(HQ * HD + 8, width)[8:]  # storage offset
    sd[pre + "self_attn.k_proj.weight"] = w(HKV * HD, width)
    sd[pre + "self_attn.v_proj.weight"] = w(HKV * HD, width)
    sd[pre + "self_attn.o_proj.weight"] = w(D, HQ * HD)
    sd[pre + "mlp.gate_proj.weight"] = w(INTER, D)
    sd[pre + "mlp.up_proj.weight"] = w(INTER, D)
    sd[pre + "mlp.down_proj.weight"] = w(D, INTER)
    sd["embed_tokens.weight"] = torch.from_numpy(_target_params()["embed_tokens"]["embedding"].copy())
    return sd


def _ref_config(kind: str) -> dict:
    """config.json in the released style (EAGLE `eagle/train/*_config.json`, SpecForge configs)."""
    d = {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
         "hidden_size": D, "initializer_range": 0.02, "intermediate_size": INTER, "max_position_embeddings": 256,
         "model_type": "llama", "num_attention_heads": HQ, "num_key_value_heads": HKV, "num_hidden_layers": 1,
         "pad_token_id": 0, "rms_norm_eps": EPS, "tie_word_embeddings": False, "torch_dtype": "float16",
         "transformers_version": "4.28.1", "use_cache": True, "vocab_size": V, "rope_theta": THETA}
    if kind == "eagle1":
        d["bias"] = True
    else:
        d.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD)
    return d


def _write(path, sd: dict, config: dict, storage: str = "bin"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if storage == "bin16":
        sd = {k: v.half() if v.is_floating_point() else v for k, v in sd.items()}
    if storage == "safetensors":
        torch_save_safetensors({k: v.clone().contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return path


def _target_params():
    rng = np.random.default_rng(7)
    return {"embed_tokens": {"embedding": rng.normal(size=(V, D)).astype(np.float32)},
            "lm_head": {"kernel": (0.1 * rng.normal(size=(D, V))).astype(np.float32)}}


def _ref_names(kind: str) -> dict:
    """Flax param path → reference tensor name (kernels are the transposed torch weights)."""
    pre, mod = ("layers.0.", "layer") if kind == "eagle1" else ("midlayer.", "midlayer")
    out = {("fc", "kernel"): "fc.weight"}
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[(mod, "self_attn", p, "kernel")] = f"{pre}self_attn.{p}.weight"
    for p in ("gate_proj", "up_proj", "down_proj"):
        out[(mod, "mlp", p, "kernel")] = f"{pre}mlp.{p}.weight"
    norms = ["post_attention_layernorm"] + (["input_layernorm", "hidden_norm"] if kind == "eagle3" else [])
    for n in norms:
        out[(mod, n, "scale")] = f"{pre}{n}.weight"
    if kind == "eagle1":
        out[("fc", "bias")] = "fc.bias"
    else:
        out[("norm", "scale")] = "norm.weight"
        out[("lm_head", "kernel")] = "lm_head.weight"
    return out


def _check_params_equal(head, sd, kind):
    leaves = {tuple(p.key for p in path): np.asarray(a)
              for path, a in jax.tree_util.tree_flatten_with_path(head.params)[0]}
    names = _ref_names(kind)
    assert set(leaves) == set(names)
    for keys, name in names.items():
        want = sd[name].float().numpy()
        np.testing.assert_array_equal(leaves[keys], want.T if keys[-1] == "kernel" else want, err_msg=name)


# ------------------------------------------------------------------------ torch reference forward
def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x, pos):  # x [B, H, T, hd], pos [B, T]
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    f = pos[..., None].double() * inv
    emb = torch.cat([f, f], -1)[:, None]
    rot = torch.cat([-x[..., HD // 2:], x[..., :HD // 2]], -1)
    return x * emb.cos().float() + rot * emb.sin().float()


def _attention(sd, pre, x, pos):
    b, t, _ = x.shape
    proj = lambda n, h: (x @ sd[pre + n].T).view(b, t, h, HD).transpose(1, 2)
    q, k, v = proj("q_proj.weight", HQ), proj("k_proj.weight", HKV), proj("v_proj.weight", HKV)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(HQ // HKV, dim=1), v.repeat_interleave(HQ // HKV, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
    s = s.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, HQ * HD) @ sd[pre + "o_proj.weight"].T


def _mlp(sd, pre, x):
    gate, up = x @ sd[pre + "gate_proj.weight"].T, x @ sd[pre + "up_proj.weight"].T
    return (F.silu(gate) * up) @ sd[pre + "down_proj.weight"].T


def _ref_eagle1(sd, emb, feat, pos, lm_head):
    x = torch.cat([emb, feat], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    x = x + _attention(sd, "layers.0.self_attn.", x, pos)  # first layer: no input_layernorm
    x = x + _mlp(sd, "layers.0.mlp.", _rms(x, sd["layers.0.post_attention_layernorm.weight"]))
    return x, x @ lm_head


def _ref_eagle3(sd, emb, feats, pos):
    h = feats @ sd["fc.weight"].T
    x = torch.cat([_rms(emb, sd["midlayer.input_layernorm.weight"]), _rms(h, sd["midlayer.hidden_norm.weight"])], -1)
    h = h + _attention(sd, "midlayer.self_attn.", x, pos)
    h = h + _mlp(sd, "midlayer.mlp.", _rms(h, sd["midlayer.post_attention_layernorm.weight"]))
    return h, _rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


# ------------------------------------------------------------------------ loading released layouts
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("storage", ["bin", "bin16", "safetensors"])
def test_reference_checkpoint_loads_exactly(tmp_path, kind, storage):
    sd = _ref_state_dict(kind)
    head = load_drafter(_write(tmp_path / "h", sd, _ref_config(kind), storage), TARGET)
    assert head.cfg.kind == kind and head.cfg.layer.rope_theta == THETA and head.cfg.layer.rms_norm_eps == EPS
    if storage == "bin16":
        sd = {k: v.half() if v.is_floating_point() else v for k, v in sd.items()}
    _check_params_equal(head, sd, kind)
    if kind == "eagle3":
        assert head.cfg.draft_vocab_size == VD and head.cfg.target_layers == default_target_layers(6)
        np.testing.assert_array_equal(np.asarray(head.d2t), sd["d2t"].numpy())
        np.testing.assert_array_equal(np.asarray(to_target_ids(head, jnp.arange(VD))), _draft_ids())
    else:
        assert head.cfg.fc_bias and head.d2t is None


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_head_matches_torch_reference_forward(tmp_path, kind):
    sd = _ref_state_dict(kind, seed=1)
    head = load_drafter(_write(tmp_path / "h", sd, _ref_config(kind)), TARGET)
    tp = _target_params()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, V, (2, 7))
    pos = np.stack([np.arange(7), np.arange(3, 10)])
    emb = torch.from_numpy(tp["embed_tokens"]["embedding"][tokens])
    sdf = {k: v.float() for k, v in sd.items()}
    if kind == "eagle1":
        feat = rng.normal(size=(2, 7, D)).astype(np.float32)
        want_h, want_logits = _ref_eagle1(sdf, emb, torch.from_numpy(feat), torch.from_numpy(pos),
                                          torch.from_numpy(tp["lm_head"]["kernel"]))
        h_in = feat
    else:
        feats = rng.normal(size=(2, 7, 3 * D)).astype(np.float32)
        want_h, want_logits = _ref_eagle3(sdf, emb, torch.from_numpy(feats), torch.from_numpy(pos))
        h_in = fuse_features(head, jnp.asarray(feats))
    h, _ = head_step(head, jnp.asarray(tp["embed_tokens"]["embedding"]), jnp.asarray(tokens), jnp.asarray(h_in),
                     jnp.asarray(pos))
    logits = head_logits(head, jax.tree.map(jnp.asarray, tp), TARGET, h)
    np.testing.assert_allclose(np.asarray(h), want_h.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want_logits.numpy(), atol=1e-4, rtol=1e-4)
    assert logits.shape[-1] == (V if kind == "eagle1" else VD)


def test_vllm_style_names_are_accepted(tmp_path):
    sd = _ref_state_dict("eagle3")
    sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    del sd["t2d"], sd["embed_tokens.weight"]
    head = load_drafter(_write(tmp_path / "h", sd, _ref_config("eagle3"), "safetensors"), TARGET)
    assert head.cfg.kind == "eagle3"


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_checkpoint_loads(tmp_path, fmt):
    sd = {k: v.clone().contiguous() for k, v in _ref_state_dict("eagle3").items()}
    path = tmp_path / "h"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_ref_config("eagle3")))
    names = sorted(sd)
    ext = "safetensors" if fmt == "safetensors" else "bin"
    shards = {f"model-0000{i + 1}-of-00002.{ext}": names[i::2] for i in range(2)}
    for file, keys in shards.items():
        part = {k: sd[k] for k in keys}
        torch_save_safetensors(part, str(path / file)) if fmt == "safetensors" else torch.save(part, path / file)
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (path / index).write_text(json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    _check_params_equal(load_drafter(path, TARGET), sd, "eagle3")


def test_torch_reader_honours_dtypes_offsets_and_strides(tmp_path):
    base = torch.randn(6, 5)
    sd = {"t": base.t()[1:], "bf": torch.randn(9).bfloat16()[2:], "i": torch.arange(7)[3:], "b": torch.rand(4) > 0.5,
          "h": base.half()[:, 1::2]}
    torch.save(sd, tmp_path / "x.bin")
    got = load_torch_state_dict(tmp_path / "x.bin")
    for k, v in sd.items():
        want = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
        np.testing.assert_array_equal(got[k].astype(want.dtype), want, err_msg=k)
    assert got["bf"].dtype.name == "bfloat16" and got["i"].dtype == np.int64 and got["b"].dtype == bool


# ------------------------------------------------------------------------ errors
def _safetensors_head(tmp_path, kind="eagle3", edit=None, config_edit=None):
    sd = _ref_state_dict(kind)
    if edit:
        edit(sd)
    cfg = _ref_config(kind)
    if config_edit:
        config_edit(cfg)
    return _write(tmp_path / "h", sd, cfg, "safetensors")


@pytest.mark.parametrize("edit,msg", [
    (lambda sd: sd.pop("midlayer.hidden_norm.weight"), r"missing tensor 'midlayer\.hidden_norm\.weight'"),
    (lambda sd: sd.update({"midlayer.self_attn.k_proj.weight": torch.zeros(32, 64)}),
     r"'midlayer\.self_attn\.k_proj\.weight' has shape \(32, 64\), expected \(32, 128\)"),
    (lambda sd: sd.update({"midlayer.self_attn.q_norm.weight": torch.ones(16)}),
     r"unexpected tensor 'midlayer\.self_attn\.q_norm\.weight'"),
    (lambda sd: sd.update({"embed_tokens.weight": torch.zeros(101, 32)}),
     r"'embed_tokens\.weight' has shape \(101, 32\), expected \(101, 64\)"),
    (lambda sd: sd["t2d"].__setitem__(int(np.flatnonzero(~sd["t2d"].numpy())[0]), True), "'t2d' and 'd2t' disagree"),
])
def test_bad_tensors_are_named(tmp_path, edit, msg):
    with pytest.raises(CheckpointError, match=msg):
        load_drafter(_safetensors_head(tmp_path, edit=edit), TARGET)


def test_eagle1_bias_flag_is_honoured(tmp_path):
    path = _safetensors_head(tmp_path, "eagle1", config_edit=lambda c: c.update(bias=False))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'fc\.bias'"):
        load_drafter(path, TARGET)


@pytest.mark.parametrize("field,value,msg", [
    ("medusa_num_heads", 3, "unsupported config field\\(s\\): medusa_num_heads"),
    ("norm_before_residual", True, "norm_before_residual"),
    ("eagle_config", {"parallel_draft_step": 3}, "not supported"),
    ("num_hidden_layers", 2, "2 layers"),
])
def test_unsupported_config_is_rejected(tmp_path, field, value, msg):
    path = _safetensors_head(tmp_path, config_edit=lambda c: c.update({field: value}))
    with pytest.raises(UnsupportedConfigError, match=msg):
        load_drafter(path, TARGET)


def test_incompatible_target_is_rejected(tmp_path):
    path = _safetensors_head(tmp_path)
    with pytest.raises(CheckpointError, match="vocabulary of 101 tokens, the target has 100"):
        load_drafter(path, TARGET.replace(vocab_size=100))
    with pytest.raises(CheckpointError, match="target features of width 64"):
        load_drafter(path, TARGET.replace(hidden_size=128, num_heads=8))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > marker_file",))


def test_pickle_with_foreign_global_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "h"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_ref_config("eagle1")))
    with zipfile.ZipFile(path / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"fc.weight": _Evil()}, protocol=2))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load global (posix|os|nt)\.system"):
        load_drafter(path, TARGET)
    assert not (tmp_path / "marker_file").exists()


def test_legacy_torch_format_asks_for_conversion(tmp_path):
    path = tmp_path / "h"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_ref_config("eagle1")))
    torch.save(_ref_state_dict("eagle1"), path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy .*convert it to safetensors"):
        load_drafter(path, TARGET)


# ------------------------------------------------------------------------ export
def _random_head(kind, target, layers=None):
    cfg = DraftConfig.for_target(kind, target, draft_vocab_size=VD, target_layers=layers)
    d2t = jnp.asarray(_draft_ids() - np.arange(VD)) if kind == "eagle3" else None
    head = init_head(cfg, jax.random.PRNGKey(5), d2t=d2t)
    # random norms so that a swapped norm would show
    return head.replace(params=jax.tree_util.tree_map_with_path(
        lambda p, a: a + 0.1 * jnp.arange(a.shape[0], dtype=a.dtype) if p[-1].key == "scale" else a, head.params))


@pytest.mark.parametrize("kind,layers,dtype", [("eagle1", None, "float32"), ("eagle3", None, "float32"),
                                               ("eagle3", (1, 3, 5), "bfloat16")])
def test_save_load_round_trip(tmp_path, kind, layers, dtype):
    target = TARGET.replace(dtype=dtype, rope_theta=THETA)
    head = _random_head(kind, target, layers)
    load = load_drafter(save_drafter(tmp_path / "h", head, target), target)
    assert load.cfg == head.cfg
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(load.params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    if kind == "eagle3":
        np.testing.assert_array_equal(np.asarray(load.d2t), np.asarray(head.d2t))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_export_uses_reference_names_shapes_and_config(tmp_path, kind):
    head = _random_head(kind, TARGET)
    path = save_drafter(tmp_path / "h", head, TARGET, dtype="float16")
    got = torch_load_safetensors(str(path / "model.safetensors"))
    ref = {k: v for k, v in _ref_state_dict(kind).items() if k != "embed_tokens.weight"}
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    for k, v in got.items():
        assert v.dtype == {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.float16), k
    if kind == "eagle3":
        assert got["t2d"].sum() == VD and torch.equal(got["d2t"], ref["d2t"])
    cfg = json.loads((path / "config.json").read_text())
    from transformers import LlamaConfig
    hf = LlamaConfig(**cfg)
    assert hf.num_hidden_layers == 1 and cfg["torch_dtype"] == "float16" and cfg["tie_word_embeddings"] is False
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == VD
        assert "eagle_aux_hidden_state_layer_ids" not in cfg  # default layers: every server agrees
    else:
        # fc bias: "bias" left out (ea_model defaults it to true; vLLM/SGLang would read true as attention bias)
        assert cfg["architectures"] == ["LlamaForCausalLM"] and "bias" not in cfg
    with pytest.raises(ValueError, match="safetensors only"):
        save_drafter(tmp_path / "b", head, TARGET, format="bin")


@pytest.mark.parametrize("field,ids,want", [("eagle_aux_hidden_state_layer_ids", [1, 3, 5], (1, 3, 5)),
                                            ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]},
                                             (2, 3, 4))])
def test_fused_layer_ids_follow_vllm_and_specforge_conventions(tmp_path, field, ids, want):
    path = _safetensors_head(tmp_path, config_edit=lambda c: c.update({field: ids}))
    assert load_drafter(path, TARGET).cfg.target_layers == want
    assert load_drafter(path, TARGET, target_layers=(1, 2, 4)).cfg.target_layers == (1, 2, 4)


def test_widened_head_computes_the_same_and_round_trips(tmp_path):
    """`widen_mlp` adds MLP units whose output starts at zero: the same logits as before, a wider
    intermediate_size in the exported config, and the new units trainable (nonzero gate/up)."""
    from eagle_jax.draft.heads import widen_mlp

    target = TARGET.replace(rope_theta=THETA)
    head = _random_head("eagle3", target, None)
    wide = widen_mlp(head, 2 * INTER, jax.random.PRNGKey(1))
    assert wide.cfg.layer.intermediate_size == 2 * INTER
    assert np.abs(np.asarray(wide.params["midlayer"]["mlp"]["up_proj"]["kernel"][:, INTER:])).max() > 0
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.standard_normal((1, 5, 3 * D)), jnp.float32)
    embed = jnp.asarray(rng.standard_normal((V, D)), jnp.float32)
    toks, pos = jnp.asarray(rng.integers(0, V, (1, 5))), jnp.arange(5)[None]

    def logits(h):
        out, _ = head_step(h, embed, toks, fuse_features(h, feats), pos)
        return np.asarray(head_logits(h, {"embed_tokens": {"embedding": embed}}, target, out))

    np.testing.assert_allclose(logits(wide), logits(head), rtol=1e-5, atol=1e-5)
    load = load_drafter(save_drafter(tmp_path / "w", wide, target), target)
    assert load.cfg == wide.cfg
    assert json.loads((tmp_path / "w" / "config.json").read_text())["intermediate_size"] == 2 * INTER
    np.testing.assert_allclose(logits(load), logits(head), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="narrow"):
        widen_mlp(head, INTER - 1, jax.random.PRNGKey(1))


# ------------------------------------------------------------------------ interchange with the servers / EAGLE
def _servers_attention_bias(cfg: dict) -> bool:
    """vLLM / SGLang `models/llama.py` LlamaDecoderLayer: `attention_bias or bias`."""
    return bool(cfg.get("attention_bias", False) or cfg.get("bias", False))


@pytest.mark.parametrize("fc_bias", [True, False])
def test_eagle1_bias_key_is_not_read_as_attention_bias(tmp_path, fc_bias):
    head = init_head(DraftConfig.for_target("eagle1", TARGET, fc_bias=fc_bias), jax.random.PRNGKey(0))
    path = save_drafter(tmp_path / "h", head, TARGET)
    cfg = json.loads((path / "config.json").read_text())
    assert not _servers_attention_bias(cfg)
    assert cfg.get("bias", True) is fc_bias  # SafeAILab ea_model: con["bias"], else True
    assert ("fc.bias" in torch_load_safetensors(str(path / "model.safetensors"))) is fc_bias
    assert load_drafter(path, TARGET).cfg.fc_bias is fc_bias


@pytest.mark.parametrize("with_bias", [True, False])
def test_eagle1_without_bias_key_follows_the_file(tmp_path, with_bias):
    edit = None if with_bias else (lambda sd: sd.pop("fc.bias"))
    path = _safetensors_head(tmp_path, "eagle1", edit=edit, config_edit=lambda c: c.pop("bias"))
    assert load_drafter(path, TARGET).cfg.fc_bias is with_bias


def _econfig_accepts(rs) -> bool:
    """SafeAILab/EAGLE `eagle/model/configs.py` EConfig._rope_scaling_validation (as logic)."""
    if rs is None:
        return True
    f = rs.get("factor") if isinstance(rs, dict) else None
    return len(rs) == 2 and rs.get("type") in ("linear", "dynamic") and isinstance(f, float) and f > 1.0


def test_rope_scaling_export_reads_back_everywhere(tmp_path):
    from transformers import LlamaConfig

    from eagle_jax.models.config import RopeScaling

    for i, (rs, theta, warn) in enumerate([
            (RopeScaling("linear", 2.0), 10000.0, None),
            (RopeScaling("linear", 2.0), THETA, "ignores rope_theta"),
            (RopeScaling("llama3", 8.0, 1.0, 4.0, 128), THETA, "SafeAILab/EAGLE cannot load")]):
        target = TARGET.replace(rope_scaling=rs, rope_theta=theta)
        head = _random_head("eagle3", target, (1, 3, 5))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            path = save_drafter(tmp_path / str(i), head, target)
        msgs = [str(w.message) for w in caught]
        assert (any(warn in m for m in msgs) if warn else not msgs), msgs
        cfg = json.loads((path / "config.json").read_text())
        if rs.kind == "linear":
            assert cfg["rope_scaling"] == {"type": "linear", "factor": 2.0} and _econfig_accepts(cfg["rope_scaling"])
        else:
            assert cfg["rope_scaling"]["rope_type"] == "llama3" and not _econfig_accepts(cfg["rope_scaling"])
        assert LlamaConfig(**cfg).rope_scaling["rope_type"] == rs.kind  # what vLLM / SGLang see
        assert load_drafter(path, target).cfg == head.cfg


def test_fused_layers_must_be_strictly_increasing(tmp_path):
    for bad in [(4, 1, 2), (1, 2, 2)]:
        with pytest.raises(UnsupportedConfigError, match=r"target_layers \(%d, %d, %d\) must be strictly" % bad):
            DraftConfig.for_target("eagle3", TARGET, draft_vocab_size=VD, target_layers=bad)
    path = _safetensors_head(tmp_path)
    with pytest.raises(UnsupportedConfigError, match="strictly increasing"):
        load_drafter(path, TARGET, target_layers=(4, 1, 2))
    for field, ids in [("eagle_aux_hidden_state_layer_ids", [4, 1, 2]),
                       ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [3, 0, 0]})]:
        path = _safetensors_head(tmp_path / field, config_edit=lambda c: c.update({field: ids}))
        where = "config.json " + ("eagle_config." if field == "eagle_config" else "")
        with pytest.raises(UnsupportedConfigError, match=where):
            load_drafter(path, TARGET)
    head = _random_head("eagle3", TARGET, (1, 2, 4))
    unsorted = head.replace(cfg=head.cfg.replace(target_layers=(4, 1, 2)))  # built directly, not via for_target
    with pytest.raises(UnsupportedConfigError, match=r"\(4, 1, 2\) must be strictly increasing"):
        save_drafter(tmp_path / "u", unsorted, TARGET)


def test_export_spells_layer_zero_for_sglang_and_warns(tmp_path):
    head = _random_head("eagle3", TARGET, (0, 2, 4))
    with pytest.warns(UserWarning, match="None at layer 0"):
        path = save_drafter(tmp_path / "h", head, TARGET)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [-1, 1, 3]}  # SGLang adds 1
    del cfg["eagle_aux_hidden_state_layer_ids"]  # SGLang / SpecForge read only the nested ids
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(path, TARGET).cfg.target_layers == (0, 2, 4)
    tiny = TARGET.replace(num_layers=3)  # default layers (2, 1, 0): what the servers would capture permuted
    with pytest.warns(UserWarning, match=r"default EAGLE-3 target layers \(2, 1, 0\)"):
        save_drafter(tmp_path / "t", _random_head("eagle3", tiny), tiny)


@pytest.mark.parametrize("rows", ["q8_0", "q4_1", "f16"])
def test_export_refuses_quantised_cpu_kernel_rows(tmp_path, rows):
    """Under the CPU kernel `load_drafter` replaces each weight by its compact rows' values: Q8_0 / Q4_1
    approximate it, so exporting such a head would write the approximation; f16 rows are exact."""
    target = TARGET.replace(rope_theta=THETA)
    src = save_drafter(tmp_path / "h", _random_head("eagle3", target), target, dtype="float16")
    kernel_target = target.replace(matmul_impl="cpu_kernel")
    head = load_drafter(src, kernel_target, rows=rows)
    assert any(p[-1].key == rows for p, _ in jax.tree_util.tree_flatten_with_path(head.params)[0])
    if rows == "f16":
        out = save_drafter(tmp_path / "o", head, kernel_target, dtype="float16")
        want, got = (torch_load_safetensors(str(p / "model.safetensors")) for p in (src, out))
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        return
    with pytest.raises(CheckpointError, match=rf"compact CPU-kernel rows '[a-z_.]+\.{rows}'.*"
                                              rf"load it with the float kernels \(target matmul_impl='xla'\)"):
        save_drafter(tmp_path / "o", head, kernel_target)
    assert not (tmp_path / "o").exists()
