"""GGUF blocks multiplied by int8 rows of x, as llama.cpp's CPU path multiplies them (AVX512-VNNI, AVX2).

The exact kernels (`cpu_matmul.qmatmul` on "q4_1" / "q8_0" blocks) dequantise every weight to
float32 in registers and multiply in float32: one fused multiply-add a weight and row, so a 5-row
tree verification costs several times a 1-row step once the weights are in cache. llama.cpp
instead rounds each 32-value block of a row of x to int8 with its own scale (its Q8_1 rows) and
sums the 32 products of a block exactly in int32, four a lane and instruction (AVX512-VNNI's
vpdpbusd; on AVX2 vpmaddubsw and vpmaddwd, the same integers and so bit for bit the same results);
the target then computes with the same weights and slightly rounded activations.

`regroup(blocks, kind)` lays a matrix's GGUF rows out for that product, 16 output columns at a
time ("q4_1x8" / "q8_0x8", the kernels' layout in `cpu_matmul_avx512.h`), and `xmatmul` runs it.
`reference_xmatmul` is the same arithmetic in numpy (the tests' yardstick). Each row's result
depends on that row only and is summed in one fixed order, so one token's logits do not depend on
which tokens are verified with it: speculative decoding stays exactly as lossless as with the
float32 products, against a plain decoder that uses the same kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import cpu_matmul as cm

COLS = 16  # output columns a group (kQxCols)
QUADS = {"q4_1x8": 4, "q8_0x8": 8}  # 64-byte weight vectors a group's block; then 64 bytes of float16 d[16], m[16]
GROUP_BYTES = {k: 64 * q + 64 for k, q in QUADS.items()}


def available() -> bool:
    """True when the kernel is built with int8 rows of x (AVX512-VNNI or AVX2: `xmatmul` runs here)."""
    return cm.available() and cm._state.get("qx", False)


def regroup(blocks, kind: str) -> np.ndarray:
    """GGUF rows (uint8 [..., N, K/32 * 20 | 34], N % 16 == 0) → the kernel's groups, uint8
    [..., N/16, K/32 * GROUP_BYTES[kind]]: for each block b of 16 columns, QUADS vectors of 64 bytes
    (vector j, lane i: the 4 weights of column i met by bytes 4j .. 4j + 3 of x's block; Q4_1 packs
    vectors 2p and 2p + 1 as the low and high nibbles of 64 bytes), then d[16] and m[16] as float16,
    so that weight = d * u + m exactly as gguf dequantises the block (Q8_0: u = q + 128, m = -128 d,
    exact in float16).

    A lane's 4 bytes move as one uint32 word, written straight into their place in the output
    (3x as fast as moving bytes on SmolLM2's blocks: 0.2 s of each start before stop 68)."""
    gguf = cm.QX_KINDS[kind]
    size = cm.QUANT_BLOCK_BYTES[gguf]
    b = np.asarray(blocks, np.uint8)
    *lead, n, row_bytes = b.shape
    if n % COLS:
        raise ValueError(f"regroup: {n} output columns are not a multiple of {COLS}")
    g, nb, wb = n // COLS, row_bytes // size, GROUP_BYTES[kind] - 64
    b = b.reshape(*lead, g, COLS, nb, size)  # [..., g, i, b, bytes]: column i of group g
    out = np.empty((*lead, g, nb, GROUP_BYTES[kind]), np.uint8)
    w32 = out[..., :wb].reshape(*lead, g, nb, QUADS[kind], COLS, 4).view(np.uint32)[..., 0]  # [..., g, b, j, i]
    if gguf == "q4_1":
        # word w of a block's 16 bytes holds weights 4w .. 4w + 3 (low nibbles) and 16 + 4w .. (high);
        # vector j = 2p (low nibbles) + 2p + 1 (high) holds weights 8p + c and 8p + 4 + c
        words = np.ascontiguousarray(b[..., 4:20]).view(np.uint32)  # [..., g, i, b, 4]
        lo, hi = np.uint32(0x0F0F0F0F), np.uint32(0xF0F0F0F0)
        for p in range(4):
            a, e = words[..., 2 * (p % 2)], words[..., 2 * (p % 2) + 1]
            v = (a & lo) | ((e << 4) & hi) if p < 2 else ((a >> 4) & lo) | (e & hi)
            np.copyto(w32[..., p, :], np.moveaxis(v, -2, -1))
        m16 = b[..., 2:4]
    else:
        words = np.ascontiguousarray(b[..., 2:34]).view(np.uint32)  # [..., g, i, b, 8]
        np.bitwise_xor(words, np.uint32(0x80808080), out=words)  # q + 128 as a byte: the sign bit flipped
        np.copyto(w32, np.moveaxis(words, -3, -1))
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)
        m16 = (d.astype(np.float32) * np.float32(-128)).astype(np.float16).view(np.uint8)
    scales = out[..., wb:].view(np.uint16).reshape(*lead, g, nb, 2, COLS)  # d[16] then m[16]
    for k, s in enumerate((b[..., 0:2], m16)):
        np.copyto(scales[..., k, :], np.moveaxis(np.ascontiguousarray(s).view(np.uint16)[..., 0], -2, -1))
    return out.reshape(*lead, g, nb * GROUP_BYTES[kind])


def _split(groups: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A matrix's groups [N/16, K/32 * GROUP_BYTES] → (u float32 [N, K/32, 32], d, m float32 [N, K/32])."""
    gb = GROUP_BYTES[kind]
    a = np.asarray(groups, np.uint8)
    g, nb = a.shape[0], a.shape[1] // gb
    a = a.reshape(g, nb, gb)
    w, sc = a[..., : gb - 64], np.ascontiguousarray(a[..., gb - 64:]).view(np.float16)  # sc [g, nb, 32]
    if kind == "q4_1x8":
        w = w.reshape(g, nb, 4, COLS, 4)
        w = np.stack([w & 0x0F, w >> 4], axis=3).reshape(g, nb, 8, COLS, 4)
    else:
        w = w.reshape(g, nb, 8, COLS, 4)
    u = np.moveaxis(w, 3, 1).reshape(g * COLS, nb, 32).astype(np.float32)
    d = np.moveaxis(sc[..., :COLS], -1, 1).reshape(g * COLS, nb).astype(np.float32)
    m = np.moveaxis(sc[..., COLS:], -1, 1).reshape(g * COLS, nb).astype(np.float32)
    return u, d, m


def dequantize(groups: np.ndarray, kind: str) -> np.ndarray:
    """float32 weights [N, K] of a matrix's groups: d * u + m, as gguf dequantises the blocks."""
    u, d, m = _split(groups, kind)
    return (d[..., None] * u + m[..., None]).reshape(u.shape[0], -1)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's rounding of rows x [M, K] (K % 32 == 0) in numpy: (q int8 [M, K], sx [M, K/32],
    ms [M, K/32]) with sx = max |x| / 127 a block, q = x * (127 / max |x|) rounded to nearest even
    (0 for a zero block), ms = sx * sum(q)."""
    x = np.asarray(x, np.float32)
    mrows, k = x.shape
    xb = x.reshape(mrows, k // 32, 32)
    amax = np.abs(xb).max(axis=-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int32)
    sx = (amax / np.float32(127)).astype(np.float32)
    ms = (sx * q.sum(axis=-1).astype(np.float32)).astype(np.float32)
    return q.reshape(mrows, k).astype(np.int8), sx, ms


def reference_xmatmul(x: np.ndarray, groups: np.ndarray, kind: str) -> np.ndarray:
    """`xmatmul` in numpy (float64 sums of the same integers and scales; the kernel rounds each
    block's float32 multiply-adds, so the two agree to float32 rounding): y[t, n] = sum over blocks
    of d sx sum(u q) + m ms."""
    u, d, m = (a.astype(np.float64) for a in _split(groups, kind))
    q, sx, ms = quantize_rows(x)
    isum = np.einsum("nbk,tbk->tnb", u, q.reshape(len(q), -1, 32).astype(np.float64))  # exact integers
    y = isum * (d[None] * sx[:, None, :].astype(np.float64)) + m[None] * ms[:, None, :].astype(np.float64)
    return y.sum(-1).astype(np.float32)


def xmatmul(x: jax.Array, groups: jax.Array, kind: str) -> jax.Array:
    """x[..., K] @ w.T → [..., N] float32 with `groups = regroup(blocks, kind)` (uint8 [N/16, K/32 *
    GROUP_BYTES]): each 32-value block of a row of x rounded to int8 with its own scale, the
    products summed exactly in int32 and scaled per block in float32. Only through the custom call
    (check `available()`)."""
    if kind not in GROUP_BYTES:
        raise ValueError(f"xmatmul: kind must be one of {tuple(GROUP_BYTES)}, got {kind!r}")
    k = x.shape[-1]
    if groups.dtype != jnp.uint8 or groups.ndim != 2 or k % 32 or groups.shape[1] != k // 32 * GROUP_BYTES[kind]:
        raise ValueError(f"xmatmul: {kind} groups {tuple(groups.shape)} {groups.dtype} do not fit K={k}")
    if not available():
        raise RuntimeError("xmatmul needs the CPU matmul kernel with int8 rows of x (AVX512-VNNI or AVX2): "
                           + (cm.unavailable_reason() or "built without them"))
    return cm._rows_call(kind, x, groups.shape[0] * COLS, groups)
