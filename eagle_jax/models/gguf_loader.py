"""GGUF files (llama.cpp) → a Hugging Face–named, HF-shaped float32 state dict.

A GGUF holds the metadata (`{arch}.block_count`, `tokenizer.ggml.*`, ...) and tensors named the
llama.cpp way (`blk.3.attn_q.weight`), stored in ggml's order (dimensions reversed) and often
block-quantised. `read_gguf` maps the metadata onto a `config.json` dict and the tensor names onto
HF names, and dequantises one tensor at a time on request, so the result plugs straight into
`checkpoint.params_from_hf_state_dict`. `convert_gguf_to_hf_dir` writes a directory that both
`checkpoint.load_hf_dir` and `transformers.AutoModelForCausalLM.from_pretrained` load.

Two things llama.cpp's converter changes that have to be undone here:

* For the `llama` architecture it permutes the rows of q_proj / k_proj (weights and biases) from
  HF's half-split RoPE layout to the interleaved one that ggml's RoPE kernel expects. Every head's
  rows `[x0 .. x_{d/2-1}, y0 .. y_{d/2-1}]` become `[x0, y0, x1, y1, ...]`; `_unpermute_rows`
  reverses it. Qwen2/Qwen3 use the NeoX RoPE kernel and are written unpermuted.
* Llama 3.1-style RoPE scaling is not stored as metadata but as a `rope_freqs.weight` tensor of
  per-frequency divisors; `_llama3_rope_from_factors` recovers the `rope_scaling` parameters from it
  (and checks that they reproduce the tensor).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from .checkpoint import CheckpointError, expected_hf_tensors
from .config import ModelConfig, RopeScaling
from .gguf_index import Field, GGUFIndex, UnsupportedGGUF


class GGUFError(ValueError):
    """A GGUF file uses something this loader does not support (architecture, tensor type, ...)."""


SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# ggml tensor types we dequantise (all through `gguf.quants.dequantize`). The i-quants, ternary and
# FP4 formats are left out on purpose: nothing here has been checked against them.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# llama.cpp per-layer tensor base name → HF module path under `model.layers.{i}.`
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ROPE_FREQS = "rope_freqs.weight"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

_MISSING = object()


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor name, or None when it has no HF counterpart."""
    m = _LAYER_RE.match(gguf_name)
    if m:
        layer, base, kind = m.groups()
        module = _LAYER_TENSORS.get(base)
        return None if module is None else f"model.layers.{int(layer)}.{module}.{kind}"
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    return None


def gguf_tensor_name(hf_name: str) -> str | None:
    """Inverse of `hf_tensor_name` (used to name missing tensors the way the GGUF would)."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
    if m:
        layer, module, kind = m.groups()
        for base, mod in _LAYER_TENSORS.items():
            if mod == module:
                return f"blk.{layer}.{base}.{kind}"
        return None
    for base, mod in _GLOBAL_TENSORS.items():
        if hf_name.startswith(mod + "."):
            return base + hf_name[len(mod):]
    return None


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)`: per head, interleaved rotary pairs → half split.

    llama.cpp reshapes the rows to [n_head, 2, d/2] and swaps the last two axes; the inverse reads
    them as [n_head, d/2, 2] and swaps back. Works for weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shortest_float(v) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 → 1e-05)."""
    return float(str(np.float32(v)))


class GGUFModel:
    """One GGUF file, memory-mapped: its HF config and its tensors under HF names.

    `get(name)` dequantises a single tensor into a fresh float32 array in the HF shape.
    """

    def __init__(self, path: str | os.PathLike):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:  # the fast header reader; gguf's own reads what it does not (and reports bad files)
            self._reader = GGUFIndex(str(self.path))
        except UnsupportedGGUF:
            try:
                self._reader = GGUFReader(str(self.path))
            except Exception as e:  # noqa: BLE001 - the reader raises assorted errors on bad files
                raise GGUFError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.architecture = self._meta("general.architecture", "")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"GGUF architecture {self.architecture!r} in {self.path.name} is not supported "
                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self._tensors = {}  # hf name → tensor (a GGUFIndex Tensor, or a GGUFReader ReaderTensor)
        self._gguf_names = {}  # hf name → gguf name
        rope_freqs = None
        for t in self._reader.tensors:
            if t.name == _ROPE_FREQS:
                rope_freqs = t
                continue
            hf = hf_tensor_name(t.name)
            if hf is None:
                raise GGUFError(f"GGUF tensor {t.name!r} in {self.path.name} has no Hugging Face counterpart "
                                f"for architecture {self.architecture!r}")
            self._tensors[hf] = t
            self._gguf_names[hf] = t.name
        for hf, t in list(self._tensors.items()) + ([("rope_freqs", rope_freqs)] if rope_freqs is not None else []):
            if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
                raise GGUFError(f"GGUF tensor {t.name!r} ({hf}) has type {t.tensor_type.name}, which is not supported "
                                f"(supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
        self.hf_config = self._build_config(rope_freqs)

    # ----------------------------------------------------------------- metadata
    def _meta(self, key: str, default=_MISSING):
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"GGUF {self.path.name} lacks metadata key {key!r}")
            return default
        return field.contents()

    def _arch_meta(self, key: str, default=_MISSING):
        return self._meta(f"{self.architecture}.{key}", default)

    def _build_config(self, rope_freqs) -> dict:
        arch = self.architecture
        if self._arch_meta("expert_count", 0):
            raise GGUFError(f"{self.path.name} is a mixture-of-experts model, which is not supported")
        if self._arch_meta("attention.sliding_window", None) is not None:
            raise GGUFError(f"{self.path.name} uses sliding-window attention, which is not supported for {arch}")
        hidden = int(self._arch_meta("embedding_length"))
        heads = int(self._arch_meta("attention.head_count"))
        kv = self._arch_meta("attention.head_count_kv", heads)
        if isinstance(kv, list):  # per-layer list in some files
            if len(set(kv)) != 1:
                raise GGUFError(f"{self.path.name} has a different number of KV heads per layer ({kv}); not supported")
            kv = kv[0]
        kv = int(kv)
        head_dim = int(self._arch_meta("attention.key_length", 0) or self._arch_meta("rope.dimension_count", 0)
                       or hidden // heads)
        value_dim = int(self._arch_meta("attention.value_length", head_dim))
        rope_dim = int(self._arch_meta("rope.dimension_count", head_dim))
        if value_dim != head_dim:
            raise GGUFError(f"{self.path.name}: key_length {head_dim} != value_length {value_dim}; not supported")
        if rope_dim != head_dim:
            raise GGUFError(f"{self.path.name}: partial rotary embedding (rope dims {rope_dim} of head_dim "
                            f"{head_dim}) is not supported")
        theta = _shortest_float(self._arch_meta("rope.freq_base", 10000.0))

        if "tokenizer.ggml.tokens" in self._reader.fields:
            tokens = self._reader.fields["tokenizer.ggml.tokens"]
            vocab = tokens.count if isinstance(tokens, Field) else len(tokens.data)  # GGUFIndex / GGUFReader
        elif self._arch_meta("vocab_size", None) is not None:
            vocab = int(self._arch_meta("vocab_size"))
        elif "model.embed_tokens.weight" in self._tensors:
            vocab = self.hf_shape("model.embed_tokens.weight")[0]
        else:
            raise GGUFError(f"{self.path.name}: cannot tell the vocabulary size (no token list, no token_embd)")

        scaling = self._rope_scaling(rope_freqs, head_dim, theta)
        names = set(self._tensors)
        bias = "model.layers.0.self_attn.q_proj.bias" in names
        o_bias = "model.layers.0.self_attn.o_proj.bias" in names
        if arch == "llama" and bias != o_bias:
            raise GGUFError(f"{self.path.name}: llama with q/k/v bias but no o_proj bias (or the reverse) "
                            "is not supported")
        cfg = ModelConfig(
            family=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._arch_meta("feed_forward_length")),
            num_layers=int(self._arch_meta("block_count")),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            max_position_embeddings=int(self._arch_meta("context_length", 4096)),
            rms_norm_eps=_shortest_float(self._arch_meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings="lm_head.weight" not in names,
            qkv_bias=True if arch == "qwen2" else bias,
            o_bias=bias if arch == "llama" else (arch == "qwen3" and bias),
            mlp_bias=arch == "llama" and "model.layers.0.mlp.gate_proj.bias" in names,
            qk_norm=arch == "qwen3",
        )
        hf = cfg.to_hf_config()
        hf["dtype"] = "float32"
        for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                              ("pad_token_id", "padding_token_id"), ("unk_token_id", "unknown_token_id")):
            value = self._meta(f"tokenizer.ggml.{gguf_key}", None)
            if value is not None:
                hf[key] = int(value)
        return hf

    def _rope_scaling(self, rope_freqs, head_dim: int, theta: float) -> RopeScaling:
        kind = self._arch_meta("rope.scaling.type", "none")
        if rope_freqs is not None:
            if kind not in ("none", ""):
                raise GGUFError(f"{self.path.name}: rope_freqs tensor together with rope.scaling.type {kind!r}")
            factors = np.asarray(self._dequantize(rope_freqs), np.float64).reshape(-1)
            return _llama3_rope_from_factors(factors, head_dim, theta, self.path.name)
        if kind in ("none", ""):
            return RopeScaling()
        if kind == "linear":
            return RopeScaling(kind="linear", factor=_shortest_float(self._arch_meta("rope.scaling.factor")))
        raise GGUFError(f"{self.path.name}: rope scaling type {kind!r} is not supported (none, linear, llama3)")

    # ----------------------------------------------------------------- tensors
    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def gguf_name(self, hf_name: str) -> str:
        return self._gguf_names[hf_name]

    def tensor_type(self, hf_name: str) -> str:
        return self._tensors[hf_name].tensor_type.name

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """HF shape without dequantising: ggml lists dimensions fastest-first, i.e. reversed."""
        return tuple(int(d) for d in reversed(self._tensors[hf_name].shape.tolist()))

    @staticmethod
    def _dequantize(t) -> np.ndarray:
        from gguf.quants import dequantize

        arr = dequantize(t.data, t.tensor_type)
        # F32 comes back as a view of the memory map: copy it so the result owns its memory.
        return np.array(arr, dtype=np.float32, copy=t.tensor_type.name == "F32")

    def get(self, hf_name: str) -> np.ndarray:
        if hf_name not in self._tensors:
            raise CheckpointError(f"GGUF {self.path.name} has no tensor {hf_name!r}")
        t = self._tensors[hf_name]
        arr = self._dequantize(t).reshape(self.hf_shape(hf_name))
        if self.architecture == "llama":
            if ".self_attn.q_proj." in hf_name:
                arr = _unpermute_rows(arr, self.hf_config["num_attention_heads"])
            elif ".self_attn.k_proj." in hf_name:
                arr = _unpermute_rows(arr, self.hf_config["num_key_value_heads"])
        return np.ascontiguousarray(arr, dtype=np.float32)

    def check_tensors(self) -> ModelConfig:
        """Validate names and shapes against the config (no dequantisation); return the config."""
        cfg = ModelConfig.from_hf_config(self.hf_config)
        expected = expected_hf_tensors(cfg)
        missing = [n for n in expected if n not in self._tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"checkpoint is missing tensor {missing[0]!r}{more} "
                                  f"(GGUF tensor {gguf_tensor_name(missing[0])!r} is not in {self.path.name})")
        extra = [n for n in self._tensors if n not in expected]
        if extra:
            raise CheckpointError(f"checkpoint has unexpected tensor {extra[0]!r} (GGUF {self.gguf_name(extra[0])!r}) "
                                  f"for config {cfg.family}")
        for name, shape in expected.items():
            if self.hf_shape(name) != tuple(shape):
                raise CheckpointError(f"tensor {name!r} (GGUF {self.gguf_name(name)!r}) has shape "
                                      f"{self.hf_shape(name)}, expected {tuple(shape)}")
        return cfg

    def token_ids(self) -> dict:
        out = {}
        for key in ("bos", "eos", "eot", "eom", "padding", "unknown"):
            v = self._meta(f"tokenizer.ggml.{key}_token_id", None)
            if v is not None:
                out[key] = int(v)
        return out


def _llama3_rope_from_factors(factors: np.ndarray, head_dim: int, theta: float, what: str) -> RopeScaling:
    """Recover llama3 `rope_scaling` from llama.cpp's `rope_freqs` tensor (one divisor per frequency).

    llama.cpp stores 1 for high frequencies, `factor` for low ones and 1 / ((1 - s) / factor + s) in
    between, with s = (orig_ctx / wavelen - low) / (high - low). Inverting the middle part gives s,
    which is linear in 1 / wavelen; the fitted line yields high and orig_ctx (low_freq_factor is
    taken as 1, as in every Llama 3.x). The candidate must reproduce every factor, else we refuse.
    """
    if factors.shape != (head_dim // 2,):
        raise GGUFError(f"{what}: rope_freqs has {factors.size} entries, expected {head_dim // 2}")
    if np.allclose(factors, 1.0):
        return RopeScaling()
    factor = float(factors.max())
    base = ModelConfig(head_dim=head_dim, rope_theta=theta).rope_inv_freq().astype(np.float64)
    candidates = []
    mid = (factors > 1 + 1e-6) & (factors < factor - 1e-6 * factor)
    if mid.sum() >= 2:
        s = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        inv_wavelen = base[mid] / (2 * math.pi)
        slope, intercept = np.polyfit(inv_wavelen, s, 1)
        if intercept < 0 and slope > 0:
            high = 1.0 - 1.0 / intercept
            orig = slope * (high - 1.0)
            candidates.append((1.0, round(high, 3), int(round(orig))))
    candidates.append((1.0, 4.0, 8192))  # Llama 3.1 / 3.2 / 3.3
    for low, high, orig in candidates:
        try:
            rs = RopeScaling(kind="llama3", factor=_shortest_float(factor), low_freq_factor=low,
                             high_freq_factor=high, original_max_position_embeddings=orig)
        except ValueError:
            continue
        scaled = ModelConfig(head_dim=head_dim, rope_theta=theta, rope_scaling=rs).rope_inv_freq()
        if np.allclose(base / scaled, factors, rtol=1e-4, atol=1e-5):
            return rs
    raise GGUFError(f"{what}: could not recover llama3 RoPE scaling parameters from the rope_freqs tensor")


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    return GGUFModel(path)


def _progress_bar(total: int, desc: str, enabled: bool, unit: str = "tensor"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled, leave=False,
                dynamic_ncols=True)


def read_gguf(path: str | os.PathLike, progress: bool = True
              ) -> tuple[dict, list[str], Callable[[str], np.ndarray]]:
    """(hf_config, HF tensor names, get) for a GGUF file; `get(name)` dequantises lazily to float32.

    The progress bar (stderr) advances with each `get` and closes once every tensor was fetched.
    """
    model = GGUFModel(path)
    names = model.names
    state = {"bar": None, "seen": set()}

    def get(name: str) -> np.ndarray:
        if state["bar"] is None and progress:
            state["bar"] = _progress_bar(len(names), f"dequantising {model.path.name}", True)
        arr = model.get(name)
        bar = state["bar"]
        if bar is not None and name not in state["seen"]:
            state["seen"].add(name)
            bar.update(1)
            if len(state["seen"]) == len(names):
                bar.close()
        return arr

    return dict(model.hf_config), names, get


def gguf_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer stored in a GGUF file (vocabulary, merges, special tokens, chat
    template), built without torch (`gguf_hf_tokenizer.py`)."""
    from .gguf_hf_tokenizer import build_tokenizer

    return build_tokenizer(Path(path).resolve())


# ---------------------------------------------------------------------------------- writing
def _write_safetensors(path: Path, entries: list[tuple[str, tuple]], get, bar) -> None:
    """Stream float32 tensors into one safetensors file, one dequantised tensor in memory at a time."""
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        nbytes = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in entries:
            arr = np.ascontiguousarray(get(name), dtype="<f4")
            if arr.shape != tuple(shape):
                raise CheckpointError(f"tensor {name!r} dequantised to shape {arr.shape}, expected {tuple(shape)}")
            f.write(memoryview(arr).cast("B"))
            bar.update(1)
        f.flush()
        os.fsync(f.fileno())


def convert_gguf_to_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Write `out_dir` = config.json + model.safetensors (float32) + tokenizer + generation_config.json.

    Everything is written into a temporary sibling directory that is renamed into place at the end,
    so an interrupted conversion never leaves a partial `out_dir`. Refuses to overwrite `out_dir`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists")
    model = GGUFModel(gguf_path)
    model.check_tensors()  # fail on a missing / misshaped tensor before writing anything
    try:
        tokenizer = gguf_tokenizer(gguf_path)
    except Exception as e:  # noqa: BLE001 - transformers raises assorted errors here
        raise GGUFError(f"could not build the tokenizer stored in {model.path.name}: {e}") from e

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        ids = model.token_ids()
        (tmp / "config.json").write_text(json.dumps(model.hf_config, indent=2) + "\n")
        gen = {}
        if "bos" in ids:
            gen["bos_token_id"] = ids["bos"]
        stops = [ids[k] for k in ("eos", "eot", "eom") if k in ids]
        stops = list(dict.fromkeys(stops))
        if stops:
            gen["eos_token_id"] = stops[0] if len(stops) == 1 else stops
        if "padding" in ids:
            gen["pad_token_id"] = ids["padding"]
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))

        entries = [(name, model.hf_shape(name)) for name in model.names]
        bar = _progress_bar(len(entries), f"converting {model.path.name}", progress)
        try:
            _write_safetensors(tmp / "model.safetensors", entries, model.get, bar)
        finally:
            bar.close()
        os.chmod(tmp, 0o755)  # mkdtemp creates it 0700
        if out_dir.is_dir():
            out_dir.rmdir()  # an empty placeholder (checked above)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
