"""Target decoders: config (HF mapping), decoder with static KV cache, checkpoint loading."""

from .checkpoint import (CheckpointError, expected_hf_tensors, load_hf_dir, params_from_hf_state_dict,
                         params_to_hf_state_dict, save_hf_dir)
from .config import ModelConfig, RopeScaling, UnsupportedConfigError
from .decoder import (DecoderOutput, KVCache, attention_mask, causal_mask, forward, init_params, lm_logits,
                      stack_layers, unstack_layers)
from .gguf_loader import GGUFError, convert_gguf_to_hf_dir, gguf_tokenizer, read_gguf
from .registry import ALIASES, DEFAULT_MODEL, ModelDownloadError, ModelResolutionError, resolve_model

__all__ = [
    "ALIASES", "CheckpointError", "DEFAULT_MODEL", "DecoderOutput", "GGUFError", "KVCache", "ModelConfig",
    "ModelDownloadError", "ModelResolutionError", "RopeScaling", "UnsupportedConfigError", "attention_mask",
    "causal_mask", "convert_gguf_to_hf_dir", "expected_hf_tensors", "forward", "gguf_tokenizer", "init_params",
    "lm_logits", "load_hf_dir", "params_from_hf_state_dict", "params_to_hf_state_dict", "read_gguf",
    "resolve_model", "save_hf_dir", "stack_layers", "unstack_layers",
]
