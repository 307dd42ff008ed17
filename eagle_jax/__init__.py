"""eagle_jax: EAGLE speculative decoding in JAX/Flax.

The public API, by concern:
  * target models — `ModelConfig`, `forward`, `lm_logits`, `KVCache`, `load_hf_dir`, `resolve_model`,
    `unstack_layers` (the unrolled-layer layout, fastest on CPU), ...
  * decoding — `Engine` (tokenizer + model + generation), `generate_tokens`, `SamplingParams`
  * streaming — `Engine.start_stream` → `TokenStream` (tokens call by call), `IncrementalText`
  * kernels — `tree_attention` (Pallas tree-attention kernel and its jnp reference), `pack_bits`
"""

from .decoding import GenerateOutput, generate_tokens
from .engine import Engine, Generation
from .kernels import pack_bits, tree_attention
from .models import (CheckpointError, KVCache, ModelConfig, RopeScaling, UnsupportedConfigError,
                     convert_gguf_to_hf_dir, forward, init_params, lm_logits, load_hf_dir, read_gguf,
                     resolve_model, save_hf_dir, stack_layers, unstack_layers)
from .sampling import SamplingParams, filter_logits, sample, target_probs
from .streaming import IncrementalText, TokenStream

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "Engine", "GenerateOutput", "Generation", "IncrementalText", "KVCache", "ModelConfig", "RopeScaling",
    "SamplingParams", "UnsupportedConfigError", "convert_gguf_to_hf_dir", "filter_logits", "forward",
    "generate_tokens", "init_params", "lm_logits", "load_hf_dir", "pack_bits", "read_gguf", "resolve_model", "sample",
    "save_hf_dir", "stack_layers", "target_probs", "TokenStream", "tree_attention", "unstack_layers",
]
