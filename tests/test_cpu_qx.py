"""GGUF blocks multiplied by int8 rows of x (kernels/cpu_qx.py, `Engine(activations="int8")`): the
regrouped blocks hold exactly gguf's weights, the kernel computes the stated int8 arithmetic, each
row's result is its own bit for bit whatever rows share the call, and a model decoding through
the regrouped blocks stays lossless and close to the float32 model. The float32 products of the
same blocks are tested in test_gguf_blocks.py."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from eagle_jax.kernels import cpu_qx
from eagle_jax.models.checkpoint import load_hf_dir
from eagle_jax.models.decoder import forward, lm_logits, unstack_layers
from eagle_jax.models.gguf_loader import convert_gguf_to_hf_dir
from eagle_jax.models.quantized import (attach_gguf_blocks, drop_shadowed_kernels, regroup_for_int8,
                                       resolve_activations)
from decode_util import decode
from gguf_util import block_types, tiny_config, write_tiny_gguf

needs_qx = pytest.mark.skipif(not cpu_qx.available(), reason="the CPU kernel has no int8 rows of x here")
KINDS = {"q4_1x8": "Q4_1", "q8_0x8": "Q8_0"}


def _blocks(kind, n, k, seed=0):
    w = (0.05 * np.random.default_rng(seed).standard_normal((n, k))).astype(np.float32)
    w[3, :32] = 0  # an all-zero block
    qt = GGMLQuantizationType[KINDS[kind]]
    blocks = quants.quantize(w, qt)
    return blocks, quants.dequantize(blocks, qt).astype(np.float32)


@pytest.mark.parametrize("kind", list(KINDS))
def test_regrouped_blocks_hold_ggufs_weights(kind):
    blocks, want = _blocks(kind, 48, 96)
    groups = cpu_qx.regroup(blocks, kind)
    assert groups.shape == (3, 3 * cpu_qx.GROUP_BYTES[kind]) and groups.dtype == np.uint8
    np.testing.assert_array_equal(cpu_qx.dequantize(groups, kind), want)
    stacked = cpu_qx.regroup(np.stack([blocks, blocks[::-1]]), kind)  # stacked layers regroup alike
    np.testing.assert_array_equal(stacked[0], groups)
    np.testing.assert_array_equal(cpu_qx.dequantize(stacked[1], kind), want[::-1])
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_qx.regroup(blocks[:40], kind)


def test_rows_round_to_int8_per_block():
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    x[1, 32:] = 0
    q, sx, ms = cpu_qx.quantize_rows(x)
    assert q.dtype == np.int8 and np.abs(q).max() == 127 and sx[1, 1] == 0 and not q[1, 32:].any()
    back = q.reshape(2, 2, 32) * sx[..., None]
    assert np.abs(back.reshape(2, 64) - x).max() <= sx.max() / 2 + 1e-7  # half a step at most
    np.testing.assert_allclose(ms, sx * q.reshape(2, 2, 32).sum(-1), rtol=1e-6)


@needs_qx
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k,n", [(64, 32), (576, 960), (1536, 64)])
def test_kernel_computes_the_int8_products_each_row_its_own(kind, k, n):
    blocks, deq = _blocks(kind, n, k, seed=k + n)
    groups = jnp.asarray(cpu_qx.regroup(blocks, kind))
    x = np.random.default_rng(2).standard_normal((15, k)).astype(np.float32)
    x[4] = 0  # a row of zeros gives zeros
    y = np.asarray(cpu_qx.xmatmul(jnp.asarray(x), groups, kind))
    want = cpu_qx.reference_xmatmul(x, np.asarray(groups), kind)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-6 * np.abs(want).max())
    assert not y[4].any()
    exact = x @ deq.T  # int8 rows: near float32's product, not equal to it
    assert 1e-4 < np.abs(y - exact).max() / np.abs(exact).max() < 3e-2
    for t in (1, 5, 12):  # 1, 5 and 12 rows in one pass; 15 as two passes
        part = np.asarray(cpu_qx.xmatmul(jnp.asarray(x[-t:]), groups, kind))
        np.testing.assert_array_equal(part, y[-t:])


@needs_qx
@pytest.mark.parametrize("kind", list(KINDS))
def test_products_are_the_same_with_and_without_prefetches_and_on_every_split(kind):
    """The software-prefetch switch changes when lines are read, never the result; and however the
    columns are split among the threads (contiguous ranges, the rest taken from the others' backs),
    every column is computed once: wide products (many chunks) equal the reference and each other."""
    from eagle_jax.kernels import cpu_matmul as cm

    blocks, _ = _blocks(kind, 4096, 576, seed=7)
    groups = jnp.asarray(cpu_qx.regroup(blocks, kind))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 576)).astype(np.float32))
    want = cpu_qx.reference_xmatmul(np.asarray(x), np.asarray(groups), kind)
    lib, before = cm._state["lib"], cm._state["lib"].eagle_jax_prefetch()
    f = jax.jit(lambda x, g: cpu_qx.xmatmul(x, g, kind))
    try:
        outs = []
        for on in (1, 0, 1, 0):
            lib.eagle_jax_set_prefetch(on)
            outs.append(np.asarray(f(x, groups)))
    finally:
        lib.eagle_jax_set_prefetch(before)
    np.testing.assert_allclose(outs[0], want, rtol=0, atol=2e-6 * np.abs(want).max())
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


@needs_qx
@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_sums_extreme_blocks_exactly(kind):
    """Weights at the ends of their range (Q8_0: -128 and 127; Q4_1: 0 and 15) against rows of x at
    +-127 steps (|x| = 127 exactly: sx = 1): every product and sum is an integer that float32 holds,
    so the kernel must give x @ w exactly. Int16 pair sums that saturated (AVX2's vpmaddubsw) or a
    lost sign would show."""
    n, k = 32, 96
    rng = np.random.default_rng(7)
    d = np.float16(1.0).tobytes()
    if kind == "q8_0x8":
        q = rng.choice(np.int8([-128, 127]), size=(n, k // 32, 32)).astype(np.int8)
        q[0] = -128
        blocks = np.concatenate([np.frombuffer(d * (n * k // 32), np.uint8).reshape(n, k // 32, 2),
                                 q.view(np.uint8)], axis=-1).reshape(n, -1)
    else:
        u = rng.choice(np.uint8([0, 15]), size=(n, k // 32, 32)).astype(np.uint8)
        u[0] = 15
        head = np.frombuffer((d + np.float16(0.0).tobytes()) * (n * k // 32), np.uint8).reshape(n, k // 32, 4)
        blocks = np.concatenate([head, u[..., :16] | (u[..., 16:] << 4)], axis=-1).reshape(n, -1)
    w = quants.dequantize(blocks, GGMLQuantizationType[KINDS[kind]]).astype(np.float32)
    assert np.abs(w).max() == (128 if kind == "q8_0x8" else 15)
    x = rng.choice(np.float32([-127, 127]), size=(6, k))
    x[0] = -127  # with row 0 of w: every pair of products at its largest, 2 x 128 x 127 (Q8_0)
    x[1] = 127
    y = np.asarray(cpu_qx.xmatmul(jnp.asarray(x), jnp.asarray(cpu_qx.regroup(blocks, kind)), kind))
    np.testing.assert_array_equal(y, x.astype(np.float64) @ w.T.astype(np.float64))


_XMATMUL_SCRIPT = """
import sys, numpy as np, jax.numpy as jnp
from eagle_jax.kernels import cpu_matmul as cm, cpu_qx
a = np.load(sys.argv[1])
out = {k: np.asarray(cpu_qx.xmatmul(jnp.asarray(a["x"]), jnp.asarray(a[k]), k)) for k in cpu_qx.GROUP_BYTES}
np.savez(sys.argv[2], isa=cm.isa(), **out)
"""


def _xmatmul_in_build(tmp_path, isa: str, x, groups: dict) -> dict:
    """`xmatmul` of x by each kind's groups, in a fresh process whose kernels are built for `isa`."""
    np.savez(tmp_path / "in.npz", x=x, **groups)
    env = {**os.environ, "EAGLE_JAX_CPU_KERNEL_ISA": isa}
    res = subprocess.run([sys.executable, "-c", _XMATMUL_SCRIPT, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = dict(np.load(tmp_path / "out.npz"))
    assert str(out.pop("isa")) == isa
    return out


@needs_qx
@pytest.mark.skipif(cpu_qx.cm.isa() != "avx512", reason="needs the AVX512-VNNI kernels to compare the AVX2 ones with")
def test_avx2_int8_rows_equal_the_vnni_kernels_bit_for_bit(tmp_path):
    """The AVX2 build's int8 rows (vpmaddubsw / vpmaddwd) give the AVX512-VNNI build's results bit
    for bit: the same integer sums, scaled by the same float32 operations in the same order."""
    x = np.random.default_rng(11).standard_normal((13, 576)).astype(np.float32)
    groups = {kind: cpu_qx.regroup(_blocks(kind, 96, 576, seed=3)[0], kind) for kind in KINDS}
    avx2 = _xmatmul_in_build(tmp_path, "avx2", x, groups)
    for kind, g in groups.items():
        np.testing.assert_array_equal(avx2[kind], np.asarray(cpu_qx.xmatmul(jnp.asarray(x), jnp.asarray(g), kind)))


@needs_qx
def test_xmatmul_checks_its_operands():
    blocks, _ = _blocks("q4_1x8", 32, 64)
    groups = jnp.asarray(cpu_qx.regroup(blocks, "q4_1x8"))
    with pytest.raises(ValueError, match="do not fit"):
        cpu_qx.xmatmul(jnp.ones((1, 96)), groups, "q4_1x8")
    with pytest.raises(ValueError, match="kind"):
        cpu_qx.xmatmul(jnp.ones((1, 64)), groups, "q4_0x8")
    with pytest.raises(ValueError, match="activations"):
        resolve_activations("int4")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = tiny_config("llama", tied=True)
    types = block_types(cfg)
    d = tmp_path_factory.mktemp("qxgguf")
    write_tiny_gguf(d / "m.gguf", cfg, types, seed=3)
    convert_gguf_to_hf_dir(d / "m.gguf", d / "hf", progress=False)
    cfg, params = load_hf_dir(d / "hf")
    return d, dataclasses.replace(cfg, matmul_impl="cpu_kernel"), params


@needs_qx
def test_model_through_int8_rows_is_close_to_float32_and_lossless(tiny_gguf):
    from eagle_jax.draft import DraftConfig, TreeBudget, init_head
    from eagle_jax.draft import oracle_head

    d, kcfg, params = tiny_gguf
    blocks = attach_gguf_blocks(params, kcfg, d / "m.gguf")
    qx = regroup_for_int8(blocks)
    layer = qx["layers"]["self_attn"]
    assert set(layer["qkv_proj"]) == {"q4_1x8"}
    assert "q8_0" in qx["embed_tokens"] and kcfg.vocab_size % 16  # 261 outputs: left to the exact kernel
    assert "q4_1" not in layer["o_proj"] and "kernel" in layer["o_proj"]  # float32 weights kept (prefill)
    f32, i8 = unstack_layers(blocks), unstack_layers(qx)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, kcfg.vocab_size, (1, 6)), jnp.int32)
    logits = jax.jit(lambda p: lm_logits(p, kcfg, forward(p, kcfg, tokens).hidden))
    want, got = np.asarray(logits(f32)), np.asarray(logits(i8))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < 3e-2, err
    zeroed = jax.tree.map(lambda a: a, i8)  # the products read the groups
    down = zeroed["layers"][0]["mlp"]["down_proj"]
    down["q4_1x8"] = jnp.zeros_like(down["q4_1x8"])
    assert not np.allclose(np.asarray(logits(zeroed)), got, atol=1e-3)

    prompts = [[1, 5, 9, 2], [7, 3]]
    plain, lens = decode(i8, kcfg, prompts, 24)
    random_head = init_head(DraftConfig.for_target("eagle3", kcfg, draft_vocab_size=kcfg.vocab_size,
                                                   target_layers=(0, 1, 2)), jax.random.PRNGKey(5))
    for head in (random_head, oracle_head(kcfg, i8)):  # drafts mostly rejected; drafts all accepted
        for budget in (TreeBudget("dynamic", total_tokens=6, depth=3, top_k=3),
                       TreeBudget("dynamic", total_tokens=20, depth=4, top_k=5)):  # 40 rows: two passes
            spec, _ = decode(i8, kcfg, prompts, 24, head=head, budget=budget)
            for r, n in enumerate(lens):
                assert list(spec[r, n:n + 24]) == list(plain[r, n:n + 24])


@needs_qx
def test_float32_weights_dropped_under_int8_rows_are_never_read(tiny_gguf):
    """`drop_shadowed_kernels` (what an int8 Engine keeps): the float32 weights that the blocks
    replace go (the fused q/k/v, each node with its own blocks), the embedding and every node
    without blocks stay; the model computes the same bits without them once every product goes
    through the blocks, and a product that would still read them fails to trace."""
    from eagle_jax.kernels.cpu_matmul import ANY_ROWS

    d, kcfg, params = tiny_gguf
    qx = regroup_for_int8(attach_gguf_blocks(params, kcfg, d / "m.gguf"))
    slim = drop_shadowed_kernels(qx)
    n_layers = kcfg.num_layers
    for group, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                         ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            node = slim["layers"][group][name]
            assert node["kernel"].shape == (n_layers, 0), (group, name)
    bare = jax.tree.map(lambda a: a, qx)  # new dicts, same arrays
    del bare["layers"]["mlp"]["down_proj"]["q4_1x8"]  # a projection without blocks keeps its weights
    assert drop_shadowed_kernels(bare)["layers"]["mlp"]["down_proj"]["kernel"].shape == (n_layers, 512, 256)
    assert slim["embed_tokens"]["embedding"].shape == qx["embed_tokens"]["embedding"].shape
    cfg = dataclasses.replace(kcfg, kernel_rows=ANY_ROWS)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, kcfg.vocab_size, (2, 40)), jnp.int32)
    logits = lambda c: jax.jit(lambda p: lm_logits(p, c, forward(p, c, tokens).hidden))
    want = np.asarray(logits(cfg)(unstack_layers(qx)))
    assert np.array_equal(np.asarray(logits(cfg)(unstack_layers(slim))), want)
    assert 40 * 2 > kcfg.kernel_rows  # with the row limit, these products want the float32 weights
    with pytest.raises(Exception, match="kernel"):
        logits(kcfg)(unstack_layers(slim))


def test_decoding_programs_compile_alike_on_the_cpu():
    """The plain and speculative decoding programs are `cpu_stable_jit`s: on the CPU backend they
    compile with XLA's older fusion emitters, whose roundings do not depend on the program (see
    eagle_jax/cpu_jit.py; the real model's check: test_speculative_smollm2.py under int8 rows)."""
    from eagle_jax import cpu_jit, decoding, speculative

    for fn in (decoding.generate_tokens, decoding.decode_start, decoding.decode_advance,
               speculative.speculative_generate, speculative.spec_start, speculative.spec_advance):
        assert isinstance(fn, cpu_jit.cpu_stable_jit), fn
    f = cpu_jit.cpu_stable_jit(lambda x, n: x * 2.0 + n, static_argnames=("n",))
    assert np.asarray(f(jnp.ones(3), n=1)).tolist() == [3.0, 3.0, 3.0] and f.__name__ == "<lambda>"
    assert (f._cpu._cache_size(), f._plain._cache_size()) == ((1, 0) if jax.default_backend() == "cpu" else (0, 1))
    assert "multiply" in f.lower(jnp.ones(3), n=1).as_text()
    f.clear_cache()
    assert f._cache_size() == 0
