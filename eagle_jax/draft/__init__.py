"""Draft heads (EAGLE-1/2 and EAGLE-3), their checkpoints in the released layouts, and tree drafting."""

from .checkpoint import UnsafeCheckpointError, load_drafter, load_torch_state_dict, save_drafter
from .config import DraftConfig, default_target_layers
from .drafting import Tree, TreeBudget, draft_dynamic, draft_static, draft_tree
from .heads import (DraftHead, create_draft_cache, fuse_features, head_logits, head_step, init_head, oracle_head,
                    to_target_ids)

__all__ = [
    "DraftConfig", "DraftHead", "Tree", "TreeBudget", "UnsafeCheckpointError", "create_draft_cache",
    "default_target_layers", "draft_dynamic", "draft_static", "draft_tree", "fuse_features", "head_logits",
    "head_step", "init_head", "load_drafter", "load_torch_state_dict", "oracle_head", "save_drafter",
    "to_target_ids",
]
