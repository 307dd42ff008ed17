"""The benchmark's runners: one function per method that decodes a prompt and reports what it made.

eagle_jax's methods run through `Engine.generate_ids`; `hf` and `hf-pld` through transformers'
`generate` on the same weights (PyTorch, float32), greedy or sampled as `Sampling` says.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from .engine import SPEC_METHODS
from .sampling import validate_sampling

ALL_METHODS = ("vanilla", "eagle1", "eagle2", "eagle3", "hf", "hf-pld")
TORCH_METHODS = ("hf", "hf-pld")  # transformers' generate: torch (`pip install -e ".[bench]"`)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How every method decodes: greedy (temperature 0), or sampled with prompt i seeded `seed` + i."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


class HFRunner:
    """transformers' generate on the engine's weights (float32), greedy or sampled; optional prompt lookup."""

    def __init__(self, path: Path, eos_ids: list[int], prompt_lookup: int = 0, sampling: Sampling = GREEDY):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.eos_ids = eos_ids
        self.prompt_lookup = prompt_lookup
        self.sampling = sampling

    def __call__(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> dict:
        torch = self.torch
        ids = torch.tensor([prompt_ids])
        kw = {"prompt_lookup_num_tokens": self.prompt_lookup} if self.prompt_lookup else {}
        sp = self.sampling
        if sp.greedy:
            kw["do_sample"] = False
        else:  # top_k 0 and top_p 1 switch those filters off, as in eagle_jax
            kw.update(do_sample=True, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k)
            torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0], **kw)
        seconds = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        return {"tokens": new, "new_tokens": len(new), "target_calls": None, "seconds": seconds}


def make_runners(engine, methods, cache_len: int, sampling: Sampling = GREEDY) -> dict:
    """{method: run(prompt_ids, max_new_tokens, seed=0) -> row}; `seed` matters only when sampling."""
    runners = {}
    sp = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    for m in methods:
        if m == "vanilla" or m in SPEC_METHODS:
            if m != "vanilla" and m not in engine.heads:
                raise ValueError(f"method {m} needs a drafter: call engine.add_method({m!r}, ...) first")

            def run(ids, n, seed=0, _e=engine, _m=m):
                g = _e.generate_ids(ids, n, cache_len=cache_len, method=_m, seed=seed, **sp)
                return {"tokens": g.tokens, "new_tokens": g.new_tokens, "target_calls": g.target_calls,
                        "seconds": g.seconds, "accept_lengths": g.accept_lengths}
            runners[m] = run
        elif m in TORCH_METHODS:
            runners[m] = HFRunner(engine.path, engine.eos_ids, prompt_lookup=10 if m == "hf-pld" else 0,
                                  sampling=sampling)
        else:
            raise ValueError(f"unknown method {m!r}; available: {', '.join(ALL_METHODS)}")
    return runners
