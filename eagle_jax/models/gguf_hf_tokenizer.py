"""The Hugging Face tokenizer stored in a GGUF file, built without torch.

transformers 5.23 builds a GGUF's tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`)
from metadata read by `transformers.integrations.gguf.reader`, a module that imports torch at its
top; without torch (eagle_jax's runtime never needs it) every GGUF conversion failed with "Could
not import module 'read_gguf_metadata'". The rest of that path does not need torch: this module
reads the metadata with `gguf_index.GGUFIndex` into the dict `read_gguf_metadata` returns (scalars,
numeric arrays as lists, the token and merge lists in full, other string arrays as their counts),
groups it as `get_gguf_tokenizer` does, and converts it with transformers' own
`convert_gguf_tokenizer` into the same `TokenizersBackend` (tests/test_gguf_hf_tokenizer.py compares
the two builds: the same tokenizer.json, special tokens, chat template and BOS/EOS flags).
"""

from __future__ import annotations

import os
from pathlib import Path

from .gguf_index import ARRAY, STRING, GGUFIndex

FULL_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")  # what get_gguf_tokenizer reads whole


def gguf_metadata(path: str | os.PathLike) -> dict:
    """A GGUF file's metadata as transformers' `read_gguf_metadata(path, FULL_STRING_ARRAYS)` gives it."""
    index = GGUFIndex(str(path))
    out = {}
    for key, field in index.fields.items():
        if field.value_type == ARRAY and field.item_type == STRING and key not in FULL_STRING_ARRAYS:
            out[key] = field.count
        else:
            out[key] = field.contents()
    if "general.architecture" not in out:
        raise ValueError(f"{Path(path).name} has no general.architecture in its metadata")
    return out


def build_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer (vocabulary, merges, special tokens, chat template) in a GGUF file."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (_SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING,
                                                                        convert_gguf_tokenizer)

    metadata = gguf_metadata(path)
    # transformers' get_gguf_tokenizer, on this metadata
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"{Path(path).name} stores no tokenizer (no tokenizer.ggml.tokens)")
    kind = tokenizer_dict.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        tokenizer_config.setdefault("add_bos_token", True)
    elif kind == "gemma4":
        tokenizer_config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return TokenizersBackend(tokenizer_object=backend, **tokenizer_config, **extra)
