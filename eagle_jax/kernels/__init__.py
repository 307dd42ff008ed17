"""Pallas kernels (tree attention for verification) and their jnp references."""

from .tree_attention import pack_bits, tree_attention, tree_attention_reference, unpack_bits

__all__ = ["pack_bits", "tree_attention", "tree_attention_reference", "unpack_bits"]
