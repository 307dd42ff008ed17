"""Shared fixtures: tiny random Hugging Face models of every supported family, and their
eagle_jax twins built from the same weights."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc
from pathlib import Path

_base = os.environ.get("EAGLE_JAX_CACHE") or str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle_jax")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # One persistent compilation cache for the test runs on this machine (both xdist workers, later
    # runs, and the CLIs the tests start), apart from the user's own (`compile_cache.py`): programs
    # cleared at a file's end (below), compiled by the other worker, or by an earlier run reload
    # from it instead of recompiling. Compiling dominates the tiny-model tests (test_speculative's
    # greedy tests: 126 s cold, 38 s warm on the 2-core Zen 1 VM). Capped at 2 GiB, least recently
    # used first out; its lock makes reads and writes safe across processes. For a cold run, point
    # JAX_COMPILATION_CACHE_DIR at an empty directory.
    # The base is registry.default_cache_dir()'s rule, written out: importing eagle_jax imports jax,
    # which reads these variables once, at its import.
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(Path(_base).expanduser() / "xla-tests")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))
# The traced-program cache (eagle_jax/program_cache.py) is on for every test, as the Engine turns it
# on for users: each decoding program the tests run goes through its serialised form. The tests'
# own directory, beside xla-tests (the tests' programs would otherwise fill the user's cache).
# For a cold run, point EAGLE_JAX_PROGRAM_CACHE at an empty directory as well.
os.environ.setdefault("EAGLE_JAX_PROGRAM_CACHE", str(Path(_base).expanduser() / "programs-tests"))
# JAX keeps only programs that took at least 1 s to compile; at level 0 (below) most tiny-model
# programs take less, so a warm run would recompile them. From 0.2 s up: tests/test_decoding.py
# cold / warm 57 / 50 s with 1 s, 53 / 35 s with 0.2 s, 66 / 31 s with 0 (writing every small program).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # The tests compile hundreds of programs and run most of them for a few steps on tiny models, so
    # XLA:CPU's LLVM optimisation (level 3 by default) is most of their time. Level 0 keeps every HLO
    # pass and the same kernels (matmuls, our C++ int8/top-k kernels); it only leaves the generated
    # loops unoptimised. The whole suite on a cold compilation cache: 28m15s -> 20m51s on the 2-core
    # Zen 3 VM. Results can differ from level 3 in the last bit (contracted multiply-adds), so a
    # near-tie can pick another greedy token than a user's run does; each test compares programs of
    # one process (or its children, which inherit this), so what they check holds at either level.
    # To run the suite as users' programs are compiled: XLA_FLAGS=--xla_backend_optimization_level=3.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import numpy as np
import pytest

from eagle_jax.program_cache import enable_program_cache

enable_program_cache()


def pytest_collection_modifyitems(config, items):
    """Files with slow tests run first (the order within each group kept): under `-n 2 --dist
    loadfile` a worker takes a whole file at a time, so a long file left to the end would run alone
    while the other worker idles; the short files fill in last."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILY_EXTRAS = {
    "llama": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama_bias_untied": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=32, num_key_value_heads=1),
    "mistral": dict(sliding_window=6, num_key_value_heads=4),
}


def make_hf_model(name: str, seed: int = 0, std: float = 0.08):
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    family = name.split("_")[0]
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[family]
    hf_cfg = cls[0](**{**TINY, **FAMILY_EXTRAS[name]})
    torch.manual_seed(seed)
    model = cls[1](hf_cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return model


def twin(model, **overrides):
    """(cfg, params) of eagle_jax built from a HF model's config and weights."""
    from eagle_jax.models.checkpoint import params_from_hf_state_dict
    from eagle_jax.models.config import ModelConfig

    cfg = ModelConfig.from_hf_config(model.config.to_diff_dict(), **overrides)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return cfg, params_from_hf_state_dict(cfg, sd)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program when a test file ends.

    XLA:CPU maps each compiled program's code into the process (several memory maps a program; an
    unrolled SmolLM2 step has hundreds), and jit caches keep them all alive. Over the whole suite
    that passed Linux's default 65530 maps per process (vm.max_map_count), and the next compile
    segfaulted inside XLA. Clearing at every file boundary keeps the count to one file's programs.
    """
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_program_cache_under_patches(request):
    """A test that patches code (the `monkeypatch` fixture) runs with the traced-program cache off: a
    program's key covers eagle_jax's source files, not a function patched at run time, so a program
    cached from the unpatched code would run in its place (`program_cache.py`). Tests that need the
    cache under a patch turn it on themselves (tests/test_program_cache.py)."""
    if "monkeypatch" in request.fixturenames:
        from eagle_jax import program_cache

        patch = request.getfixturevalue("monkeypatch")
        patch.setenv("EAGLE_JAX_PROGRAM_CACHE", "off")  # an Engine built in the test keeps it off
        patch.setitem(program_cache._state, "dir", None)
    yield


@pytest.fixture(scope="session")
def tiny_llama():
    model = make_hf_model("llama", std=0.2)
    cfg, params = twin(model)
    return model, cfg, params


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def write_tiny_tokenizer(path, vocab_size: int):
    """A word-level tokenizer over `w3 … w{V-1}` with <unk>=0, <s>=1, </s>=2 and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<s> w3 {{ m['content'] }} </s> {% endfor %}"
                          "{% if add_generation_prompt %}<s> w4 {% endif %}")
    fast.save_pretrained(str(path))


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, tiny_llama):
    """A HF directory (config, safetensors, tokenizer) of the tiny llama: what Engine loads."""
    from eagle_jax.models.checkpoint import save_hf_dir

    model, cfg, params = tiny_llama
    path = tmp_path_factory.mktemp("tiny_hf")
    save_hf_dir(path, cfg, params, extra_config={"bos_token_id": 1, "eos_token_id": 2})
    write_tiny_tokenizer(path, cfg.vocab_size)
    return path


@pytest.fixture(scope="session")
def smollm2_engine():
    """The real default target's Engine (the GGUF downloaded and converted into the cache on first use)."""
    from eagle_jax.engine import Engine

    return Engine("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def smollm2():
    """The real default target computed exactly (`activations="float32"`: what transformers computes;
    `smollm2_engine` rounds rows of x to int8 where the CPU has AVX512-VNNI), with the transformers
    model loaded from the same GGUF: (Engine, model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle_jax.engine import Engine
    from eagle_jax.models import registry

    engine = Engine("smollm2-135m-instruct", progress=False, activations="float32")
    gguf = registry.alias_gguf("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    return engine, hf
