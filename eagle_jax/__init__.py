"""eagle_jax: EAGLE speculative decoding in JAX/Flax.

The public API, by concern:
  * target models — `ModelConfig`, `forward`, `lm_logits`, `KVCache`, `load_hf_dir`, `resolve_model`,
    `unstack_layers` (the unrolled-layer layout, fastest on CPU), ...
  * decoding — `Engine` (tokenizer + model + generation; `Engine.add_method("eagle3")` adds a
    drafter), `generate_tokens`, `SamplingParams`
  * speculative decoding — `speculative_generate` (the functional form of what `Engine` runs),
    `TreeBudget` (static EAGLE-1 or dynamic EAGLE-2 trees), `draft_tree`, `SpecOutput`
  * draft heads — `DraftConfig`, `DraftHead`, `init_head`, `load_drafter` / `save_drafter`
    (the released EAGLE / EAGLE-3 checkpoint layouts)
  * training — `TrainConfig`, `Trainer`, `ObjectiveConfig`, `eagle1_loss`, `eagle3_loss`,
    `load_conversations` (imported on first use: optax, orbax and grain load only then)
  * streaming — `Engine.start_stream` → `TokenStream` (tokens call by call), `IncrementalText`
  * kernels — `tree_attention` (Pallas tree-attention kernel and its jnp reference), `pack_bits`
"""

import importlib

from .decoding import GenerateOutput, generate_tokens
from .draft import DraftConfig, DraftHead, Tree, TreeBudget, draft_tree, init_head, load_drafter, save_drafter
from .engine import Engine, Generation
from .kernels import pack_bits, tree_attention
from .models import (CheckpointError, KVCache, ModelConfig, RopeScaling, UnsupportedConfigError,
                     convert_gguf_to_hf_dir, forward, init_params, lm_logits, load_hf_dir, read_gguf,
                     resolve_model, save_hf_dir, stack_layers, unstack_layers)
from .sampling import SamplingParams, filter_logits, sample, target_probs
from .speculative import SpecOutput, speculative_generate
from .streaming import IncrementalText, TokenStream

__version__ = "0.1.0"

# name -> module: the training API, imported when first asked for (module __getattr__, PEP 562)
_LAZY = {
    "TrainConfig": ".training.trainer", "Trainer": ".training.trainer",
    "ObjectiveConfig": ".training.objectives", "eagle1_loss": ".training.objectives",
    "eagle3_loss": ".training.objectives", "load_conversations": ".training.data",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CheckpointError", "DraftConfig", "DraftHead", "Engine", "GenerateOutput", "Generation", "IncrementalText",
    "KVCache", "ModelConfig", "ObjectiveConfig", "RopeScaling", "SamplingParams", "SpecOutput", "TokenStream",
    "TrainConfig", "Trainer", "Tree", "TreeBudget", "UnsupportedConfigError", "convert_gguf_to_hf_dir",
    "draft_tree", "eagle1_loss", "eagle3_loss", "filter_logits", "forward", "generate_tokens", "init_head",
    "init_params", "lm_logits", "load_conversations", "load_drafter", "load_hf_dir", "pack_bits", "read_gguf",
    "resolve_model", "sample", "save_drafter", "save_hf_dir", "speculative_generate", "stack_layers",
    "target_probs", "tree_attention", "unstack_layers",
]
