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
import numpy as np

from .compile_cache import enable_compile_cache
from .decoding import cache_length_for, generate_tokens, pack_prompts, prefill_plan
from .draft.config import DraftConfig
from .draft.drafting import TreeBudget
from .draft.heads import DraftHead, init_head, oracle_head
from .models.checkpoint import load_hf_dir
from .models.decoder import check_layer_layout, with_layer_layout
from .models.registry import resolve_model
from .program_cache import enable_program_cache
from .sampling import SamplingParams, validate_sampling
from .speculative import speculative_generate
from .text_codec import load_codec, load_tokenizer
from .tree import DEFAULT_STATIC_TREE, static_tree_of_size

DEFAULT_MODEL = "smollm2-135m-instruct"
SPEC_METHODS = ("eagle1", "eagle2", "eagle3")
DEFAULT_LOOKUP = 6  # prompt-lookup chain in the default dynamic tree (tuned and packaged budgets say their own)
# The warm-up request: `compile_streams` compiles the programs that `warm_stream` then runs with it.
WARM_PROMPT, WARM_TOKENS = "Hi", 2


def default_budget(method: str, total_tokens: Optional[int] = None, depth: Optional[int] = None,
                   top_k: Optional[int] = None, lookup: Optional[int] = None) -> TreeBudget:
    """CPU-sized trees (verification cost grows fast with tokens on a CPU; see DESIGN.md):
    eagle1 = the default static tree, or with `total_tokens` N its first N nodes
    (`tree.static_tree_of_size`); eagle2/eagle3 = dynamic, 24 tokens (without `total_tokens`: as
    many as a given depth and top-k hold, up to 24), depth 5, top-k 4 and a
    prompt-lookup chain of up to `DEFAULT_LOOKUP` of those tokens (at most N - 2; `TreeBudget.lookup`;
    eagle1: none unless asked)."""
    if method == "eagle1":
        if depth is not None or top_k is not None:
            raise ValueError("eagle1 uses a static tree; --depth/--tree-top-k apply to eagle2/eagle3 "
                             "(--total-tokens N picks a static tree of N nodes)")
        tree = DEFAULT_STATIC_TREE if total_tokens is None else static_tree_of_size(int(total_tokens))
        return TreeBudget("static", static_tree=tree, lookup=lookup or 0)
    d, k = (5 if depth is None else depth), (4 if top_k is None else top_k)  # 0 given is refused, not unset
    # without a size: 24 tokens, or as many as the shape holds (depth 1, top-k 2: 7)
    n = max(2, min(24, TreeBudget.most_tokens(d, k))) if total_tokens is None else total_tokens
    return TreeBudget("dynamic", total_tokens=n, depth=d, top_k=k,
                      lookup=max(0, min(DEFAULT_LOOKUP, n - 2)) if lookup is None else lookup)


def default_prefill_chunk(cfg) -> int | tuple[int, int]:
    """Prefill chunks: (128, 8) with the CPU kernels (big chunks through XLA's GEMM, the rest of a
    prompt 8 tokens a pass through the few-row kernels, which cost about as much per token; on the
    2-core Zen 1 VM the first token of a 36-43-token chat prompt came in 0.33 s against 0.44 with
    chunks of 64, of a 127-221-token code prompt in 1.05 s against 1.23: README.md), else 64 (an
    accelerator pads a short prompt cheaply)."""
    return (128, 8) if cfg.matmul_impl == "cpu_kernel" else 64


def parse_prefill_chunk(spec: Optional[str]):
    """The CLI's --prefill-chunk: "64" → 64, "128,8" → (128, 8) (big, tail), "auto"/None → None
    (`default_prefill_chunk`)."""
    if spec is None or str(spec).strip().lower() in ("", "auto"):
        return None
    try:
        parts = tuple(int(x) for x in str(spec).split(","))
    except ValueError:
        raise ValueError(f"--prefill-chunk must be N or BIG,TAIL (e.g. 128,8), got {spec!r}") from None
    if len(parts) not in (1, 2):
        raise ValueError(f"--prefill-chunk must be N or BIG,TAIL (e.g. 128,8), got {spec!r}")
    big, tail = prefill_plan(parts[0] if len(parts) == 1 else parts)
    return (big, tail) if tail else big


def default_drafter_path(model_spec: str, kind: str) -> Optional[Path]:
    """The packaged drafter for a model alias, if one ships with eagle_jax."""
    root = Path(__file__).parent / "assets" / "drafters" / f"{model_spec}-{kind}"
    return root if (root / "config.json").exists() else None


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
      prefill_chunk: prompt tokens per prefill pass: an int, or (big, tail) (`decoding.prefill_plan`:
        big chunks, then tail chunks for the rest of the prompt); None: `default_prefill_chunk`.
      compile_cache: keep compiled programs on disk for later processes (`compile_cache.py`:
        `~/.cache/eagle_jax/xla` unless JAX already has a cache directory), and traced ones
        (`program_cache.py`: `~/.cache/eagle_jax/programs`, so a later process skips tracing the
        decoding programs as well); False does not turn them on.
      layers: "unroll" (a compiled program per layer, each reading its own weights: the fastest on
        CPU), "scan" (the stacked checkpoint layout in one scanned layer: faster compiles, the
        layout sharded training uses) or "auto" (unroll on CPU, scan elsewhere). Same numbers.
      matmul: "cpu_kernel" (the few-row matmul of `kernels/cpu_matmul.py`, AVX-512 or AVX2: a
        tree verification costs little more than one token there), "xla", or "auto" (the kernel
        when JAX runs on an x86-64 CPU with AVX-512 or AVX2 and it builds, else XLA). Float32
        products only. With the kernel, a GGUF model (an alias or a .gguf file) also keeps its
        Q4_1 / Q8_0 blocks, which few-row products read instead of the float32 weights (same
        result; `models/quantized.py`).
      draft_rows: with the kernel, what draft heads loaded by `add_method` keep for it: "q4_1x8"
        (the head quantised to Q4_1, 5 bits a weight, multiplied by int8 rows of x as the target's
        layers are under int8 activations; AVX512-VNNI or AVX2: the fastest drafting where the CPU
        has them), "q8_0x8" (the same with Q8_0), "i8" (int8 weights, one scale a column, rows of x
        rounded to int8; AVX512-VNNI), "b16" (the head rounded to bfloat16, multiplied by
        AVX512-BF16 dot instructions), "q8_0" / "q4_1" (Q8_0 / Q4_1 on float32 rows of x), "f16" (a
        float16 checkpoint's own values, exactly) or "auto" (q4_1x8 where available, else b16 where
        available, else q8_0). The output
        stays lossless whichever: the drafts are only proposals.
      activations: with the kernel and GGUF blocks, how the target's products treat x: "float32"
        (decoding steps and tree verifications through the kernel, prefill chunks through XLA:
        exactly the converted float32 model, as transformers computes it), "int8" (each 32-value
        block of x rounded to int8, products summed exactly in int32 by AVX512-VNNI or AVX2, the
        same results on both, as llama.cpp computes GGUF models; prefill through the kernel too, so
        a prompt's keys do not depend on its chunk or batch: 1.5-2x as fast a step, the next-token
        loss ~0.2% higher; the float32 layer weights that the blocks replace are not even loaded:
        425 MB on SmolLM2) or "auto" (int8 where the kernel has them). Plain and speculative
        decoding run the same products, so speculative output equals plain output either way.
        `self.activations` says which is in use ("float32" without GGUF blocks).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "float32", attention: str = "reference",
                 max_cache_len: Optional[int] = None, cache_bucket: int = 128, prefill_chunk=None,
                 method: str = "vanilla", drafter: Optional[str] = None, budget: Optional[TreeBudget] = None,
                 progress: bool = True, layers: str = "auto", compile_cache: bool = True, matmul: str = "auto",
                 draft_rows: str = "auto", activations: str = "auto"):
        from .kernels.cpu_matmul import ANY_ROWS, resolve_matmul_impl
        from .models.checkpoint import read_safetensors_dir
        from .models.quantized import (ACTIVATIONS, DRAFT_ROWS, attach_gguf_blocks, drop_shadowed_kernels,
                                       gguf_kernel_paths, kernels_without_blocks, regroup_for_int8,
                                       resolve_activations, resolve_draft_rows)
        from .models.registry import model_gguf

        check_layer_layout(layers)  # before any loading
        if draft_rows not in DRAFT_ROWS:
            raise ValueError(f"draft_rows must be one of {DRAFT_ROWS}, got {draft_rows!r}")
        self.draft_rows = draft_rows
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.activations = "float32"
        self._kernel_flags = (matmul, activations, draft_rows)

        if compile_cache:
            enable_compile_cache()
            enable_program_cache()
        self.model_spec = model
        self.path = Path(resolve_model(model, progress=progress))
        t0 = time.perf_counter()
        matmul_impl, gguf, omit = resolve_matmul_impl(matmul), None, ()
        if matmul_impl == "cpu_kernel":
            self.draft_rows = resolve_draft_rows(draft_rows)
            try:  # the GGUF may be gone from the cache while its conversion stays: fall back, say so
                gguf = model_gguf(model)
            except Exception as e:  # noqa: BLE001 - any failure to find the file only costs speed
                print(f"[eagle_jax] not using GGUF blocks: the GGUF behind {model!r} is unavailable ({e})",
                      file=sys.stderr)
            if gguf is not None:
                self.activations = resolve_activations(activations)
            if self.activations == "int8":
                # the float32 layer weights that the GGUF blocks replace are dropped below unread:
                # not loading them saves 1.5-2 s of a start (SmolLM2, the Zen 4 VM, stop 64)
                omit = gguf_kernel_paths()
        say = (lambda m: print(f"[eagle_jax] {m}", file=sys.stderr)) if progress else None

        def load(omit):  # (cfg, params), with the GGUF's blocks attached where there is one
            cfg, params = load_hf_dir(self.path, omit=omit, dtype=dtype, attention_impl=attention)
            cfg = cfg.replace(matmul_impl=matmul_impl)
            if gguf is not None:
                _, get = read_safetensors_dir(self.path)
                params = attach_gguf_blocks(params, cfg, gguf, check="rows", log=say, reference=get)
            return cfg, params

        self.cfg, self.params = load(omit)
        if kernels_without_blocks(self.params, omit):  # some were not replaced by blocks: read everything
            self.cfg, self.params = load(())
        self.quantized = gguf is not None
        if self.activations == "int8":
            self.params = regroup_for_int8(self.params)
            # every product and attention block through the kernels, prefill chunks included:
            # XLA's float32 GEMM there would give a prompt other keys than the int8 products
            # of a decoding step, and a batch's (or chunk's) size would decide which a token got
            self.cfg = self.cfg.replace(kernel_rows=ANY_ROWS)
            self.params = drop_shadowed_kernels(self.params)  # never read now: 425 MB on SmolLM2
        self.params = with_layer_layout(self.params, layers)
        self.layers = "scan" if isinstance(self.params["layers"], dict) else "unroll"
        self._tokenizer = None  # the transformers tokenizer, loaded when something needs it (`tokenizer`)
        self._codec, self._tokenizer = load_codec(self.path, loader=lambda: self.tokenizer)  # a snapshot: no import
        if progress:
            print(f"[eagle_jax] loaded {self.path.name} ({self.cfg.family}, {self.cfg.num_layers} layers, "
                  f"{dtype}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        self.eos_ids = self._eos_ids()
        self.max_cache_len = max_cache_len or self.cfg.max_position_embeddings
        self.cache_bucket = cache_bucket
        big, tail = prefill_plan(default_prefill_chunk(self.cfg) if prefill_chunk is None else prefill_chunk)
        self.prefill_chunk = (big, tail) if tail else big  # hashable: a jit static argument
        self.method = method
        self.heads: dict[str, DraftHead] = {}  # by method
        self.budgets: dict[str, TreeBudget] = {}
        self._compiled: set = set()  # programs compile_for has compiled (its keys)
        if method != "vanilla":
            self.add_method(method, drafter or "default", budget)

    @property
    def kernel_tag(self) -> str:
        """`autotune.kernel_tag` of the kernel settings this engine was asked for ("" for the
        defaults), as serve computes it from its flags: the suffix of the budgets tuned with them on
        this device."""
        from .autotune import kernel_tag

        return kernel_tag(*self._kernel_flags)

    # ------------------------------------------------------------------ speculative methods
    def add_method(self, method: str, drafter: str | DraftHead = "default", budget: Optional[TreeBudget] = None):
        """Make `method` (eagle1 | eagle2 | eagle3) available with a drafter spec or head.

        drafter: "default" (the packaged head for the default target), a directory in the released
        EAGLE layouts, "random" (a seeded random head: low acceptance, for testing) or "oracle"
        (the target drafting for itself: maximal acceptance, for testing and upper bounds).
        budget: the tree; by default the one serve and bench pick without tree flags (tuned on this
        device before, else packaged for this platform, else `default_budget`).
        """
        if method not in SPEC_METHODS:
            raise ValueError(f"unknown method {method!r}; choose from vanilla, {', '.join(SPEC_METHODS)}")
        head = drafter if isinstance(drafter, DraftHead) else self.load_head(method, drafter)
        want = "eagle3" if method == "eagle3" else "eagle1"
        if head.cfg.kind not in (want, "oracle"):
            raise ValueError(f"method {method} needs an {want.upper().replace('EAGLE', 'EAGLE-')} head, "
                             f"but the drafter is {head.cfg.kind}")
        self.heads[method] = head
        if budget is None and isinstance(drafter, str):  # what serve and bench run without tree flags
            from .autotune import resolve_budget

            budget = resolve_budget(self.model_spec, method, drafter, None, kernels=self.kernel_tag)[0]
        self.budgets[method] = budget or default_budget(method)

    def load_head(self, method: str, spec: str, rows: Optional[str] = None) -> DraftHead:
        """The head `add_method(method, spec)` would load, without adding it; `rows` overrides
        the engine's `draft_rows` for it (only the CPU kernel reads them)."""
        kind = "eagle3" if method == "eagle3" else "eagle1"
        if spec == "oracle":
            return oracle_head(self.cfg, self.params)
        if spec == "random":
            return init_head(DraftConfig.for_target(kind, self.cfg, draft_vocab_size=min(self.cfg.vocab_size, 8192)),
                             jax.random.PRNGKey(0))
        if spec == "default":
            path = default_drafter_path(self.model_spec, kind)
            if path is None:
                raise ValueError(f"no default {kind} drafter is packaged for model {self.model_spec!r}; "
                                 f"pass --drafter PATH (a released EAGLE layout), 'random' or 'oracle'")
            spec = str(path)
        from .draft.checkpoint import load_drafter

        return load_drafter(spec, self.cfg, rows=rows or self.draft_rows)

    @property
    def name(self) -> str:
        return self.model_spec if not Path(self.model_spec).exists() else self.path.name

    @property
    def tokenizer(self):
        """The transformers tokenizer of the target (loaded on first use: encode / decode / the chat
        template go through `text_codec`'s snapshot of it where there is one)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    def _eos_ids(self) -> list[int]:
        ids = set()
        gen = self.path / "generation_config.json"
        if gen.exists():
            e = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
        if self._codec.eos_token_id is not None:
            ids.add(self._codec.eos_token_id)
        return sorted(ids)

    # ------------------------------------------------------------------ prompts
    def encode(self, prompt: str | list[dict], raw: bool = False) -> list[int]:
        """Token ids for a prompt: chat template applied (user turn + generation prompt) unless raw."""
        if raw:
            if not isinstance(prompt, str):
                raise ValueError("raw prompts must be strings")
            return self._codec.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self._codec.encode(self._codec.render_chat(messages), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._codec.decode(ids)

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
    def _request(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 seed: int, cache_len: Optional[int], method: Optional[str]):
        """Check a request and build its device arguments: (method, (tokens, lengths, max_new, eos, sp, key))."""
        validate_sampling(temperature, top_p, top_k)
        need = self.check_fits(len(prompt_ids), max_new_tokens)
        cache_len = max(cache_len or need, len(prompt_ids) + max_new_tokens)
        method = method or self.method
        if method != "vanilla" and method not in self.heads:
            raise ValueError(f"method {method!r} is not set up on this engine (call add_method first)")
        toks, lens = pack_prompts([prompt_ids], cache_len)
        sp = SamplingParams.create(1, temperature, top_p, top_k)
        eos = np.asarray(self.eos_ids or [-1], np.int32)
        put = jax.device_put  # not jnp.asarray: no program compiled per shape
        return method, (put(toks), put(np.asarray(lens)), put(np.int32(max_new_tokens)), put(eos), sp,
                        jax.random.PRNGKey(seed))

    def _program(self, method: str):
        """(jitted program, its arguments before the request's, its static keywords) of a `method`
        request: what `generate_ids` runs and `compile_for` compiles."""
        if method == "vanilla":
            return generate_tokens, (self.params, self.cfg), {"prefill_chunk": self.prefill_chunk}
        return (speculative_generate, (self.params, self.cfg, self.heads[method]),
                {"budget": self.budgets[method], "prefill_chunk": self.prefill_chunk})

    def compile_for(self, prompt_ids: list[int], max_new_tokens: int = 128, *, temperature: float = 0.0,
                    top_p: float = 1.0, top_k: int = 0, cache_len: Optional[int] = None,
                    method: Optional[str] = None) -> Optional[float]:
        """Trace and compile the program that `generate_ids` runs for this request (its shapes: the
        cache size; its method, head, tree budget and kernels) without running it: the seconds that
        took, or None when this engine has compiled that program before. Otherwise the first request
        of a shape pays for it inside `generate_ids`, whose `seconds` then include it; the CLI calls
        this first, so that the speed it reports is decoding's. Checks the request as `generate_ids` does."""
        method, args = self._request(prompt_ids, max_new_tokens, temperature, top_p, top_k, 0, cache_len, method)
        fn, lead, static = self._program(method)
        key = (method, tuple(map(id, lead[2:])), tuple(static.items()),
               tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args)))
        if key in self._compiled:
            return None
        t0 = time.perf_counter()
        fn.lower(*lead, *args, **static).compile()
        self._compiled.add(key)
        return time.perf_counter() - t0

    def compile_streams(self, cache_lens: Sequence[int], temperature: float = 0.0, top_p: float = 1.0,
                        top_k: int = 0, method: Optional[str] = None) -> float:
        """Trace and compile what `start_stream` runs (the start and the advance) for each cache size
        in `cache_lens`, one thread a size, without running anything; the seconds that took. XLA
        compiles a program, and loads one from its disk cache, without holding the GIL: the server's
        two cache buckets loaded in about 60% of the time they took one after the other (stop 68)."""
        from concurrent.futures import ThreadPoolExecutor

        from .streaming import compile_stream

        t0 = time.perf_counter()
        ids = self.encode(WARM_PROMPT)
        requests = [self._request(ids, WARM_TOKENS, temperature, top_p, top_k, 0, c, method) for c in cache_lens]
        with ThreadPoolExecutor(max(1, len(requests))) as pool:
            list(pool.map(lambda r: compile_stream(self, *r), requests))  # list(): raise what a thread raised
        return time.perf_counter() - t0

    def warm_stream(self, cache_len: int, **sampling) -> float:
        """Compile what `start_stream` runs for a `cache_len` cache (the start and the advance) by
        streaming two tokens of a short prompt; the seconds that took (the server's warm-up per cache
        bucket, the chat's before its first prompt)."""
        t0 = time.perf_counter()
        stream = self.start_stream(self.encode(WARM_PROMPT), WARM_TOKENS, cache_len=cache_len, **sampling)
        while not stream.done:
            stream.advance(1)
        return time.perf_counter() - t0

    def finish_reason(self, new_tokens: Sequence[int]) -> str:
        return "stop" if new_tokens and new_tokens[-1] in self.eos_ids else "length"

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int = 128, *, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int = 0, id=None,
                     cache_len: Optional[int] = None, method: Optional[str] = None) -> Generation:
        """Decode one tokenised prompt. `cache_len` pins the cache shape (the benchmark keeps one
        shape for all prompts); by default it is the prompt + new tokens rounded up to the bucket."""
        method, args = self._request(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, cache_len, method)
        t0 = time.perf_counter()
        fn, lead, static = self._program(method)
        out = jax.device_get(fn(*lead, *args, **static))
        seconds = time.perf_counter() - t0
        calls, accept = call_stats(out)
        n = int(out.num_new[0])
        new = [int(t) for t in np.asarray(out.tokens[0, len(prompt_ids):len(prompt_ids) + n])]
        return Generation(id=id, text=self.decode(new), tokens=new, prompt_tokens=len(prompt_ids), new_tokens=n,
                          target_calls=calls, accept_lengths=accept, seconds=seconds,
                          finish_reason=self.finish_reason(new))

    def generate(self, prompt: str | list[dict], max_new_tokens: int = 128, *, raw: bool = False, **kw) -> Generation:
        return self.generate_ids(self.encode(prompt, raw=raw), max_new_tokens, **kw)

    def start_stream(self, prompt_ids: list[int], max_new_tokens: int = 128, *, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, seed: int = 0, cache_len: Optional[int] = None,
                     method: Optional[str] = None):
        """Begin a generation that yields tokens call by call (`streaming.TokenStream`); the same
        arguments give the same tokens as `generate_ids`."""
        from .streaming import TokenStream

        method, args = self._request(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, cache_len, method)
        return TokenStream(self, method, args)


def call_stats(out) -> tuple[int, list[int]]:
    """(target calls, tokens per call) of row 0 of a `GenerateOutput` or `SpecOutput` (host arrays);
    the prefill's pass, which produced the first token, comes first."""
    if out.target_calls.ndim == 0:  # plain decoding: one token per call
        calls = int(out.target_calls)
        return calls, [1] * calls
    calls = int(out.target_calls[0])
    return calls, [1] + [int(a) for a in np.asarray(out.accept_lengths[0, :calls - 1])]
