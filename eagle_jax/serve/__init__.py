"""`python -m eagle_jax.serve`: one-shot decoding from the command line."""

from .cli import build_parser, main, read_prompts

__all__ = ["build_parser", "main", "read_prompts"]
