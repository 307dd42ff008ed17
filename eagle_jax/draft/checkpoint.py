"""Released EAGLE draft-head checkpoints ↔ `DraftHead`.

`load_drafter` reads a head directory (config.json + model.safetensors, a sharded safetensors
index, or a torch `pytorch_model.bin` read *without* torch by a restricted unpickler) and
`save_drafter` writes one in the layout the released heads use, so heads trained here can be served
by vLLM / SGLang and released heads can be used here. Every tensor is checked by name and shape
before anything is converted; a bad checkpoint names the offending tensor.

Layout facts (what the reference and the servers read; torch Linear weights are [out, in]):

EAGLE-1/2 head — SafeAILab/EAGLE `eagle/model/cnets1.py` (`Model`, `LlamaDecoderLayer(config, 0)`),
loaded by `eagle/model/ea_model.py` (torch.load of `pytorch_model.bin`, else `model.safetensors`):
  fc.weight [d, 2d], fc.bias [d] (iff config "bias", default true; LLaMA3 heads ship "bias": false)
  layers.0.self_attn.{q,k,v}_proj.weight [H*hd | KV*hd, d] (+ .bias if config "qkv_bias")
  layers.0.self_attn.o_proj.weight [d, H*hd]
  layers.0.mlp.{gate,up}_proj.weight [I, d], layers.0.mlp.down_proj.weight [d, I]
  layers.0.post_attention_layernorm.weight [d]     (layer 0 has no input_layernorm)
  embed_tokens.weight [V, d] (frozen copy of the target's; may be absent)
  fc input is concat(embed(token), feature). config.json: LlamaConfig fields with
  num_hidden_layers 1, "architectures": ["LlamaForCausalLM"], optional "bias"
  (`eagle/train/EAGLE-LLaMA3-Instruct-8B`); ea_model takes a missing "bias" as true. vLLM's and
  SGLang's llama decoder layer (`models/llama.py`) build q/k/v/o biases when `config.attention_bias
  or config.bias`, so "bias": true there means attention biases the file lacks. SGLang
  (`srt/models/llama_eagle.py`, LlamaForCausalLMEagle) always builds fc with a bias and prepends
  "model."; vLLM (`model_executor/models/llama_eagle.py`, EagleLlamaForCausalLM) always builds fc
  *without* one (a file's fc.bias is skipped). So SGLang serves EAGLE-1 heads with an fc bias, vLLM
  those without; export leaves "bias" out when fc has a bias and writes "bias": false otherwise.
  rope_scaling: EAGLE's EConfig accepts only {"type": linear|dynamic, "factor" > 1} (export writes
  linear so; llama3 stays in the HF form, with a warning that EAGLE cannot load it).

EAGLE-3 head — SafeAILab/EAGLE `eagle/model/cnets.py` (`Model`, `LlamaDecoderLayeremb`),
sgl-project/SpecForge `specforge/modeling/draft/llama3_eagle.py` (`LlamaForCausalLMEagle3`):
  fc.weight [d, 3*Ht] (no bias; Ht = config "target_hidden_size" if present, else d)
  midlayer.self_attn.{q,k,v}_proj.weight [H*hd | KV*hd, 2d], midlayer.self_attn.o_proj.weight [d, H*hd]
  midlayer.mlp.{gate,up,down}_proj.weight, midlayer.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight [d], norm.weight [d], lm_head.weight [Vd, d]
  d2t int64 [Vd] (target id = i + d2t[i]), t2d bool [V] (buffers, saved in the state dict)
  embed_tokens.weight [V, d] may be present (SpecForge's serving export drops it, to_sglang.py).
  The layer attends over concat(input_layernorm(emb), hidden_norm(h)) with residual h.
  config.json (SpecForge `configs/llama3-8B-eagle3.json`): "architectures":
  ["LlamaForCausalLMEagle3"], model_type llama, num_hidden_layers 1, "draft_vocab_size", optional
  "target_hidden_size", "head_dim". EAGLE's own ea_model drops d2t/t2d when Vd == V.
  vLLM `llama_eagle3.py` renames midlayer. → layers.0., loads d2t as draft_id_to_target_id and
  skips t2d; SGLang `llama_eagle3.py` reads d2t (hot_token_id = d2t + arange), skips t2d, and
  builds fc with bias = config "bias" (which, through llama.py, also gives o_proj a bias; q/k/v are
  rebuilt without) and ties lm_head to the embedding if tie_word_embeddings. Both servers append the
  aux hidden states while walking the target's layers: fc's input is in ascending layer order.
  Fused target layers: vLLM reads top-level "eagle_aux_hidden_state_layer_ids" (then
  eagle_config.eagle_aux_hidden_state_layer_ids; gpu_model_runner `_get_eagle3_aux_layers_from_config`)
  as HF hidden_states indices (input of layer id); SpecForge (`algorithms/model_providers.py`,
  default [1, N//2-1, N-4]) and SGLang (`set_eagle3_layers_to_capture`: +1) write/read the nested
  eagle_config ids as "output of layer id" = hidden_states[id+1]. Both defaults are hidden_states
  [2, N//2, N-3] = `default_target_layers`.

Here: top-level ids are taken as hidden_states indices, nested eagle_config ids get +1; ids must be
strictly increasing (load and export refuse others). Export writes both (nested = top-level - 1,
so hidden_states[0] is nested -1) only when the layers are not the default.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Mapping, Optional

import jax
import ml_dtypes
import numpy as np

from ..models.checkpoint import CheckpointError, read_weights_dir
from ..models.torch_bin import UnsafeCheckpointError, load_torch_state_dict
from ..models.config import ModelConfig, UnsupportedConfigError
from .config import DraftConfig, check_target_layers, default_target_layers
from .heads import DraftHead, init_head

__all__ = ["load_drafter", "save_drafter", "load_torch_state_dict", "drafter_state_dict", "drafter_hf_config",
           "draft_config_from_hf", "expected_drafter_tensors", "CheckpointError", "UnsafeCheckpointError"]


# ============================================================================ config.json
# Fields of released / SpecForge / vLLM EAGLE configs that `ModelConfig.from_hf_config` does not know.
_EAGLE_FIELDS = ("bias", "qkv_bias", "draft_vocab_size", "target_hidden_size", "eagle_config",
                 "eagle_aux_hidden_state_layer_ids", "norm_before_residual", "fc_norm", "norm_output",
                 "norm_before_fc")
_EAGLE_CONFIG_KEYS = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "use_input_layernorm_in_first_layer",
                      "use_last_layernorm", "use_mtp_layernorm", "next_layer_regular", "parallel_draft_step",
                      "parallel_draft_heads_num_layers"}


def _reject_speculators(hf: Mapping):
    if "speculators_config" in hf or "transformer_layer_config" in hf:
        raise UnsupportedConfigError("this is a vLLM `speculators` checkpoint config; convert it back to the "
                                     "EAGLE layout (LlamaForCausalLMEagle3 config.json) first")


def _detect_kind(hf: Mapping, names) -> str:
    _reject_speculators(hf)
    archs = " ".join(hf.get("architectures") or [])
    if "Eagle3" in archs or "draft_vocab_size" in hf:
        return "eagle3"
    if any(n in ("d2t", "t2d") or "midlayer." in n or "hidden_norm" in n for n in names):
        return "eagle3"
    return "eagle1"


def _target_layers_from_hf(hf: Mapping, target_cfg: ModelConfig):
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if ids:  # vLLM convention: HF hidden_states index (input of layer id)
        return check_target_layers(ids, "config.json eagle_aux_hidden_state_layer_ids")
    nested = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:  # SpecForge / SGLang convention: output of layer id = hidden_states[id + 1]
        nested = check_target_layers(nested, "config.json eagle_config.eagle_aux_hidden_state_layer_ids")
        return tuple(i + 1 for i in nested)
    return default_target_layers(target_cfg.num_layers)


def draft_config_from_hf(hf: Mapping, target_cfg: ModelConfig, *, kind: Optional[str] = None,
                         fc_bias: Optional[bool] = None, target_layers=None,
                         dtype: Optional[str] = None) -> DraftConfig:
    """Build a `DraftConfig` from a head's config.json dict (EAGLE fields mapped here, the rest by
    `ModelConfig.from_hf_config`, which rejects unknown fields). The layer takes the target's dtype
    (or `dtype`), attention implementation and tie flag (the head reuses the target's embedding)."""
    d = dict(hf)
    _reject_speculators(d)
    kind = kind or _detect_kind(d, ())
    eagle = {k: d.pop(k) for k in _EAGLE_FIELDS if k in d}
    if d.get("model_type", "llama") != "llama":
        raise UnsupportedConfigError(f"draft heads are Llama layers; model_type {d['model_type']!r} is not supported")
    if d.get("num_hidden_layers", 1) != 1:
        raise UnsupportedConfigError(f"draft heads with {d['num_hidden_layers']} layers are not supported (only 1)")
    for k in ("norm_before_residual", "fc_norm", "norm_before_fc"):
        if eagle.get(k):
            raise UnsupportedConfigError(f"EAGLE-3 variant with {k}=true is not supported")
    if eagle.get("norm_output", True) is not True:
        raise UnsupportedConfigError("EAGLE-3 variant with norm_output=false is not supported")
    ec = eagle.get("eagle_config") or {}
    if not isinstance(ec, Mapping):
        raise UnsupportedConfigError(f"eagle_config must be an object, got {type(ec).__name__}")
    unknown = sorted(set(ec) - _EAGLE_CONFIG_KEYS)
    if unknown:
        raise UnsupportedConfigError(f"unsupported eagle_config field(s): {', '.join(unknown)}")
    if ec.get("use_aux_hidden_state") is False or ec.get("use_input_layernorm_in_first_layer") is False \
            or ec.get("use_last_layernorm") is False or ec.get("use_mtp_layernorm") \
            or (ec.get("parallel_draft_step") or 1) != 1:
        raise UnsupportedConfigError(f"eagle_config {dict(ec)} describes a head variant that is not supported")
    d.setdefault("vocab_size", target_cfg.vocab_size)
    try:
        layer = ModelConfig.from_hf_config(d)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"draft head config: {e}") from None
    if "qkv_bias" in eagle:
        layer = layer.replace(qkv_bias=bool(eagle["qkv_bias"]))
    layer = layer.replace(num_layers=1, dtype=dtype or target_cfg.dtype, attention_impl=target_cfg.attention_impl,
                          matmul_impl=target_cfg.matmul_impl, tie_word_embeddings=target_cfg.tie_word_embeddings)
    if kind == "eagle3":
        th = int(eagle.get("target_hidden_size") or layer.hidden_size)
        if th != target_cfg.hidden_size:
            raise CheckpointError(f"EAGLE-3 head fuses target features of width {th}, the target's hidden size is "
                                  f"{target_cfg.hidden_size}")
        layers = (check_target_layers(target_layers) if target_layers is not None
                  else _target_layers_from_hf(eagle, target_cfg))
        bad = [i for i in layers if not 0 <= i <= target_cfg.num_layers]
        if bad:
            raise CheckpointError(f"EAGLE-3 target layer(s) {bad} outside the target's hidden states "
                                  f"0..{target_cfg.num_layers}")
        return DraftConfig("eagle3", layer, fc_bias=bool(fc_bias),
                           draft_vocab_size=int(eagle.get("draft_vocab_size") or layer.vocab_size),
                           target_layers=layers, target_hidden_size=th)
    if kind != "eagle1":
        raise UnsupportedConfigError(f"draft kind must be 'eagle1' or 'eagle3', got {kind!r}")
    return DraftConfig("eagle1", layer, fc_bias=bool(eagle.get("bias", True)) if fc_bias is None else fc_bias)


def _rope_scaling_field(layer: ModelConfig):
    """config.json "rope_scaling". Linear is written in the legacy two-key form {"type", "factor"}:
    SafeAILab/EAGLE's EConfig (`eagle/model/configs.py` `_rope_scaling_validation`) accepts only that
    ("type" linear/dynamic, float factor > 1) and `cnets.py` reads rope_scaling["type"]; transformers
    maps "type" to "rope_type" and vLLM / SGLang `get_rope` read either. llama3 scaling keeps the HF
    form (transformers, vLLM, SGLang) with a warning: SafeAILab/EAGLE cannot load it."""
    rs = layer.rope_scaling
    if rs.kind == "default":
        return None
    if rs.kind == "linear":
        if rs.factor <= 1.0:
            warnings.warn(f"linear rope scaling factor {rs.factor} <= 1: SafeAILab/EAGLE's EConfig refuses it "
                          f"(it needs a factor > 1); vLLM / SGLang / transformers accept it", stacklevel=4)
        if layer.rope_theta != 10000.0:
            warnings.warn(f"SafeAILab/EAGLE builds its linear-scaled RoPE with base 10000 and ignores rope_theta "
                          f"{layer.rope_theta:g}: this head computes other positions there", stacklevel=4)
        return {"type": "linear", "factor": float(rs.factor)}
    warnings.warn(f"rope_scaling of type {rs.kind!r} is written in the Hugging Face form (transformers, vLLM and "
                  f"SGLang read it); SafeAILab/EAGLE cannot load this head (its EConfig accepts only "
                  f"{{'type': 'linear'|'dynamic', 'factor'}})", stacklevel=4)
    return {"rope_type": rs.kind, "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings}


def drafter_hf_config(head: DraftHead, target_cfg: ModelConfig, dtype: Optional[str] = None) -> dict:
    """The head's config.json in the released layout (see the module docstring)."""
    cfg, lc = head.cfg, head.cfg.layer
    if lc.qk_norm or lc.sliding_window or lc.family != "llama":
        raise UnsupportedConfigError("only plain Llama draft layers can be exported")
    if lc.o_bias and not lc.qkv_bias:
        raise UnsupportedConfigError("an o_proj bias without q/k/v biases has no config.json spelling")
    d = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.kind == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama", "vocab_size": lc.vocab_size, "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": lc.num_heads,
        "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim, "hidden_act": "silu",
        "max_position_embeddings": lc.max_position_embeddings, "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta, "rope_scaling": _rope_scaling_field(lc), "pretraining_tp": 1,
        # EAGLE-3 has its own lm_head: SGLang would tie it to the embedding if this were true.
        "tie_word_embeddings": False if cfg.kind == "eagle3" else target_cfg.tie_word_embeddings,
        "attention_bias": bool(lc.o_bias), "mlp_bias": bool(lc.mlp_bias), "torch_dtype": dtype or lc.dtype,
    }
    # vLLM's and SGLang's llama decoder layer build q/k/v/o biases when `attention_bias or bias`, so an
    # EAGLE-1 fc bias is spelled by leaving "bias" out (SafeAILab's ea_model then defaults it to true).
    if cfg.kind == "eagle3" or not cfg.fc_bias:
        d["bias"] = bool(cfg.fc_bias)
    if lc.qkv_bias and not lc.o_bias:
        d["qkv_bias"] = True
    if cfg.kind == "eagle3":
        d["draft_vocab_size"] = cfg.draft_vocab_size
        if cfg.target_hidden_size not in (None, lc.hidden_size):
            d["target_hidden_size"] = cfg.target_hidden_size
        n, layers = target_cfg.num_layers, tuple(cfg.target_layers)
        if layers == tuple(default_target_layers(n)):
            if any(b <= a for a, b in zip(layers, layers[1:])):
                warnings.warn(f"the default EAGLE-3 target layers {layers} of a {n}-layer target are not strictly "
                              f"increasing: vLLM / SGLang capture each once, in ascending order, and cannot serve "
                              f"this head", stacklevel=3)
        else:
            check_target_layers(layers, "EAGLE-3 target_layers")
            d["eagle_aux_hidden_state_layer_ids"] = list(layers)
            # SpecForge / SGLang ids are "output of layer id": hidden_states[0] (the embeddings) is -1.
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}
            if layers[0] < 1 or layers[-1] > n - 1:
                warnings.warn(f"EAGLE-3 target layers {layers}: vLLM's and SGLang's llama.py capture the input of "
                              f"layer i (i < {n}) as hidden_states + residual, which is None at layer 0 and never "
                              f"reaches hidden_states[{n}]: they may not serve this head", stacklevel=3)
    return d


# ============================================================================ tensors
def _layout(cfg: DraftConfig):
    """Yield (reference name, reference shape, flax path) for every parameter of the head."""
    shapes = jax.eval_shape(lambda: init_head(cfg, jax.random.PRNGKey(0)).params)
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        keys = tuple(p.key for p in path)
        mods = ["layers.0" if keys[0] == "layer" else keys[0], *keys[1:-1]]
        if keys[-1] == "kernel":
            yield ".".join(mods) + ".weight", tuple(leaf.shape[::-1]), keys
        elif keys[-1] == "scale":
            yield ".".join(mods) + ".weight", tuple(leaf.shape), keys
        else:
            yield ".".join(mods) + "." + keys[-1], tuple(leaf.shape), keys


def expected_drafter_tensors(cfg: DraftConfig) -> dict[str, tuple]:
    """Reference tensor name → shape for a head (EAGLE-3 includes the d2t / t2d buffers)."""
    out = {name: shape for name, shape, _ in _layout(cfg)}
    if cfg.kind == "eagle3":
        out["d2t"] = (cfg.draft_vocab_size,)
        out["t2d"] = (cfg.vocab_size,)
    return out


def _canonical_names(names, kind: str) -> dict[str, str]:
    """Reference name → name in the file, accepting vLLM-style `model.` prefixes and `layers.0.` for
    EAGLE-3's `midlayer.`."""
    out: dict[str, str] = {}
    for n in names:
        c = n[len("model."):] if n.startswith("model.") else n
        if kind == "eagle3" and c.startswith("layers.0."):
            c = "midlayer." + c[len("layers.0."):]
        if c in out:
            raise CheckpointError(f"checkpoint holds both {out[c]!r} and {n!r} for tensor {c!r}")
        out[c] = n
    return out


def _np_dtype(name: str):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def load_drafter(path, target_cfg: ModelConfig, *, kind: Optional[str] = None, target_layers=None,
                 dtype: Optional[str] = None, rows: str = "q8_0") -> DraftHead:
    """Load a released-layout EAGLE-1/2 or EAGLE-3 head from a directory for `target_cfg`.

    `kind` ("eagle1"/"eagle3") overrides detection (architectures, draft_vocab_size, tensor names);
    `target_layers` (HF hidden_states indices) overrides the fused layers of an EAGLE-3 head;
    `dtype` defaults to the target's. Under the CPU kernel (`target_cfg.matmul_impl == "cpu_kernel"`)
    the head keeps compact rows for it: `rows` "q8_0" (quantised: the kernel reads a quarter of
    float32's bytes) or "f16" (a float16 checkpoint's own values, exactly); a head with rows that
    approximate its weights cannot be exported (`save_drafter` refuses it). Raises CheckpointError
    naming a missing / misshapen / unexpected tensor or an incompatibility with the target,
    UnsupportedConfigError for config.json.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path} has no config.json")
    hf = json.loads(cfg_file.read_text())
    names, get = read_weights_dir(path)
    kind = kind or _detect_kind(hf, names)
    files = _canonical_names(names, kind)
    # EAGLE-3: fc has a bias iff the file has one. EAGLE-1: config "bias" decides (a mismatch is an error
    # below); without the key, the file decides too (ea_model's default of true needs the tensor anyway).
    fc_bias = ("fc.bias" in files) if kind == "eagle3" or "bias" not in hf else None
    cfg = draft_config_from_hf(hf, target_cfg, kind=kind, fc_bias=fc_bias, target_layers=target_layers, dtype=dtype)
    lc = cfg.layer
    if lc.vocab_size != target_cfg.vocab_size:
        raise CheckpointError(f"draft head is for a vocabulary of {lc.vocab_size} tokens, the target has "
                              f"{target_cfg.vocab_size}")
    if lc.hidden_size != target_cfg.hidden_size:
        raise CheckpointError(f"draft head width {lc.hidden_size} differs from the target's hidden size "
                              f"{target_cfg.hidden_size} (the head embeds tokens with the target's embedding)")

    layout = list(_layout(cfg))
    expected = {n for n, _, _ in layout}
    optional = {"embed_tokens.weight"} | ({"d2t", "t2d"} if cfg.kind == "eagle3" else set())
    missing = [n for n, _, _ in layout if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{cfg.kind} head checkpoint is missing tensor {missing[0]!r}{more}")
    unexpected = sorted(files[c] for c in files
                        if c not in expected and c not in optional and not c.endswith("rotary_emb.inv_freq"))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{cfg.kind} head checkpoint has unexpected tensor {unexpected[0]!r}{more}")

    def fetch(name, shape):
        arr = np.asarray(get(files[name]))
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor {files[name]!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        return arr

    if "embed_tokens.weight" in files:  # the target's embedding is used; only check it is the target's shape
        fetch("embed_tokens.weight", (target_cfg.vocab_size, target_cfg.hidden_size))
    dt = _np_dtype(lc.dtype)
    params: dict = {}
    for name, shape, keys in layout:
        arr = fetch(name, shape)
        arr = (arr.T if keys[-1] == "kernel" else arr).astype(dt)
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = jax.device_put(arr)

    d2t = None
    if cfg.kind == "eagle3":
        vd, v = cfg.draft_vocab_size, cfg.vocab_size
        if "d2t" in files:
            d2t = fetch("d2t", (vd,))
            if d2t.dtype.kind not in "iu":
                raise CheckpointError(f"tensor {files['d2t']!r} has dtype {d2t.dtype}, expected an integer type")
            d2t = d2t.astype(np.int64)
        elif vd == v:
            d2t = np.zeros((vd,), np.int64)
        else:
            raise CheckpointError(f"eagle3 head checkpoint is missing tensor 'd2t' (draft vocab {vd} < vocab {v})")
        target_ids = np.arange(vd) + d2t
        if target_ids.min() < 0 or target_ids.max() >= v or len(np.unique(target_ids)) != vd:
            raise CheckpointError(f"tensor 'd2t' maps draft ids outside [0, {v}) or twice onto one target id")
        if "t2d" in files:
            t2d = fetch("t2d", (v,)).astype(bool)
            if t2d.sum() != vd or not t2d[target_ids].all():
                raise CheckpointError("tensors 't2d' and 'd2t' disagree on which target tokens the draft vocab holds")
        d2t = jax.device_put(np.asarray(d2t, np.int32))
    if lc.matmul_impl == "cpu_kernel":  # compact rows for the kernel (models/quantized.py)
        from ..models.quantized import attach_draft_rows

        params = attach_draft_rows(params, rows)
    return DraftHead(params, d2t, cfg)


# Compact rows that hold the float weights exactly (`attach_f16_rows` attaches only where they do).
_EXACT_ROWS = ("f16",)


def _refuse_compact_rows(head: DraftHead, leaves):
    """Refuse a head whose Dense weights were replaced by a compact CPU-kernel copy's values
    (`load_drafter` under matmul_impl="cpu_kernel": rows "q8_0", "q4_1", "b16", "i8", ... overwrite
    each "kernel" with the quantised weights dequantised; the originals are gone)."""
    for path, _ in jax.tree_util.tree_flatten_with_path(head.params)[0]:
        keys = tuple(p.key for p in path)
        if keys not in leaves and keys[-1] not in _EXACT_ROWS:
            raise CheckpointError(
                f"draft head holds compact CPU-kernel rows {'.'.join(keys)!r}: its weights are the quantised "
                f"approximation, not the originals, and cannot be exported; load it with the float kernels "
                f"(target matmul_impl='xla') or load_drafter(..., rows='f16') from a float16 checkpoint to export")


def drafter_state_dict(head: DraftHead, dtype: Optional[str] = None) -> dict[str, np.ndarray]:
    """The head's tensors under the reference names and layouts (torch Linear [out, in]), stored in
    `dtype` (default: the head's); EAGLE-3 adds d2t int64 and t2d bool."""
    cfg = head.cfg
    layout = list(_layout(cfg))
    _refuse_compact_rows(head, {keys for _, _, keys in layout})
    dt = _np_dtype(dtype or cfg.layer.dtype)
    out = {}
    for name, _, keys in layout:
        node = head.params
        for k in keys:
            node = node[k]
        arr = np.asarray(jax.device_get(node))
        out[name] = np.ascontiguousarray((arr.T if keys[-1] == "kernel" else arr).astype(dt))
    if cfg.kind == "eagle3":
        d2t = np.asarray(jax.device_get(head.d2t), np.int64)
        t2d = np.zeros((cfg.vocab_size,), bool)
        t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
        out["d2t"], out["t2d"] = d2t, t2d
    return out


def save_drafter(path, head: DraftHead, target_cfg: ModelConfig, format: str = "safetensors",
                 dtype: Optional[str] = None) -> Path:
    """Write config.json + model.safetensors in the released layout; returns the directory.

    `dtype` ("float32"/"bfloat16"/"float16") is the storage dtype (default: the head's). Only
    safetensors is written (what vLLM / SGLang / EAGLE's ea_model read); `.bin` would need torch.
    EAGLE-1 fc bias: vLLM's `llama_eagle.py` builds fc *without* a bias and skips a file's fc.bias
    (drafts then miss it, silently), SGLang's `llama_eagle.py` always builds one (left at torch's
    random init when the file has none): train `DraftConfig.for_target("eagle1", ..., fc_bias=False)`
    for vLLM, keep the default fc_bias=True for SGLang and SafeAILab/EAGLE. Warns (`UserWarning`)
    when the config is one a server or SafeAILab/EAGLE cannot run as written (module docstring).
    Raises CheckpointError for a head loaded with quantised CPU-kernel rows (`load_drafter(rows=...)`
    under matmul_impl="cpu_kernel"), whose weights are the approximation: load it with the float
    kernels to export it.
    """
    from safetensors.numpy import save_file

    if format != "safetensors":
        raise ValueError(f"save_drafter writes safetensors only (got format={format!r}); "
                         f"vLLM, SGLang and EAGLE's ea_model all read model.safetensors")
    if dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    cfg = head.cfg
    if cfg.vocab_size != target_cfg.vocab_size or cfg.hidden_size != target_cfg.hidden_size:
        raise CheckpointError(f"head (vocab {cfg.vocab_size}, width {cfg.hidden_size}) does not fit the target "
                              f"(vocab {target_cfg.vocab_size}, hidden {target_cfg.hidden_size})")
    hf = drafter_hf_config(head, target_cfg, dtype)
    tensors = drafter_state_dict(head, dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
