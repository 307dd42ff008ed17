"""A GGUF model's Q4_1 / Q8_0 blocks attached beside its float32 weights (models/quantized) and read
by the CPU kernel: every linear gets its blocks (q / k / v and gate / up concatenated, bit for bit
the separate calls' results), blocks from another file are refused by name, a model decoding
through them agrees with XLA's float32 matmuls and stays lossless (speculative greedy == plain
greedy), and a long verification block gives each token the one-token step's logits bit for bit.
The kernel's own products are tested in test_cpu_matmul.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import cpu_matmul as cm
from eagle_jax.models.checkpoint import load_hf_dir
from eagle_jax.models.decoder import forward, lm_logits, unstack_layers
from eagle_jax.models.gguf_loader import convert_gguf_to_hf_dir
from eagle_jax.models.quantized import QuantizedLayoutError, attach_gguf_blocks
from gguf import GGMLQuantizationType
from decode_util import decode
from gguf_util import LINEARS, block_types, tiny_config, write_tiny_gguf

pytestmark = pytest.mark.skipif(not cm.available(), reason=f"CPU matmul kernel unavailable: {cm.unavailable_reason()}")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    cfg = tiny_config("llama", tied=True)
    types = block_types(cfg)
    d = tmp_path_factory.mktemp("qgguf")
    write_tiny_gguf(d / "m.gguf", cfg, types, seed=3)
    write_tiny_gguf(d / "other.gguf", cfg, types, seed=4)
    convert_gguf_to_hf_dir(d / "m.gguf", d / "hf", progress=False)
    cfg, params = load_hf_dir(d / "hf")
    return d, cfg, params


FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def test_blocks_attach_beside_every_linear_and_the_embedding(tiny_gguf):
    """Every linear's blocks are attached: o / down beside their kernels, q / k / v and gate / up
    concatenated along the outputs into one node each (one kernel call), in the same order."""
    from gguf.quants import dequantize

    d, cfg, params = tiny_gguf
    qp = attach_gguf_blocks(params, cfg, d / "m.gguf")
    fused_names = {f"{g.split('.')[0]}.{n}" for g, ns in FUSED.items() for n in ns}
    for n in LINEARS:
        group, name = n.split(".")
        kernel = params["layers"][group][name]["kernel"]  # [L, K, N]
        if n in fused_names:
            assert "q4_1" not in qp["layers"][group][name] and "kernel" in qp["layers"][group][name]
            continue
        blk = qp["layers"][group][name]["q4_1"]
        assert blk.dtype == jnp.uint8 and blk.shape == (cfg.num_layers, kernel.shape[2], kernel.shape[1] // 32 * 20)
        scales = qp["layers"][group][name]["q4_1_scales"]
        assert scales.shape == (cfg.num_layers, kernel.shape[2], kernel.shape[1] // 16)
    for f, names in FUSED.items():
        group, node = f.split(".")
        blk, scales = qp["layers"][group][node]["q4_1"], qp["layers"][group][node]["q4_1_scales"]
        kernels = [np.asarray(params["layers"][group][n]["kernel"]) for n in names]  # [L, K, N_i]
        k, n_all = kernels[0].shape[1], sum(w.shape[2] for w in kernels)
        assert blk.shape == (cfg.num_layers, n_all, k // 32 * 20) and scales.shape == (cfg.num_layers, n_all, k // 16)
        for i in range(cfg.num_layers):  # the blocks are the projections' weights, in order
            got = dequantize(np.asarray(blk[i]), GGMLQuantizationType.Q4_1)
            np.testing.assert_array_equal(got, np.concatenate([w[i].T for w in kernels]))
            np.testing.assert_array_equal(np.asarray(scales[i]), cm.block_scales(np.asarray(blk[i]), "q4_1"))
    assert qp["embed_tokens"]["q8_0"].shape == (cfg.vocab_size, cfg.hidden_size // 32 * 34)
    assert "q4_1" not in params["layers"]["mlp"]["up_proj"]  # the input is left alone


@pytest.mark.parametrize("check", ["all", "rows", "first"])
def test_blocks_from_another_file_are_rejected_by_name(tiny_gguf, check):
    d, cfg, params = tiny_gguf
    with pytest.raises(QuantizedLayoutError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight"):
        attach_gguf_blocks(params, cfg, d / "other.gguf", check=check)


def test_row_check_finds_a_misplaced_tensor_and_permuted_rows(tiny_gguf, monkeypatch):
    """check="rows" (the Engine's: `CHECK_ROWS` rows of every tensor, not all of them) still finds one
    layer's weights that are not its blocks' (a deeper layer, which "first" does not look at) and q
    rows left in llama.cpp's rotary interleaving (every row of a head moves but its first and last)."""
    from eagle_jax.models import quantized
    from eagle_jax.models.gguf_loader import _unpermute_rows

    d, cfg, params = tiny_gguf
    dequantized, dequantize = [], quantized._dequantize_rows
    monkeypatch.setattr(quantized, "_dequantize_rows", lambda kind, rows: dequantized.append(len(rows)) or
                        dequantize(kind, rows))
    attach_gguf_blocks(params, cfg, d / "m.gguf", check="rows")  # the right weights pass
    assert len(dequantized) == 7 * cfg.num_layers + 1 and max(dequantized) == quantized.CHECK_ROWS
    last = cfg.num_layers - 1

    def with_kernel(group, name, layer, fn):
        k = np.array(params["layers"][group][name]["kernel"])  # [L, K, N]
        k[layer] = fn(k[layer])
        node = dict(params["layers"][group][name], kernel=jnp.asarray(k))
        return {**params, "layers": {**params["layers"], group: {**params["layers"][group], name: node}}}

    first_down = np.asarray(params["layers"]["mlp"]["down_proj"]["kernel"][0])
    swapped = with_kernel("mlp", "down_proj", last, lambda w: first_down)
    attach_gguf_blocks(swapped, cfg, d / "m.gguf", check="first")  # layer 0 only: passes
    with pytest.raises(QuantizedLayoutError, match=rf"model\.layers\.{last}\.mlp\.down_proj\.weight"):
        attach_gguf_blocks(swapped, cfg, d / "m.gguf", check="rows")
    interleaved = with_kernel("self_attn", "q_proj", last, lambda w: _unpermute_rows(w.T, cfg.num_heads).T)
    with pytest.raises(QuantizedLayoutError, match=rf"model\.layers\.{last}\.self_attn\.q_proj\.weight"):
        attach_gguf_blocks(interleaved, cfg, d / "m.gguf", check="rows")
    with pytest.raises(ValueError, match="check must be"):
        attach_gguf_blocks(params, cfg, d / "m.gguf", check="some")


def test_model_through_blocks_matches_xla_and_stays_lossless(tiny_gguf):
    from eagle_jax.draft import DraftConfig, TreeBudget, init_head

    d, cfg, params = tiny_gguf
    kcfg = dataclasses.replace(cfg, matmul_impl="cpu_kernel")
    qparams = unstack_layers(attach_gguf_blocks(params, kcfg, d / "m.gguf"))
    xparams = unstack_layers(params)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 6)), jnp.int32)

    def logits(c, p):
        return lm_logits(p, c, forward(p, c, tokens).hidden)

    want = np.asarray(jax.jit(logits, static_argnums=0)(cfg, xparams))
    got = np.asarray(jax.jit(logits, static_argnums=0)(kcfg, qparams))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    for group, node, lo, hi in (("mlp", "gate_up_proj", cfg.intermediate_size, None),  # up's rows
                                ("mlp", "down_proj", 0, None),
                                ("self_attn", "qkv_proj", cfg.num_heads * cfg.head_dim, None)):  # k's and v's
        broken = jax.tree.map(lambda a: a, qparams)  # the products really read the blocks, each node its own
        sub = broken["layers"][0][group]
        blk = sub[node]["q4_1"]
        broken["layers"][0][group] = dict(sub, **{node: dict(sub[node], q4_1=blk.at[lo:hi].set(0))})
        assert not np.allclose(np.asarray(jax.jit(logits, static_argnums=0)(kcfg, broken)), got, atol=1e-3), node

    prompts = [[1, 5, 9, 2], [7, 3]]
    plain_x, lens = decode(xparams, cfg, prompts, 24)
    plain_k, _ = decode(qparams, kcfg, prompts, 24)
    head = init_head(DraftConfig.for_target("eagle3", kcfg, draft_vocab_size=cfg.vocab_size, target_layers=(0, 1, 2)),
                     jax.random.PRNGKey(5))
    for budget in (TreeBudget("dynamic", total_tokens=6, depth=3, top_k=3),  # 2 rows x 6 tokens: 12 rows
                   TreeBudget("dynamic", total_tokens=20, depth=4, top_k=5)):  # 40 rows: ModelConfig.for_rows
        spec_k, _ = decode(qparams, kcfg, prompts, 24, head=head, budget=budget)
        for r, n in enumerate(lens):
            assert list(spec_k[r, n:n + 24]) == list(plain_k[r, n:n + 24])  # lossless under the kernel
        assert list(plain_k[r, n:n + 24]) == list(plain_x[r, n:n + 24])  # and the same text as XLA's f32


def test_fused_projections_equal_the_separate_ones_bit_for_bit(tiny_gguf):
    """q / k / v (and gate / up) through their concatenated blocks in one call give exactly what
    each projection's own blocks give in calls of their own (the layout before stop 52), biases
    included (Qwen2's q / k / v, Llama's mlp_bias)."""
    d, cfg, params = tiny_gguf
    kcfg = dataclasses.replace(cfg, matmul_impl="cpu_kernel")
    fused = unstack_layers(attach_gguf_blocks(params, kcfg, d / "m.gguf"))

    def split(group):  # each projection's rows of the fused node back beside its kernel
        out = dict(group)
        for f, names in FUSED.items():
            node = out.pop(f.split(".")[1], None)
            offsets = np.cumsum([0] + [group[n]["kernel"].shape[1] for n in names]) if node is not None else ()
            for n, lo, hi in zip(names, offsets[:-1], offsets[1:]):
                out[n] = dict(group[n], q4_1=node["q4_1"][lo:hi], q4_1_scales=node["q4_1_scales"][lo:hi])
        return out

    separate = dict(fused, layers=[{g: split(v) if g in ("self_attn", "mlp") else v for g, v in layer.items()}
                                   for layer in fused["layers"]])
    assert "qkv_proj" in fused["layers"][0]["self_attn"] and "qkv_proj" not in separate["layers"][0]["self_attn"]
    assert "q4_1" in separate["layers"][0]["self_attn"]["k_proj"]
    assert "q4_1" in separate["layers"][0]["mlp"]["up_proj"]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    rng = np.random.default_rng(2)
    biased = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
    biases = [{n: jnp.asarray(rng.standard_normal(layer[g][n]["kernel"].shape[1]), jnp.float32)
               for g, names in biased for n in names} for layer in fused["layers"]]

    def with_biases(p):
        return dict(p, layers=[dict(layer, **{g: dict(layer[g], **{n: dict(layer[g][n], bias=b[n]) for n in names})
                                              for g, names in biased}) for layer, b in zip(p["layers"], biases)])

    logits = lambda c, p: jax.jit(lambda p: lm_logits(p, c, forward(p, c, tokens).hidden))(p)
    for bias in (False, True):
        c = dataclasses.replace(kcfg, qkv_bias=bias, mlp_bias=bias)
        f, s = (with_biases(fused), with_biases(separate)) if bias else (fused, separate)
        got = np.asarray(logits(c, f))
        np.testing.assert_array_equal(got, np.asarray(logits(c, s)))
        if bias:  # the biases count
            assert not np.allclose(got, np.asarray(logits(kcfg, fused)))


def test_a_long_block_gives_each_token_the_decoding_steps_logits_bit_for_bit(tiny_gguf):
    """A verification block of more rows than the kernels take by default (16) runs with
    `ModelConfig.for_rows`, so its products and attention go through the same kernels as one-token
    decoding steps, and every token's logits are the step's, bit for bit (XLA's GEMM and the
    reference attention, which took over above 16 rows, agree only to rounding)."""
    from eagle_jax.kernels.cpu_attention import MAX_QUERIES
    from eagle_jax.models.config import ModelConfig
    from eagle_jax.models.decoder import KVCache

    d, cfg, params = tiny_gguf
    kcfg = dataclasses.replace(cfg, matmul_impl="cpu_kernel")
    qparams = unstack_layers(attach_gguf_blocks(params, kcfg, d / "m.gguf"))
    long_cfg = kcfg.for_rows(20)
    assert long_cfg.kernel_rows == 20 and kcfg.for_rows(16) is kcfg and cfg.for_rows(20) is cfg
    assert ModelConfig.kernel_rows == cm.MAX_ROWS == MAX_QUERIES  # one default, three names
    rng = np.random.default_rng(3)
    prefix = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 9)), jnp.int32)
    block = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 20)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def run(c, toks, cache):
        out = forward(qparams, c, toks, cache=cache)
        return lm_logits(qparams, c, out.hidden), out.cache.advance(jnp.full((1,), toks.shape[1], jnp.int32))

    _, cache = run(kcfg, prefix, KVCache.create(kcfg, 1, 40))
    whole, _ = run(long_cfg, block, cache)
    for i in range(20):
        one, cache = run(kcfg, block[:, i:i + 1], cache)
        np.testing.assert_array_equal(np.asarray(one)[0, 0], np.asarray(whole)[0, i], err_msg=f"token {i}")
