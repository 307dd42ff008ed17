"""Few-row float32 matmuls on x86-64 CPUs: an AVX-512 or AVX2 XLA custom call, built on first use.

XLA:CPU's GEMM repacks the weight matrix on every call, so on a CPU a 4-token tree verification
costs far more than a 1-token decoding step although both read the same weights. `cpu_matmul.cc`
streams each weight matrix once for up to 8 rows at a time (see its header). This module compiles
it with the system's C++ compiler into a per-user cache (keyed by the source, the compiler flags
and jaxlib's version), registers it with `jax.ffi`, and exposes `matmul`. The block kernels come in
two instruction sets, chosen by the compiler's target (`-march=native`): AVX-512F/DQ
(`cpu_matmul_avx512.h`, 16-float vectors) or AVX2 with FMA and F16C (`cpu_matmul_avx2.h`, 8-float
vectors; AMD Zen 1-3, Intel Haswell to Comet Lake). `EAGLE_JAX_CPU_KERNEL_ISA=avx2` builds the AVX2
kernels on an AVX-512 CPU too (to test them there); `isa()` says which was built.

`available()` says whether the kernel can run here (x86-64 with AVX-512F/DQ or AVX2/FMA/F16C, a
C++ compiler, a successful build); `matmul` is only called by the decoder when the model config
asks for `matmul_impl="cpu_kernel"`, which `resolve_matmul_impl("auto")` picks on such a CPU. The
kernel has no gradient and no batching rule: it is an inference path (training keeps XLA's
matmuls).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from ..atomic_file import write_atomic

log = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(f) for f in ("cpu_matmul.cc", "cpu_attention.cc", "cpu_topk.cc"))
_HEADERS = tuple(Path(__file__).with_name(h) for h in ("cpu_matmul_avx512.h", "cpu_matmul_avx2.h", "cpu_simd_avx2.h",
                                                       "cpu_exp.h", "cpu_matmul_prefetch.h"))
ISAS = ("avx512", "avx2")
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
_TARGETS = {"kn": "eagle_jax_matmul_kn", "nk": "eagle_jax_matmul_nk", "q4_1": "eagle_jax_matmul_q4_1",
            "q8_0": "eagle_jax_matmul_q8_0", "f16": "eagle_jax_matmul_f16", "b16": "eagle_jax_matmul_b16",
            "i8": "eagle_jax_matmul_i8", "q4_1x8": "eagle_jax_matmul_q4_1x8", "q8_0x8": "eagle_jax_matmul_q8_0x8",
            "attention": "eagle_jax_attention", "top_k": "eagle_jax_top_k"}
_SYMBOLS = {"kn": "EagleMatmulKN", "nk": "EagleMatmulNK", "q4_1": "EagleMatmulQ41", "q8_0": "EagleMatmulQ80",
            "f16": "EagleMatmulF16", "b16": "EagleMatmulB16", "i8": "EagleMatmulI8", "q4_1x8": "EagleMatmulQX41",
            "q8_0x8": "EagleMatmulQX80", "attention": "EagleAttention", "top_k": "EagleTopK"}
QUANT_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # bytes per 32 weights (ggml block layouts)
MAX_ROWS = 16  # above this XLA's GEMM is as fast (measured on a 2-core Xeon: 16 rows break even)
ANY_ROWS = 1 << 62  # `matmul(..., max_rows=ANY_ROWS)`: the kernel whatever the row count (a fixed order of sums)
MATMUL_IMPLS = ("xla", "cpu_kernel")

_lock = threading.Lock()
KEEP_BUILDS = 4  # built libraries kept in the kernels' cache, most recently used first (_prune_builds)
_state: dict = {}


@functools.lru_cache(maxsize=1)
def cpu_fields() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("vendor_id", "cpu family", "model", "flags", ...);
    {} off Linux/x86-64. Read once a process: the instruction set, the core and the bench's machine
    record each ask (the file holds every CPU's block, hundreds of KB on a large host). Callers
    must not modify the dict."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_flags() -> set[str]:
    return set(cpu_fields().get("flags", "").split())


def _cpu_id() -> tuple[str, int, int] | None:
    """(vendor_id, cpu family, model) of the first CPU, or None where /proc/cpuinfo lacks them."""
    fields = cpu_fields()
    try:
        return fields["vendor_id"], int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return None


def cpu_core(cpu_id: tuple[str, int, int] | None = None) -> str | None:
    """The AMD core this CPU is built on ("zen3", "zen4", "zen5"), None for any other CPU: cores
    with one instruction set can want different trees (Zen 4 runs 512-bit vectors in two halves, Zen
    5 whole), so a packaged budget may be tuned for one core (`autotune.packaged_budget_path`).
    Family 25 (19h) is Zen 3 or Zen 4 by model; family 26 (1Ah) is Zen 5."""
    vendor, family, model = cpu_id or _cpu_id() or ("", 0, 0)
    if vendor != "AuthenticAMD":
        return None
    if family == 26:
        return "zen5"
    if family == 25:
        zen4 = (0x10, 0x1F), (0x60, 0x7F), (0xA0, 0xAF)
        return "zen4" if any(lo <= model <= hi for lo, hi in zen4) else "zen3"
    return None


def cpu_isa() -> str:
    """The kernels' instruction set for this CPU ("avx512" or "avx2"); raises when it has neither.
    `EAGLE_JAX_CPU_KERNEL_ISA=avx2` picks AVX2 on an AVX-512 CPU."""
    flags = _cpu_flags()
    has = {"avx512": {"avx512f", "avx512dq"} <= flags, "avx2": {"avx2", "fma", "f16c"} <= flags}
    want = os.environ.get("EAGLE_JAX_CPU_KERNEL_ISA", "").strip().lower()
    if want:
        if want not in ISAS:
            raise RuntimeError(f"EAGLE_JAX_CPU_KERNEL_ISA must be one of {ISAS}, got {want!r}")
        if not has[want]:
            raise RuntimeError(f"EAGLE_JAX_CPU_KERNEL_ISA={want}, but this CPU has no {want.upper()}")
        return want
    for isa in ISAS:
        if has[isa]:
            return isa
    raise RuntimeError("this CPU has neither AVX-512 (F, DQ) nor AVX2 with FMA and F16C")


def cpu_isa_or_none() -> str | None:
    """`cpu_isa()`, or None where it raises (no AVX-512 or AVX2, a wrong override)."""
    try:
        return cpu_isa()
    except RuntimeError:
        return None


def _cache_dir() -> Path:
    from ..models.registry import default_cache_dir

    return default_cache_dir() / "kernels"


def _library(isa: str) -> tuple[Path, list[str]]:
    """(where the library for `isa` is kept, named by a hash of what it is built from; the command
    that builds it, writing to a temporary file that `_build` then renames)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    flags = _FLAGS + (("-DEAGLE_JAX_FORCE_AVX2",) if isa == "avx2" else ())
    src = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    key = hashlib.sha256(src + " ".join(flags).encode() + cxx.encode() + jaxlib.__version__.encode()
                         + platform.node().encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_matmul_{isa}_{key}.so"
    return out, [cxx, *flags, "-I", jax.ffi.include_dir(), *map(str, _SOURCES), "-o"]


def _build(isa: str) -> Path:
    out, cmd = _library(isa)
    if out.exists():
        try:
            os.utime(out)  # its last use, for _prune_builds
        except OSError:  # a read-only cache
            pass
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd.append(str(tmp))
    log.info("building the CPU matmul kernel (%s): %s", isa, " ".join(cmd))
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"building {', '.join(p.name for p in _SOURCES)} failed:\n{res.stderr[-2000:]}")
    os.replace(tmp, out)
    _prune_builds(out.parent, out)
    return out


def _prune_builds(directory: Path, current: Path, keep: int = KEEP_BUILDS) -> list[Path]:
    """Delete from the kernels' cache all but the `keep` most recently used libraries (`current`,
    just built, stays), with their prefetch records, and the leftovers of builds a day old. Every
    source change builds a new library (0.5 MB) under a new name, and nothing else removes the old
    ones. A process that still wants a deleted one builds it again. Returns what was deleted."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:  # deleted meanwhile by another process
            return 0.0

    libs = sorted((p for p in directory.glob("cpu_matmul_*.so") if p != current), key=mtime, reverse=True)
    old = [p for lib in libs[max(keep - 1, 0):] for p in (lib, lib.with_suffix(".prefetch.json"))]
    old += [p for p in directory.glob("cpu_matmul_*.tmp") if time.time() - mtime(p) > 86400]
    gone = []
    for p in old:
        try:
            p.unlink()
            gone.append(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.debug("could not delete %s: %s", p, e)
    if gone:
        log.info("deleted %d old CPU kernel builds from %s", sum(p.suffix == ".so" for p in gone), directory)
    return gone


def _load() -> bool:
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            if os.environ.get("EAGLE_JAX_NO_CPU_KERNEL"):
                raise RuntimeError("disabled by EAGLE_JAX_NO_CPU_KERNEL")
            isa = cpu_isa()
            path = _build(isa)
            lib = ctypes.cdll.LoadLibrary(str(path))
            for kind, name in _TARGETS.items():
                jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, _SYMBOLS[kind])), platform="cpu")
            _state.update(ok=True, lib=lib, isa=isa, b16=bool(lib.eagle_jax_has_b16()), i8=bool(lib.eagle_jax_has_i8()),
                          qx=bool(lib.eagle_jax_has_qx()))
            _state["prefetch"] = _set_prefetch(lib, path.with_suffix(".prefetch.json"))
        except Exception as e:  # no compiler, no AVX-512/AVX2, a failed build: XLA's matmuls are used
            _state.update(ok=False, why=str(e))
            log.info("CPU matmul kernel unavailable: %s", e)
        return _state["ok"]


def _set_prefetch(lib, record: Path) -> bool:
    """Turn the quantized kernels' software prefetches on or off (cpu_matmul_prefetch.h): as
    EAGLE_JAX_CPU_PREFETCH says (1 or 0), else as measured on this machine once and kept in `record`
    beside the built library (about 0.1 s: 120 one-row products over 66 MB of blocks, in turns)."""
    env = os.environ.get("EAGLE_JAX_CPU_PREFETCH", "")
    if env in ("0", "1"):
        on = env == "1"
    else:
        try:
            on = bool(json.loads(record.read_text())["prefetch"])
        except (OSError, ValueError, KeyError, TypeError):
            on = _measure_prefetch(lib, record)
    lib.eagle_jax_set_prefetch(int(on))
    return on


def _measure_prefetch(lib, record: Path) -> bool:
    out = (ctypes.c_double * 2)()
    workers = max(1, min(os.cpu_count() or 1, 16))
    if lib.eagle_jax_time_prefetch(ctypes.c_int64(120), ctypes.c_int64(workers), ctypes.c_int64(4), out) != 0:
        return True  # no int8-row kernels in this build: the prefetches stay as they were tuned
    off_ms, on_ms = out[0], out[1]
    on = on_ms < off_ms
    log.info("CPU kernel prefetches %s: 120 products in %.2f ms with, %.2f ms without (%d threads)",
             "on" if on else "off", on_ms, off_ms, workers)
    try:
        write_atomic(record, json.dumps({"prefetch": on, "on_ms": on_ms, "off_ms": off_ms, "workers": workers}))
    except OSError:  # a read-only cache: measured again next time
        pass
    return on


def available() -> bool:
    """True when the kernel is built and registered (builds it on the first call)."""
    return _load()


def isa() -> str | None:
    """The instruction set the kernel was built for ("avx512" or "avx2"), None when unavailable."""
    return _state.get("isa") if _load() else None


def unavailable_reason() -> str:
    _load()
    return _state.get("why", "")


def resolve_matmul_impl(impl: str = "auto") -> str:
    """"auto" → "cpu_kernel" when JAX runs on the CPU and the kernel is available, else "xla"."""
    if impl == "auto":
        return "cpu_kernel" if jax.default_backend() == "cpu" and available() else "xla"
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS} or 'auto', got {impl!r}")
    if impl == "cpu_kernel" and not available():
        raise RuntimeError(f"matmul_impl='cpu_kernel' asked for, but the kernel is unavailable: "
                           f"{unavailable_reason()}")
    return impl


def matmul(x: jax.Array, w: jax.Array, layout: str = "kn", max_rows: int | None = None) -> jax.Array:
    """x[..., K] @ w ("kn": w is [K, N]; "nk": w is [N, K], i.e. x @ w.T) in float32 → [..., N].

    Uses the custom call for float32 operands with at most `max_rows` rows (default `MAX_ROWS`)
    when it is available, XLA's dot otherwise (any dtype, any row count: the two agree to float32
    rounding, not bit for bit)."""
    k = x.shape[-1]
    n = w.shape[1] if layout == "kn" else w.shape[0]
    if (w.shape[0] if layout == "kn" else w.shape[1]) != k:
        raise ValueError(f"matmul: x has K={k}, w {tuple(w.shape)} ({layout})")
    lead = x.shape[:-1]
    m = math.prod(lead)
    too_many = m > (max_rows or MAX_ROWS)
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or too_many or m == 0 or not available():
        spec = "...k,kn->...n" if layout == "kn" else "...k,nk->...n"
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return _rows_call(layout, x, n, w)


def _rows_call(target: str, x: jax.Array, n: int, *weights) -> jax.Array:
    """The custom call `target` on x[..., K] as float32 rows [M, K] → [..., n] float32."""
    lead = x.shape[:-1]
    m = math.prod(lead)
    call = jax.ffi.ffi_call(_TARGETS[target], jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(x.reshape(m, x.shape[-1]).astype(jnp.float32), *weights).reshape(*lead, n)


def hmatmul(x: jax.Array, w_nk: jax.Array) -> jax.Array:
    """x[..., K] @ w_nk.T in float32 → [..., N], with `w_nk` float16 [N, K] (K % 16 == 0) widened
    exactly inside the kernel: the float32 kernel's result on `w_nk.astype(float32)`, bit for bit,
    from half the bytes. Only through the custom call (check `available()`); at most `MAX_ROWS` rows."""
    k = x.shape[-1]
    if w_nk.dtype != jnp.float16 or w_nk.ndim != 2 or w_nk.shape[1] != k or k % 16:
        raise ValueError(f"hmatmul: float16 rows {tuple(w_nk.shape)} {w_nk.dtype} do not fit K={k} (K % 16 == 0)")
    if not available():
        raise RuntimeError(f"hmatmul needs the CPU matmul kernel, which is unavailable: {unavailable_reason()}")
    return _rows_call("f16", x, w_nk.shape[0], w_nk)


B16_TILE = 64  # output columns per packed bfloat16 tile (cpu_matmul.cc)
B16_MAX_K = 16384  # the longest rows of x the kernel rounds to bfloat16 (its per-thread buffer)


def b16_available() -> bool:
    """True when the kernel is available and was built with AVX512-BF16 (`bmatmul` runs here)."""
    return _load() and _state.get("b16", False)


def pack_b16(w_kn: np.ndarray) -> np.ndarray:
    """A Dense kernel [K, N] (K even) rounded to bfloat16 (to nearest even) and packed
    for `bmatmul`: uint32 [ceil(N/64), K/2, 64], word (tile, k2, j) = bf16(w[2k2, n]) | bf16(w[2k2+1, n]) << 16
    with n = 64 tile + j (zero columns past N)."""
    import ml_dtypes

    w = np.asarray(w_kn, np.float32)
    k, n = w.shape
    if k % 2:
        raise ValueError(f"pack_b16: kernel {w.shape} needs an even K")
    tiles = -(-n // B16_TILE)
    bf = w.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)  # rounded to nearest even
    bf = np.pad(bf, ((0, 0), (0, tiles * B16_TILE - n)))
    pairs = bf[0::2] | (bf[1::2] << 16)  # [K/2, N_pad]
    return np.ascontiguousarray(pairs.reshape(k // 2, tiles, B16_TILE).transpose(1, 0, 2))


def unpack_b16(packed: np.ndarray, n: int) -> np.ndarray:
    """The float32 kernel [K, N] whose bfloat16 values `packed` holds (`pack_b16`'s inverse on them)."""
    p = np.asarray(packed, np.uint32)
    tiles, k2, _ = p.shape
    pairs = p.transpose(1, 0, 2).reshape(k2, tiles * B16_TILE)[:, :n]
    out = np.empty((2 * k2, n), np.uint32)
    out[0::2], out[1::2] = pairs << 16, pairs & 0xFFFF0000
    return out.view(np.float32)


def bmatmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """x[..., K] @ w → [..., n] float32 with `packed = pack_b16(w)`: x rounded to bfloat16, products
    summed by AVX512-BF16 dot instructions (a draft head's approximation, not float32's result).
    Only through the custom call (check `b16_available()`); at most `MAX_ROWS` rows."""
    k = x.shape[-1]
    if packed.dtype != jnp.uint32 or packed.ndim != 3 or packed.shape[1:] != (k // 2, B16_TILE) \
            or packed.shape[0] != -(-n // B16_TILE) or k % 2 or k > B16_MAX_K:
        raise ValueError(f"bmatmul: packed tiles {tuple(packed.shape)} {packed.dtype} do not fit K={k}, N={n} "
                         f"(K even, at most {B16_MAX_K})")
    if not b16_available():
        raise RuntimeError("bmatmul needs the CPU matmul kernel built with AVX512-BF16: "
                           + (unavailable_reason() or "this CPU has no AVX512-BF16"))
    return _rows_call("b16", x, n, packed)


I8_TILE = 64  # output columns per packed int8 tile (cpu_matmul.cc)
I8_MAX_K = 16384  # the longest rows of x the kernel rounds to int8 (its per-thread buffer)


def i8_available() -> bool:
    """True when the kernel is available and was built with AVX512-VNNI (`imatmul` runs here)."""
    return _load() and _state.get("i8", False)


def pack_i8(w_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Dense kernel [K, N] (K % 16 == 0) quantised per output column for `imatmul`: (uint32 tiles
    [ceil(N/64), K/4, 64], float32 scales [N]). Column n: s = max |w[:, n]| / 127 (0 for a zero
    column), q = round(w / s) to nearest even, in [-127, 127], stored as the byte q + 128; word
    (tile, k4, j) holds the bytes of w[4 k4 .. 4 k4 + 3, n] (lowest first), n = 64 tile + j (the byte
    128, a zero weight, past N)."""
    w = np.asarray(w_kn, np.float32)
    k, n = w.shape
    if k % 16:
        raise ValueError(f"pack_i8: kernel {w.shape} needs K % 16 == 0")
    amax = np.abs(w).max(axis=0)
    scales = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(w * inv[None, :]), -127, 127).astype(np.int32)
    tiles = -(-n // I8_TILE)
    u = np.pad(q + 128, ((0, 0), (0, tiles * I8_TILE - n)), constant_values=128).astype(np.uint32)
    quads = u[0::4] | (u[1::4] << 8) | (u[2::4] << 16) | (u[3::4] << 24)  # [K/4, N_pad]
    return np.ascontiguousarray(quads.reshape(k // 4, tiles, I8_TILE).transpose(1, 0, 2)), scales


def unpack_i8(packed: np.ndarray, scales: np.ndarray, n: int) -> np.ndarray:
    """The float32 kernel [K, N] that `pack_i8`'s tiles and scales stand for: q * s per column."""
    p = np.asarray(packed, np.uint32)
    tiles, k4, _ = p.shape
    quads = p.transpose(1, 0, 2).reshape(k4, tiles * I8_TILE)[:, :n]
    q = np.stack([(quads >> s) & 0xFF for s in (0, 8, 16, 24)], axis=1).reshape(4 * k4, n).astype(np.int32) - 128
    return (q.astype(np.float32) * np.asarray(scales, np.float32)[None, :]).astype(np.float32)


def imatmul(x: jax.Array, packed: jax.Array, scales: jax.Array, n: int) -> jax.Array:
    """x[..., K] @ w → [..., n] float32 with `packed, scales = pack_i8(w)`: each row of x rounded to
    int8 with its own scale (max |x| / 127), the products summed exactly in int32 by AVX512-VNNI's
    vpdpbusd, then scaled (a draft head's approximation, not float32's result). Only through the
    custom call (check `i8_available()`); at most `MAX_ROWS` rows."""
    k = x.shape[-1]
    if packed.dtype != jnp.uint32 or packed.ndim != 3 or packed.shape[1:] != (k // 4, I8_TILE) \
            or packed.shape[0] != -(-n // I8_TILE) or k % 16 or k > I8_MAX_K or scales.shape != (n,):
        raise ValueError(f"imatmul: packed tiles {tuple(packed.shape)} {packed.dtype} and scales "
                         f"{tuple(scales.shape)} do not fit K={k}, N={n} (K % 16 == 0, at most {I8_MAX_K})")
    if not i8_available():
        raise RuntimeError("imatmul needs the CPU matmul kernel built with AVX512-VNNI: "
                           + (unavailable_reason() or "this CPU has no AVX512-VNNI"))
    return _rows_call("i8", x, n, packed, scales.astype(jnp.float32))


QX_KINDS = {"q4_1x8": "q4_1", "q8_0x8": "q8_0"}  # GGUF blocks regrouped for int8 rows of x (kernels/cpu_qx.py)


def quant_kind(variables) -> str | None:
    """The GGUF block entry a layer's params hold beside their float32 weight, if any: "q4_1" /
    "q8_0" (the file's blocks, exact float32 products) or "q4_1x8" / "q8_0x8" (regrouped for int8
    rows of x, `kernels.cpu_qx`)."""
    return next((k for k in (*QUANT_BLOCK_BYTES, *QX_KINDS) if k in variables), None)


def block_scales(blocks, kind: str):
    """float32 scales of GGUF rows (uint8 [N, K/32 * bytes]) → [N, K/32 * 2] (d, m: Q4_1) or
    [N, K/32] (d: Q8_0): the blocks' float16 fields, converted once (numpy in, numpy out; jax in,
    jax out)."""
    xp = np if isinstance(blocks, np.ndarray) else jnp
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, QUANT_BLOCK_BYTES[kind])
    width = 4 if kind == "q4_1" else 2
    head = xp.ascontiguousarray(b[:, :, :width]) if xp is np else b[:, :, :width]
    f16 = head.view(np.float16) if xp is np else jax.lax.bitcast_convert_type(
        head.reshape(n, -1, width // 2, 2), jnp.float16)
    return f16.astype(np.float32).reshape(n, -1)


def qmatmul(x: jax.Array, blocks: jax.Array, kind: str, scales: jax.Array | None = None) -> jax.Array:
    """x[..., K] @ dequantize(blocks).T in float32 → [..., N]; `blocks` are GGUF rows (uint8
    [N, K/32 * bytes], `kind` "q4_1" or "q8_0"), `scales` their `block_scales` (computed here when
    not given; pass them precomputed for speed). Only through the custom call (check
    `available()`); any number of rows, meant for few (the decoder uses float32 weights above
    `ModelConfig.kernel_rows`)."""
    if kind in QX_KINDS:
        from .cpu_qx import xmatmul

        return xmatmul(x, blocks, kind)
    if kind not in QUANT_BLOCK_BYTES:
        raise ValueError(f"qmatmul: kind must be one of {(*QUANT_BLOCK_BYTES, *QX_KINDS)}, got {kind!r}")
    k = x.shape[-1]
    n = blocks.shape[0]
    if blocks.dtype != jnp.uint8 or k % 32 or blocks.shape[1] != k // 32 * QUANT_BLOCK_BYTES[kind]:
        raise ValueError(f"qmatmul: {kind} rows {tuple(blocks.shape)} {blocks.dtype} do not fit K={k}")
    if scales is None:
        scales = block_scales(blocks, kind)
    if tuple(scales.shape) != (n, k // 32 * (2 if kind == "q4_1" else 1)):
        raise ValueError(f"qmatmul: scales {tuple(scales.shape)} do not fit {kind} rows {tuple(blocks.shape)}")
    if not available():
        raise RuntimeError(f"qmatmul needs the CPU matmul kernel, which is unavailable: {unavailable_reason()}")
    return _rows_call(kind, x, n, blocks, scales.astype(jnp.float32))
