"""A loaded target model with its tokenizer: prompts in, text and statistics out.

`Engine` is what the CLI, the HTTP server and the benchmark share: it resolves a model spec
(alias, HF directory or GGUF file), loads params once, applies the chat template, checks that a
request fits the cache, and runs the jitted generation. Cache lengths are rounded up to a bucket
so a handful of shapes compile, each once.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .decoding import cache_length_for, generate_tokens, pack_prompts
from .models.checkpoint import load_hf_dir
from .models.registry import resolve_model
from .sampling import SamplingParams, validate_sampling

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass
class Generation:
    """One prompt's result; `to_json` gives the CLI's --json fields."""

    id: object
    text: str
    tokens: list[int]
    prompt_tokens: int
    new_tokens: int
    target_calls: int
    accept_lengths: list[int]
    seconds: float
    finish_reason: str = "length"

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    def to_json(self) -> dict:
        return {"id": self.id, "text": self.text, "tokens": self.tokens, "new_tokens": self.new_tokens,
                "target_calls": self.target_calls, "accept_lengths": self.accept_lengths,
                "tau": round(self.tau, 4), "seconds": round(self.seconds, 4)}


class Engine:
    """Target model + tokenizer, loaded once.

    Args:
      model: alias (default `smollm2-135m-instruct`), HF directory or `.gguf` file.
      dtype: parameter/activation dtype ("float32" is fastest on CPU).
      max_cache_len: the largest cache (prompt + new tokens) a request may use.
      cache_bucket: cache lengths are rounded up to a multiple of this (one compile per bucket).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "float32", attention: str = "reference",
                 max_cache_len: Optional[int] = None, cache_bucket: int = 128, prefill_chunk: int = 64,
                 progress: bool = True):
        from transformers import AutoTokenizer

        self.model_spec = model
        self.path = Path(resolve_model(model, progress=progress))
        t0 = time.perf_counter()
        self.cfg, self.params = load_hf_dir(self.path, dtype=dtype, attention_impl=attention)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        if progress:
            print(f"[eagle_jax] loaded {self.path.name} ({self.cfg.family}, {self.cfg.num_layers} layers, "
                  f"{dtype}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        self.eos_ids = self._eos_ids()
        self.max_cache_len = max_cache_len or self.cfg.max_position_embeddings
        self.cache_bucket = cache_bucket
        self.prefill_chunk = prefill_chunk

    @property
    def name(self) -> str:
        return self.model_spec if not Path(self.model_spec).exists() else self.path.name

    def _eos_ids(self) -> list[int]:
        ids = set()
        gen = self.path / "generation_config.json"
        if gen.exists():
            e = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """Token ids for a prompt: chat template applied (user turn + generation prompt) unless raw."""
        if raw:
            if not isinstance(prompt, str):
                raise ValueError("raw prompts must be strings")
            return list(self.tokenizer(prompt).input_ids)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> int:
        """The cache length for this request; ValueError naming the problem if it cannot fit."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if prompt_len + max_new_tokens > self.max_cache_len:
            raise ValueError(f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds the cache "
                             f"length {self.max_cache_len}; shorten the prompt or lower max_new_tokens")
        return min(cache_length_for(prompt_len, max_new_tokens, self.cache_bucket),
                   max(self.max_cache_len, prompt_len + max_new_tokens))

    # ------------------------------------------------------------------ generation
    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 128, *, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int = 0, id=None,
                     cache_len: Optional[int] = None) -> Generation:
        """Decode one tokenised prompt. `cache_len` pins the cache shape (the benchmark keeps one
        shape for all prompts); by default it is the prompt + new tokens rounded up to the bucket."""
        validate_sampling(temperature, top_p, top_k)
        need = self.check_fits(len(prompt_ids), max_new_tokens)
        cache_len = max(cache_len or need, len(prompt_ids) + max_new_tokens)
        toks, lens = pack_prompts([prompt_ids], cache_len)
        sp = SamplingParams.create(1, temperature, top_p, top_k)
        eos = jnp.asarray(self.eos_ids or [-1], jnp.int32)
        t0 = time.perf_counter()
        out = generate_tokens(self.params, self.cfg, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(max_new_tokens),
                              eos, sp, jax.random.PRNGKey(seed), prefill_chunk=self.prefill_chunk)
        out = jax.device_get(out)
        seconds = time.perf_counter() - t0
        n = int(out.num_new[0])
        new = [int(t) for t in np.asarray(out.tokens[0, len(prompt_ids):len(prompt_ids) + n])]
        finish = "stop" if new and new[-1] in self.eos_ids else "length"
        calls = int(out.target_calls)
        return Generation(id=id, text=self.decode(new), tokens=new, prompt_tokens=len(prompt_ids), new_tokens=n,
                          target_calls=calls, accept_lengths=[1] * calls, seconds=seconds, finish_reason=finish)

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 128, *, raw: bool = False, **kw) -> Generation:
        return self.generate_ids(self.encode(prompt, raw=raw), max_new_tokens, **kw)
