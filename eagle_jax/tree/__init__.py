"""Draft trees: static (EAGLE-1) and dynamic (EAGLE-2) trees, their buffers, lossless acceptance.

Shared layout for one step: N nodes (static), node 0 the root (the committed last token, parent
-1), `tokens_bn`, `parents_bn` (parent < child), `valid_bn` (padding nodes are ignored everywhere);
siblings are distinct tokens in draft-rank order; valid nodes have depth <= max_depth D. A chain
found by prompt lookup may be grafted on after the head's nodes (`lookup.py`).
"""

from .acceptance import (Accepted, accept_from_logits, emitted_tokens, greedy_accept, path_tokens,
                         sample_accept)
from .buffers import (TreeBuffers, ancestor_mask, effective_parents, is_leaf, node_depths, path_to,
                      retrieve_indices, tree_buffers, tree_positions)
from .lookup import graft_chain, lookup_chain
from .rerank import LevelExpansion, expand_level, level_offset, num_candidates, rerank, select_frontier
from .static import DEFAULT_STATIC_TREE, PRIORITY_PATHS, Level, StaticTree, static_tree_of_size

__all__ = [
    "Accepted", "DEFAULT_STATIC_TREE", "Level", "LevelExpansion", "PRIORITY_PATHS", "StaticTree", "TreeBuffers",
    "accept_from_logits", "ancestor_mask", "effective_parents", "emitted_tokens", "expand_level",
    "graft_chain", "greedy_accept", "is_leaf", "level_offset", "lookup_chain", "node_depths", "num_candidates",
    "path_to", "path_tokens", "rerank", "retrieve_indices", "sample_accept", "select_frontier", "static_tree_of_size",
    "tree_buffers", "tree_positions",
]
