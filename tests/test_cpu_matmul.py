"""The few-row matmul (kernels/cpu_matmul, AVX-512 or AVX2) and the few-query cache attention beside it
(kernels/cpu_attention): products equal float64 references to float32 rounding; each row's result
does not depend on the other rows of the call; the quantized products equal the float32 kernel on
the dequantised weights bit for bit; a draft head's compact rows keep decoding lossless. A GGUF
model through the kernel: test_gguf_blocks.py."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import cpu_matmul as cm
from eagle_jax.kernels import cpu_qx
from eagle_jax.models.checkpoint import load_hf_dir
from decode_util import decode
from gguf import GGMLQuantizationType, quants

pytestmark = pytest.mark.skipif(not cm.available(), reason=f"CPU matmul kernel unavailable: {cm.unavailable_reason()}")


def _jit(fn):
    return jax.jit(fn)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("k,n", [(40, 37), (256, 100), (1536, 20)])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 13, 16])
def test_f32_kernel_matches_float64(layout, k, n, m):
    rng = np.random.default_rng(k * 1000 + n + m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n) if layout == "kn" else (n, k)).astype(np.float32)
    got = np.asarray(_jit(lambda x, w: cm.matmul(x, w, layout))(x, w))
    ref = x.astype(np.float64) @ (w if layout == "kn" else w.T).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(ref).max())


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_each_row_is_independent_of_the_others(layout):
    """A verification pass (many rows) and a decode step (one row) give the same bits per row."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((11, 576)).astype(np.float32)
    w = rng.standard_normal((576, 300) if layout == "kn" else (300, 576)).astype(np.float32)
    f = _jit(lambda x, w: cm.matmul(x, w, layout))
    whole = np.asarray(f(x, w))
    for i in range(len(x)):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], w))[0], whole[i])
    np.testing.assert_array_equal(np.asarray(f(x[2:7], w)), whole[2:7])


def test_batched_leading_dims_and_fallback_above_max_rows():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    for shape in [(2, 3, 64), (1, cm.MAX_ROWS + 4, 64)]:  # 6 rows: kernel; 20 rows: XLA's dot
        x = rng.standard_normal(shape).astype(np.float32)
        got = np.asarray(_jit(lambda x, w: cm.matmul(x, w))(x, w))
        assert got.shape == shape[:-1] + (48,)
        np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="K=64"):
        cm.matmul(jnp.zeros((1, 64)), jnp.zeros((32, 8)))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 9, 10, 11, 12, 13, 16])  # one pass up to 12 (AVX-512), 10 (AVX2)
def test_quantized_equals_f32_kernel_on_dequantized_bit_for_bit(kind, m):
    rng = np.random.default_rng(m)
    n, k = 45, 256  # 45 rows: a chunk ends inside a 4-row group
    qt = GGMLQuantizationType[kind.upper()]
    blocks = quants.quantize((0.05 * rng.standard_normal((n, k))).astype(np.float32), qt)
    assert blocks.shape == (n, k // 32 * cm.QUANT_BLOCK_BYTES[kind])
    deq = quants.dequantize(blocks, qt).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = np.asarray(_jit(lambda x, b: cm.qmatmul(x, b, kind))(x, blocks))
    want = np.asarray(_jit(lambda x, w: cm.matmul(x, w, "nk"))(x, deq))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, x.astype(np.float64) @ deq.T.astype(np.float64), rtol=0, atol=1e-4)
    scales = cm.block_scales(blocks, kind)  # precomputed once at load (numpy), as the engine does
    pre = np.asarray(_jit(lambda x, b, s: cm.qmatmul(x, b, kind, s))(x, blocks, scales))
    np.testing.assert_array_equal(pre, got)


def test_quantized_rejects_mismatched_blocks():
    with pytest.raises(ValueError, match="q4_1 rows"):
        cm.qmatmul(jnp.zeros((1, 64)), jnp.zeros((8, 30), jnp.uint8), "q4_1")
    with pytest.raises(ValueError, match="scales"):
        cm.qmatmul(jnp.zeros((1, 64)), jnp.zeros((8, 40), jnp.uint8), "q4_1", jnp.zeros((8, 2)))
    with pytest.raises(ValueError, match="kind"):
        cm.qmatmul(jnp.zeros((1, 64)), jnp.zeros((8, 40), jnp.uint8), "q5_0")


@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 16])
def test_float16_rows_equal_f32_kernel_on_widened_weights_bit_for_bit(m):
    rng = np.random.default_rng(10 + m)
    n, k = 45, 1152  # 45 rows: a chunk ends inside a 4-row group
    w16 = (0.05 * rng.standard_normal((n, k))).astype(np.float16)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = np.asarray(_jit(cm.hmatmul)(x, w16))
    np.testing.assert_array_equal(got, np.asarray(_jit(lambda x, w: cm.matmul(x, w, "nk"))(x, w16.astype(np.float32))))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w16.T.astype(np.float64), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="float16 rows"):
        cm.hmatmul(jnp.zeros((1, 40)), jnp.zeros((8, 40), jnp.float16))  # K % 16 != 0
    with pytest.raises(ValueError, match="float16 rows"):
        cm.hmatmul(jnp.zeros((1, 64)), jnp.zeros((8, 64), jnp.float32))


needs_b16 = pytest.mark.skipif(not cm.b16_available(), reason="the CPU kernel has no AVX512-BF16 here")


def _bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


@needs_b16
@pytest.mark.parametrize("k,n", [(40, 80), (576, 192), (1536, 48), (2, 16), (64, 37)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 13, 16])
def test_b16_kernel_is_the_bfloat16_product(k, n, m):
    """x and w rounded to bfloat16 (to nearest even, as JAX's cast), then multiplied with float32
    sums: partial tiles (n % 64, n % 16), a K that is not a multiple of 32, more than 4 rows (passes of
    at most 4 over the tiles) and more than 8 (two groups)."""
    rng = np.random.default_rng(k * 100 + n + m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    packed = cm.pack_b16(w)
    assert packed.shape == (-(-n // cm.B16_TILE), k // 2, cm.B16_TILE) and packed.dtype == np.uint32
    np.testing.assert_array_equal(cm.unpack_b16(packed, n), _bf16(w))
    got = np.asarray(_jit(lambda x, p: cm.bmatmul(x, p, n))(x, jnp.asarray(packed)))
    ref = _bf16(x).astype(np.float64) @ _bf16(w).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.sqrt(k) * np.abs(ref).max())


def test_b16_packing_rounds_to_nearest_even_and_checks_shapes(monkeypatch):
    from eagle_jax.models.quantized import resolve_draft_rows

    one = np.float32(1.0).view(np.uint32)
    ties = np.array([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001], np.uint32).view(np.float32)
    w = np.zeros((2, 16), np.float32)
    w[0, :4], w[1, :4] = ties, -ties
    np.testing.assert_array_equal(cm.unpack_b16(cm.pack_b16(w), 16), _bf16(w))
    np.testing.assert_array_equal(cm.unpack_b16(cm.pack_b16(w), 16)[0, :4], [1.0, 1 + 2 ** -6, 1.0, 1 + 2 ** -7])
    with pytest.raises(ValueError, match="even K"):
        cm.pack_b16(np.zeros((3, 16), np.float32))
    long_k = cm.B16_MAX_K + 2
    with pytest.raises(ValueError, match="at most"):
        cm.bmatmul(jnp.zeros((1, long_k)), jnp.zeros((1, long_k // 2, cm.B16_TILE), jnp.uint32), 16)
    from eagle_jax.models.quantized import attach_b16_rows

    held = attach_b16_rows({"a": {"kernel": jnp.ones((long_k, 16))}, "b": {"kernel": jnp.ones((4, 16))}})
    assert "b16" not in held["a"] and "b16" in held["b"]  # rows too long for the kernel keep float32
    with pytest.raises(ValueError, match="do not fit"):
        cm.bmatmul(jnp.zeros((1, 4)), jnp.asarray(cm.pack_b16(np.zeros((4, 16), np.float32))), 80)
    assert resolve_draft_rows("auto") == ("q4_1x8" if cpu_qx.available() else "b16" if cm.b16_available() else "q8_0")
    monkeypatch.setitem(cm._state, "qx", False)  # AVX512-BF16 without int8 rows of x
    assert resolve_draft_rows("auto") == ("b16" if cm.b16_available() else "q8_0")
    monkeypatch.setitem(cm._state, "b16", False)  # nor AVX512-BF16
    assert resolve_draft_rows("auto") == "q8_0"
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        resolve_draft_rows("b16")
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        cm.bmatmul(jnp.zeros((1, 4)), jnp.asarray(cm.pack_b16(np.zeros((4, 16), np.float32))), 16)


needs_i8 = pytest.mark.skipif(not cm.i8_available(), reason="the CPU kernel has no AVX512-VNNI here")


def _i8_reference(x, packed, scales, n):
    """What the int8 kernel computes, in numpy: each row of x rounded to int8 by its own scale
    (max |x| / 127, to nearest even), the integer products summed exactly, then
    float32(sum) * sx * s[n] in float32."""
    p = np.asarray(packed)
    quads = p.transpose(1, 0, 2).reshape(p.shape[1], -1)[:, :n]
    q = np.stack([(quads >> s) & 0xFF for s in (0, 8, 16, 24)], axis=1).reshape(-1, n).astype(np.int64) - 128
    out = np.empty((x.shape[0], n), np.float32)
    for t, row in enumerate(np.asarray(x, np.float32)):
        m = np.abs(row).max()
        inv = np.float32(127) / m if m > 0 else np.float32(0)
        xq = np.clip(np.rint(row * inv), -127, 127).astype(np.int64)
        out[t] = (xq @ q).astype(np.float32) * (m / np.float32(127)) * np.asarray(scales, np.float32)
    return out


def _i8_step_bound(w, scales):
    """How far a column's int8 value may lie from w: half a step, plus float32 rounding of the
    scale, of its inverse and of w * inverse (a few ulps of 127 steps and of the column's max)."""
    return scales / 2 * (1 + 1e-4) + np.abs(w).max(axis=0) * 2.0 ** -22


@needs_i8
@pytest.mark.parametrize("k,n", [(48, 80), (576, 192), (1536, 48), (16, 16), (64, 37)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
def test_i8_kernel_is_the_int8_product(k, n, m):
    """Bit for bit the integer product of the rounded rows and weights, scaled: partial tiles
    (n % 64, n % 16), passes of at most 4 rows, a zero row of x and a zero column of w."""
    rng = np.random.default_rng(k * 100 + n + m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m // 2] = 0.0
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, n // 3] = 0.0
    packed, scales = cm.pack_i8(w)
    assert packed.shape == (-(-n // cm.I8_TILE), k // 4, cm.I8_TILE) and packed.dtype == np.uint32
    deq = cm.unpack_i8(packed, scales, n)
    assert np.all(np.abs(deq - w) <= _i8_step_bound(w, scales)) and not deq[:, n // 3].any()
    got = np.asarray(_jit(lambda x, p, s: cm.imatmul(x, p, s, n))(x, jnp.asarray(packed), jnp.asarray(scales)))
    np.testing.assert_array_equal(got, _i8_reference(x, packed, scales, n))
    assert not got[m // 2].any()
    ref = x.astype(np.float64) @ w.astype(np.float64)  # and it approximates the float32 product
    assert np.abs(got - ref).max() <= 0.05 * np.abs(ref).max()


def test_i8_packing_checks_shapes_and_availability(monkeypatch):
    from eagle_jax.models.quantized import attach_i8_rows, resolve_draft_rows

    w = np.zeros((16, 3), np.float32)
    w[:4, 0], w[:2, 1] = [127.0, -63.5, 0.5, 1.5], [-2.0, 2.0]  # ties round to even; a symmetric column
    packed, scales = cm.pack_i8(w)
    np.testing.assert_array_equal(scales, np.float32([127, 2, 0]) / np.float32(127))
    np.testing.assert_array_equal(cm.unpack_i8(packed, scales, 3)[:4, 0], [127.0, -64.0, 0.0, 2.0])
    np.testing.assert_array_equal(cm.unpack_i8(packed, scales, 3)[:2, 1], np.float32([-127, 127]) * scales[1])
    with pytest.raises(ValueError, match="K % 16"):
        cm.pack_i8(np.zeros((24, 16), np.float32))
    held = attach_i8_rows({"a": {"kernel": jnp.ones((24, 16))}, "b": {"kernel": jnp.ones((32, 16))}})
    assert "i8" not in held["a"] and "i8" in held["b"] and held["b"]["i8_scales"].shape == (16,)
    with pytest.raises(ValueError, match="do not fit"):
        cm.imatmul(jnp.zeros((1, 16)), jnp.asarray(packed), jnp.asarray(scales), 80)
    monkeypatch.setitem(cm._state, "i8", False)  # a CPU without AVX512-VNNI (nor AVX512-BF16)
    monkeypatch.setitem(cm._state, "b16", False)
    assert resolve_draft_rows("auto") == ("q4_1x8" if cpu_qx.available() else "q8_0")  # AVX2's int8 rows
    monkeypatch.setitem(cm._state, "qx", False)  # nor int8 rows of x
    assert resolve_draft_rows("auto") == "q8_0"
    with pytest.raises(RuntimeError, match="int8 rows of x"):
        resolve_draft_rows("q4_1x8")
    with pytest.raises(RuntimeError, match="AVX512-VNNI"):
        resolve_draft_rows("i8")
    with pytest.raises(RuntimeError, match="AVX512-VNNI"):
        cm.imatmul(jnp.zeros((1, 16)), jnp.asarray(packed), jnp.asarray(scales), 3)


needs_qx = pytest.mark.skipif(not cm.available() or not cm._state.get("qx"), reason="no int8 rows of x here")


@pytest.mark.parametrize("rows", ["f16", "q8_0", "q4_1", pytest.param("b16", marks=needs_b16),
                                  pytest.param("i8", marks=needs_i8), pytest.param("q8_0x8", marks=needs_qx),
                                  pytest.param("q4_1x8", marks=needs_qx)])
def test_draft_head_reads_its_compact_rows_and_stays_lossless(tiny_hf_dir, tmp_path, rows):
    """A draft head stored in float16 and loaded under the kernel keeps compact rows beside every
    Dense kernel: its float16 values exactly ("f16"), or Q8_0 / Q4_1 blocks / bfloat16 tiles whose
    values also replace the float32 kernel ("q8_0", "q4_1", "b16", and "q8_0x8" / "q4_1x8": Q8_0 / Q4_1
    blocks regrouped for int8 rows of x; every path computes with the same weights).
    Drafting reads them (zeroing them zeroes fc's output), the XLA path agrees (b16: to the
    rounding of x to bfloat16), and decoding stays lossless."""
    from gguf import GGMLQuantizationType

    from eagle_jax.draft import DraftConfig, TreeBudget, fuse_features, init_head, load_drafter, save_drafter
    from eagle_jax.models.quantized import attach_draft_rows

    cfg, params = load_hf_dir(tiny_hf_dir)
    kcfg = dataclasses.replace(cfg, matmul_impl="cpu_kernel")
    head = init_head(DraftConfig.for_target("eagle3", cfg, draft_vocab_size=cfg.vocab_size, target_layers=(0, 1, 2)),
                     jax.random.PRNGKey(5))
    save_drafter(tmp_path / "h16", head, cfg, dtype="float16")
    loaded = load_drafter(tmp_path / "h16", kcfg, rows=rows)
    stored = load_drafter(tmp_path / "h16", cfg)  # XLA: the checkpoint's values, no rows
    assert loaded.cfg.layer.matmul_impl == "cpu_kernel" and "f16" not in stored.params["fc"]
    assert rows in loaded.params["fc"]
    for path in (("fc",), ("lm_head",), ("midlayer", "mlp", "down_proj")):
        node, ref = loaded.params, stored.params
        for k in path:
            node, ref = node[k], ref[k]
        w = np.asarray(node["kernel"])
        if rows == "f16":
            assert node["f16"].dtype == jnp.float16
            np.testing.assert_array_equal(np.asarray(node["f16"]).T.astype(np.float32), w)
            np.testing.assert_array_equal(w, np.asarray(ref["kernel"]))
        elif rows == "b16":
            np.testing.assert_array_equal(cm.unpack_b16(np.asarray(node["b16"]), w.shape[1]), w)
            np.testing.assert_array_equal(w, _bf16(ref["kernel"]))
        elif rows in ("q8_0x8", "q4_1x8") and rows in node:  # (outputs not a multiple of 16 keep their blocks)
            from eagle_jax.kernels import cpu_qx

            np.testing.assert_array_equal(cpu_qx.dequantize(np.asarray(node[rows]), rows).T, w)
            step = 100 if rows == "q8_0x8" else 10  # half a step, as below
            np.testing.assert_allclose(w, np.asarray(ref["kernel"]), rtol=0, atol=np.abs(w).max() / step)
        elif rows == "i8":
            scales = np.asarray(node["i8_scales"])
            np.testing.assert_array_equal(cm.unpack_i8(np.asarray(node["i8"]), scales, w.shape[1]), w)
            assert np.all(np.abs(w - np.asarray(ref["kernel"])) <= _i8_step_bound(np.asarray(ref["kernel"]), scales))
        else:
            kind = rows[:4]
            deq = quants.dequantize(np.asarray(node[kind]), GGMLQuantizationType[kind.upper()]).astype(np.float32)
            np.testing.assert_array_equal(deq.T, w)  # the float32 kernel is the quantised head
            step = 100 if kind == "q8_0" else 10  # half a step: 1/254 (Q8_0), 1/30 (Q4_1) of a block's range
            np.testing.assert_allclose(w, np.asarray(ref["kernel"]), rtol=0, atol=np.abs(w).max() / step)
    if rows == "f16":  # float32 values that float16 cannot hold get no rows
        assert "f16" not in attach_draft_rows(jax.tree.map(lambda a: a, head.params), "f16")["fc"]
    with pytest.raises(ValueError, match="draft rows"):
        attach_draft_rows(head.params, "q4_0")
    feats = jnp.asarray(np.random.default_rng(3).standard_normal((1, 3, loaded.cfg.feature_size)), jnp.float32)
    fuse = jax.jit(fuse_features)
    xla_same = loaded.replace(cfg=loaded.cfg.replace(layer=loaded.cfg.layer.replace(matmul_impl="xla")))
    got, want = np.asarray(fuse(loaded, feats)), np.asarray(fuse(xla_same, feats))
    if rows == "b16":  # x rounded to bfloat16 (relative error <= 2^-9 per element) against float32 x
        w_fc = np.abs(np.asarray(loaded.params["fc"]["kernel"]))
        bound = 2 ** -9 * (np.abs(np.asarray(feats)).reshape(-1, w_fc.shape[0]) @ w_fc) + 1e-5
        assert np.all(np.abs(got - want).reshape(bound.shape) <= bound)
    elif rows in ("i8", "q8_0x8", "q4_1x8"):  # x rounded to int8 (a row, a block): at most half a step, max |x| / 254
        w_fc = np.abs(np.asarray(loaded.params["fc"]["kernel"]))
        x_rows = np.asarray(feats).reshape(-1, w_fc.shape[0])
        bound = np.abs(x_rows).max(axis=1, keepdims=True) / 254 * w_fc.sum(axis=0) * (1 + 1e-3) + 1e-5
        assert np.all(np.abs(got - want).reshape(bound.shape) <= bound)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    fc = loaded.params["fc"]
    zero = {key: jnp.zeros_like(fc[key]) for key in (rows, f"{rows}_scales") if key in fc}  # Q4_1: d * q + m
    zeroed = loaded.replace(params=dict(loaded.params, fc=dict(fc, **zero)))
    assert np.abs(np.asarray(fuse(zeroed, feats))).max() == 0  # the product read the rows

    prompts = [[1, 5, 9, 2], [7, 3]]
    plain, lens = decode(params, cfg, prompts, 24)
    spec, _ = decode(params, kcfg, prompts, 24, head=loaded, budget=TreeBudget("dynamic", total_tokens=6, depth=3,
                                                                                 top_k=3))
    for r, n in enumerate(lens):
        assert list(spec[r, n:n + 24]) == list(plain[r, n:n + 24])


# ------------------------------------------------------------------ attention over the stacked cache
@pytest.mark.parametrize("t", [1, 3, 8, 16])
@pytest.mark.parametrize("kvh,h,d", [(3, 9, 64), (2, 2, 40)])
@pytest.mark.parametrize("b", [1, 2])  # one row: a tree's queries are split over the threads
def test_cache_attention_matches_reference(t, kvh, h, d, b):
    from eagle_jax.kernels.cpu_attention import cache_attention
    from eagle_jax.models.layers import dense_attention

    rng = np.random.default_rng(t * 7 + kvh + 100 * b)
    l, s = 3, 100
    k = rng.standard_normal((l, b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((l, b, s, kvh, d)).astype(np.float32)
    q = (3 * rng.standard_normal((b, t, h, d))).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.4
    mask[b - 1, 0] = False  # a query that sees nothing gets zeros
    f = _jit(cache_attention)
    for layer in range(l):
        got = np.asarray(f(q, k, v, layer, mask))
        want = np.asarray(dense_attention(q, k[layer], v[layer], mask))
        np.testing.assert_allclose(got, want, rtol=0, atol=5e-6)
    assert not np.any(got[b - 1, 0])
    # slots no query sees may hold anything (a stale tree, another request's leftovers): NaN there
    # changes no bit of the result
    hidden = ~mask.any(axis=1)  # [B, S]
    k_nan, v_nan = k.copy(), v.copy()
    k_nan[:, hidden] = np.nan
    v_nan[:, hidden] = np.nan
    np.testing.assert_array_equal(np.asarray(f(q, k_nan, v_nan, l - 1, mask)), got)
    # each query depends on its own mask only: alone or among others, the same bits
    whole = np.asarray(f(q, k, v, 1, mask))
    for i in range(t):
        np.testing.assert_array_equal(np.asarray(f(q[:, i:i + 1], k, v, 1, mask[:, i:i + 1]))[:, 0], whole[:, i])
    # ... and on the keys it sees, not on their slots: a tree node's ancestors sit at scattered slots,
    # the same keys in a decoding step at consecutive ones
    for i in range(t):
        for r in range(b):
            seen = np.flatnonzero(mask[r, i])
            if not len(seen):
                continue
            kc, vc = k.copy(), v.copy()
            kc[:, r, :len(seen)], vc[:, r, :len(seen)] = k[:, r, seen], v[:, r, seen]
            mc = np.zeros_like(mask[:, i:i + 1])
            mc[r, 0, :len(seen)] = True
            packed = np.asarray(f(q[:, i:i + 1], kc, vc, 1, mc))[r, 0]
            np.testing.assert_array_equal(packed, whole[r, i], err_msg=f"query {i} of row {r}")


def test_cache_attention_rejects_mismatched_operands():
    from eagle_jax.kernels.cpu_attention import cache_attention

    k = jnp.zeros((2, 1, 16, 2, 8))
    with pytest.raises(ValueError, match="does not fit the cache"):
        cache_attention(jnp.zeros((1, 1, 3, 8)), k, k, 0, jnp.ones((1, 1, 16), bool))  # 3 heads on 2 KV heads
    with pytest.raises(ValueError, match="mask"):
        cache_attention(jnp.zeros((1, 2, 4, 8)), k, k, 0, jnp.ones((1, 2, 15), bool))


def test_instruction_set_follows_the_cpu_flags_and_the_override(monkeypatch):
    """AVX-512 where the CPU has it, else AVX2 (with FMA and F16C); EAGLE_JAX_CPU_KERNEL_ISA=avx2
    picks AVX2 on an AVX-512 CPU; a CPU with neither, or a wrong override, is a clear error (which
    leaves XLA's matmuls in use)."""
    avx2, avx512 = {"avx2", "fma", "f16c"}, {"avx2", "fma", "f16c", "avx512f", "avx512dq"}
    monkeypatch.delenv("EAGLE_JAX_CPU_KERNEL_ISA", raising=False)
    for flags, want in [(avx512, "avx512"), (avx2, "avx2")]:
        monkeypatch.setattr(cm, "_cpu_flags", lambda f=flags: f)
        assert cm.cpu_isa() == want
    monkeypatch.setattr(cm, "_cpu_flags", lambda: {"avx2", "fma"})  # no F16C
    with pytest.raises(RuntimeError, match="neither AVX-512"):
        cm.cpu_isa()
    monkeypatch.setattr(cm, "_cpu_flags", lambda: avx512)
    monkeypatch.setenv("EAGLE_JAX_CPU_KERNEL_ISA", "avx2")
    assert cm.cpu_isa() == "avx2"
    monkeypatch.setenv("EAGLE_JAX_CPU_KERNEL_ISA", "neon")
    with pytest.raises(RuntimeError, match="must be one of"):
        cm.cpu_isa()
    monkeypatch.setattr(cm, "_cpu_flags", lambda: avx2)
    monkeypatch.setenv("EAGLE_JAX_CPU_KERNEL_ISA", "avx512")
    with pytest.raises(RuntimeError, match="no AVX512"):
        cm.cpu_isa()
    assert cm.isa() in cm.ISAS  # what the other tests here ran on


@needs_qx  # (the measurement times the int8-row kernels; without them nothing is measured or kept)
def test_prefetch_switch_is_measured_once_kept_and_overridable(tmp_path, monkeypatch):
    """The quantized kernels' software prefetches (cpu_matmul_prefetch.h): measured on the machine the
    first time (both timings kept beside the library), read back after, re-measured when the record
    is unreadable; EAGLE_JAX_CPU_PREFETCH=0/1 decides without measuring. Leaves the switch as it was."""
    lib, record = cm._state["lib"], tmp_path / "lib.prefetch.json"
    before = lib.eagle_jax_prefetch()
    calls = []
    measure = cm._measure_prefetch
    monkeypatch.setattr(cm, "_measure_prefetch", lambda *a: calls.append(1) or measure(*a))
    monkeypatch.delenv("EAGLE_JAX_CPU_PREFETCH", raising=False)
    try:
        first = cm._set_prefetch(lib, record)
        saved = json.loads(record.read_text())
        assert saved["prefetch"] == first == (saved["on_ms"] < saved["off_ms"]) and saved["off_ms"] > 0
        assert lib.eagle_jax_prefetch() == int(first)
        assert cm._set_prefetch(lib, record) == first and len(calls) == 1  # read back, not measured
        record.write_text(json.dumps({"prefetch": not first}))
        assert cm._set_prefetch(lib, record) == (not first) and lib.eagle_jax_prefetch() == int(not first)
        record.write_text("{")
        cm._set_prefetch(lib, record)
        assert len(calls) == 2 and "prefetch" in json.loads(record.read_text())
        for env, want in (("0", 0), ("1", 1)):
            monkeypatch.setenv("EAGLE_JAX_CPU_PREFETCH", env)
            assert cm._set_prefetch(lib, record) == bool(want) and lib.eagle_jax_prefetch() == want
        assert len(calls) == 2
    finally:
        lib.eagle_jax_set_prefetch(before)


def test_old_kernel_builds_are_pruned_most_recently_used_kept(tmp_path):
    """A new build deletes all but the KEEP_BUILDS most recently used libraries (the new one always
    stays) with their prefetch records, and build leftovers a day old; nothing else is touched."""
    now = time.time()

    def lib(name, age_s, record=True):
        p = tmp_path / f"cpu_matmul_avx2_{name}.so"
        p.write_bytes(b"so")
        if record:
            p.with_suffix(".prefetch.json").write_text("{}")
        os.utime(p, (now - age_s, now - age_s))
        return p

    current = lib("new", 3600)  # just renamed into place: its mtime is the build's, any age
    libs = [lib(f"k{i}", 60 * (i + 1), record=i % 2 == 0) for i in range(6)]  # k0 most recent
    stale_tmp, fresh_tmp = tmp_path / "cpu_matmul_avx2_x.123.tmp", tmp_path / "cpu_matmul_avx2_y.456.tmp"
    for p, age in ((stale_tmp, 2 * 86400), (fresh_tmp, 60)):
        p.write_bytes(b"")
        os.utime(p, (now - age, now - age))
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    gone = cm._prune_builds(tmp_path, current, keep=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    kept = [current, *libs[:2]]
    assert left == sorted([p.name for p in kept] + [p.with_suffix(".prefetch.json").name for p in kept
                                                     if p.with_suffix(".prefetch.json").exists()]
                          + [fresh_tmp.name, other.name])
    assert all(not p.exists() for p in libs[2:]) and not stale_tmp.exists()
    assert sum(p.suffix == ".so" for p in gone) == 4


def test_using_a_kernel_build_marks_it_recently_used(tmp_path, monkeypatch):
    """`_build` finds its library built already: it dates it now (so pruning keeps the libraries in
    use), builds nothing and prunes nothing."""
    monkeypatch.setattr(cm, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cm.subprocess, "run", lambda *a, **k: pytest.fail("built again"))
    try:
        path, _ = cm._library("avx2")  # its name only: any instruction set, no CPU needed
    except RuntimeError as e:  # no C++ compiler: no library names either
        pytest.skip(str(e))
    others = [tmp_path / f"cpu_matmul_avx2_old{i}.so" for i in range(cm.KEEP_BUILDS + 2)]
    for p in (path, *others):
        p.write_bytes(b"so")
        os.utime(p, (time.time() - 86400,) * 2)
    assert cm._build("avx2") == path
    assert time.time() - path.stat().st_mtime < 60
    assert all(p.exists() for p in others)


@pytest.mark.skipif(cm.isa() != "avx512", reason="the kernels built here are the AVX2 ones already")
def test_avx2_kernels_pass_the_same_checks_on_an_avx512_cpu():
    """The AVX2 build (EAGLE_JAX_CPU_KERNEL_ISA=avx2), run where AVX-512 is the default: exact
    products, row independence, quantized == float32 bit for bit, attention, top-k, lossless decoding."""
    env = {**os.environ, "EAGLE_JAX_CPU_KERNEL_ISA": "avx2"}
    here = Path(__file__).parent
    which = subprocess.run([sys.executable, "-c", "from eagle_jax.kernels import cpu_matmul as cm; print(cm.isa())"],
                           env=env, capture_output=True, text=True, cwd=here)
    assert which.stdout.strip() == "avx2", which.stdout + which.stderr[-2000:]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", Path(__file__).name,
                          "test_gguf_blocks.py", "test_cpu_topk.py", "-k",
                          "matches_float64 or independent or bit_for_bit or attention_matches or lossless or top_k"],
                         env=env, capture_output=True, text=True, cwd=here)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout


def test_engine_without_its_gguf_falls_back_to_float32_and_says_so(tiny_hf_dir, monkeypatch, capsys):
    from eagle_jax.engine import Engine
    from eagle_jax.models import registry

    def gone(spec, cache_dir=None):
        raise FileNotFoundError("the wheel cannot be downloaded")

    monkeypatch.setattr(registry, "model_gguf", gone)
    engine = Engine(str(tiny_hf_dir), progress=False, compile_cache=False)
    assert engine.cfg.matmul_impl == "cpu_kernel" and not engine.quantized
    assert "not using GGUF blocks" in capsys.readouterr().err
    assert Engine(str(tiny_hf_dir), progress=False, compile_cache=False, matmul="xla").cfg.matmul_impl == "xla"


def test_engine_rejects_unknown_draft_rows(tiny_hf_dir):
    from eagle_jax.engine import Engine

    with pytest.raises(ValueError, match="draft_rows"):
        Engine(str(tiny_hf_dir), progress=False, compile_cache=False, draft_rows="q4_0")
