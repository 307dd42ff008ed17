"""Invariances the speculative decoder relies on: the cache changes nothing; a block with any
position offset and any ancestor mask gives the logits of the sequential computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_hf_model, twin
from eagle_jax.models.decoder import KVCache, forward, lm_logits, stack_layers, unstack_layers

TOL = 1e-5


def _logits(params, cfg, ids, positions=None, **kw):
    out = forward(params, cfg, ids, positions, **kw)
    return np.asarray(lm_logits(params, cfg, out.hidden)), out


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("chunks", [(20,), (7, 1, 12), (1,) * 20])
def test_cached_equals_uncached(name, chunks, rng):
    cfg, params = twin(make_hf_model(name))
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 20)))
    full, _ = _logits(params, cfg, ids)
    cache = KVCache.create(cfg, batch=2, max_len=24)
    got, start = [], 0
    for n in chunks:
        lg, out = _logits(params, cfg, ids[:, start:start + n], cache=cache)
        cache = out.cache.advance(jnp.full((2,), n, jnp.int32))
        got.append(lg)
        start += n
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=TOL, rtol=0)


def test_rows_with_different_lengths(rng):
    """Each batch row keeps its own length: row 1 is 5 tokens behind row 0."""
    cfg, params = twin(make_hf_model("llama"))
    a = rng.integers(0, cfg.vocab_size, 12)
    b = rng.integers(0, cfg.vocab_size, 7)
    cache = KVCache.create(cfg, 2, 16)
    toks = np.zeros((2, 12), np.int32)
    toks[0], toks[1, :7] = a, b
    out = forward(params, cfg, jnp.asarray(toks), cache=cache)
    cache = out.cache.advance(jnp.array([12, 7], jnp.int32))
    nxt = jnp.array([[5], [9]])
    lg, _ = _logits(params, cfg, nxt, cache=cache)
    ref_a, _ = _logits(params, cfg, jnp.asarray(np.r_[a, 5])[None])
    ref_b, _ = _logits(params, cfg, jnp.asarray(np.r_[b, 9])[None])
    np.testing.assert_allclose(lg[0, 0], ref_a[0, -1], atol=TOL)
    np.testing.assert_allclose(lg[1, 0], ref_b[0, -1], atol=TOL)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_tree_block_equals_sequential(name, rng):
    """A block holding two branches (root r; children x, y; grandchild z under x) with an
    ancestor mask and depth positions gives, at every node, the logits of decoding its own path
    sequentially after the prefix — the property tree verification relies on."""
    cfg, params = twin(make_hf_model(name))
    prefix = rng.integers(0, cfg.vocab_size, 9)
    r, x, y, z = rng.integers(0, cfg.vocab_size, 4)
    cache = KVCache.create(cfg, 1, 20)
    out = forward(params, cfg, jnp.asarray(prefix)[None], cache=cache)
    cache = out.cache.advance(jnp.array([9], jnp.int32))
    block = jnp.array([[r, x, y, z]])
    parents = [-1, 0, 0, 1]
    mask = np.eye(4, dtype=bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    pos = 9 + jnp.array([[0, 1, 1, 2]])
    lg, _ = _logits(params, cfg, block, pos, cache=cache, block_mask_btt=jnp.asarray(mask)[None])
    paths = {0: [r], 1: [r, x], 2: [r, y], 3: [r, x, z]}
    for node, path in paths.items():
        ref, _ = _logits(params, cfg, jnp.asarray(np.r_[prefix, path])[None])
        np.testing.assert_allclose(lg[0, node], ref[0, -1], atol=TOL, err_msg=f"node {node}")


def test_position_offset_block_causal_equals_sequential(rng):
    """Positions starting at an arbitrary offset, block-causal mask over two blocks, uncached and
    cached, equal one token at a time at the same positions."""
    cfg, params = twin(make_hf_model("qwen3"))
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 10)))
    pos = 37 + jnp.arange(10)[None]
    block = np.tril(np.ones((10, 10), bool))
    block[5:, :5] = True  # second block sees all of the first, causal inside
    lg_block, _ = _logits(params, cfg, ids, pos, block_mask_btt=jnp.asarray(block)[None])
    cache = KVCache.create(cfg, 1, 10)
    seq = []
    for t in range(10):
        lg, out = _logits(params, cfg, ids[:, t:t + 1], pos[:, t:t + 1], cache=cache)
        cache = out.cache.advance(jnp.array([1], jnp.int32))
        seq.append(lg[0, 0])
    np.testing.assert_allclose(lg_block[0], np.stack(seq), atol=TOL)


def test_padding_slots_never_leak(rng):
    """Garbage written past the committed length (rejected tree tokens) does not change logits."""
    cfg, params = twin(make_hf_model("llama"))
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 8)))
    cache = KVCache.create(cfg, 1, 16)
    out = forward(params, cfg, ids, cache=cache)
    clean = out.cache.advance(jnp.array([8], jnp.int32))
    junk = forward(params, cfg, jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 6))), cache=clean).cache
    junk = junk.replace(v=junk.v.at[:, :, 14:].set(1e4))
    nxt = jnp.array([[3]])
    a, _ = _logits(params, cfg, nxt, cache=clean)
    b, _ = _logits(params, cfg, nxt, cache=junk)
    np.testing.assert_allclose(a, b, atol=0)


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
def test_unrolled_layers_equal_the_scan(cached, rng):
    """`unstack_layers` (one program per layer, the CPU inference layout) computes what the scan
    over stacked layers computes: logits, captured features and the cache it writes."""
    cfg, params = twin(make_hf_model("qwen3"))
    unrolled = unstack_layers(params)
    assert isinstance(unrolled["layers"], list) and len(unrolled["layers"]) == cfg.num_layers
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 11)))
    kw = dict(capture=(0, 1, cfg.num_layers - 1, cfg.num_layers))
    if cached:  # a committed prefix, then a block
        cache = forward(params, cfg, ids[:, :5], cache=KVCache.create(cfg, 2, 16)).cache.advance(jnp.full((2,), 5))
        kw["cache"], ids = cache, ids[:, 5:]
    ref, ref_out = _logits(params, cfg, ids, **kw)
    got, got_out = _logits(unrolled, cfg, ids, **kw)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    for a, b in zip(got_out.captured, ref_out.captured):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=0)
    if cached:
        np.testing.assert_allclose(np.asarray(got_out.cache.k), np.asarray(ref_out.cache.k), atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(got_out.cache.v), np.asarray(ref_out.cache.v), atol=TOL, rtol=0)
    back = stack_layers(unrolled)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))


@pytest.mark.parametrize("b", [1, 3])
def test_a_blocks_window_write_equals_the_scatter(b):
    """`write_block` with a `BlockStart` writes what the per-slot scatter writes, for blocks inside
    the cache (its contract), up to its last slot, per row, one key, in an unrolled layer and a
    scanned one (a traced index); slots given as an array still drop what runs past the end (a
    prefill chunk's padding)."""
    from eagle_jax.models.layers import BlockStart, block_slots, write_block

    rng = np.random.default_rng(0)
    s = 9
    cache = jnp.asarray(rng.standard_normal((4, b, s, 2, 3)), jnp.float32)
    for t, starts in [(3, [0, 4, 6]), (3, [6, 2, 5]), (1, [8, 0, 3]), (5, [4, 1, 0]), (9, [0, 0, 0])]:
        start = jnp.asarray(starts[:b], jnp.int32)
        x = jnp.asarray(rng.standard_normal((b, t, 2, 3)), jnp.float32)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        for layer in (0, 3, jnp.int32(2)):  # unrolled layers (a window for one row), a scanned one
            want = cache.at[layer, rows, block_slots(BlockStart(start), t)].set(x, mode="drop")
            got = jax.jit(lambda c, s, x: write_block(c, layer, s, x))(cache, BlockStart(start), x)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"t={t} starts={starts}")
    x = jnp.ones((b, 3, 2, 3))
    past = write_block(cache, 1, jnp.full((b, 3), 7, jnp.int32) + jnp.arange(3), x)  # slots 7, 8, (9)
    np.testing.assert_array_equal(np.asarray(past[1, :, 7:]), 1.0)
    np.testing.assert_array_equal(np.asarray(past[1, :, :7]), np.asarray(cache[1, :, :7]))


def test_a_one_row_window_write_is_not_a_loop():
    """The point of `BlockStart`: with the decoding programs' options (`cpu_jit`: no fusion emitters)
    XLA:CPU compiles a block's scatter into a while loop over its keys (a few operations each, in
    every layer, every step), the window into one update."""
    from eagle_jax.cpu_jit import CPU_COMPILER_OPTIONS
    from eagle_jax.models.layers import BlockStart, block_slots, write_block

    cache, x, start = jnp.zeros((2, 1, 16, 2, 4)), jnp.ones((1, 3, 2, 4)), jnp.asarray([5], jnp.int32)
    jit = jax.jit(lambda c, s, x: write_block(c, 1, s, x), compiler_options=CPU_COMPILER_OPTIONS)  # an unrolled layer
    hlo = lambda slots: jit.lower(cache, slots, x).compile().as_text()
    assert " while(" in hlo(block_slots(BlockStart(start), 3))  # the scatter: a loop (else this test proves nothing)
    assert " while(" not in hlo(BlockStart(start))


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_rotated_keys_are_the_same_bits_whatever_the_block_and_backend_level(level):
    """RoPE fused into the cache write, as a layer compiles it: a token's rotated key must not depend
    on how many tokens share the block (a decoding step's 1, a tree's N). At XLA's backend levels 1 and
    2 LLVM contracted `x cos + rot sin` differently for one row and for several (66 of 192 values
    differed); the exact form (`apply_rope(..., exact=True)`, what the CPU-kernel path uses) must
    give the same bits at every level. Also checks it is x cos + rot sin to within an ulp or two."""
    from eagle_jax.cpu_jit import CPU_COMPILER_OPTIONS
    from eagle_jax.models.layers import BlockStart, apply_rope, block_slots, write_block

    opts = {**CPU_COMPILER_OPTIONS, "xla_backend_optimization_level": level}

    def layer_write(qkv, cos, sin, k_all, length, t, exact):
        k = apply_rope(qkv[:, :t, 576:768].reshape(1, t, 3, 64), cos[:, :t], sin[:, :t], exact)
        return write_block(k_all, 0, BlockStart(length) if t > 1 else block_slots(BlockStart(length), 1), k)

    rng = np.random.default_rng(level)
    qkv = rng.standard_normal((1, 7, 960)).astype(np.float32)  # SmolLM2's fused q, k, v: 3 KV heads of 64
    ang = rng.uniform(0, 100, (1, 7, 32)).astype(np.float32)
    ang = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    k_all, length = np.zeros((2, 1, 64, 3, 64), np.float32), np.asarray([40], np.int32)
    run = lambda t: np.asarray(jax.jit(layer_write, static_argnums=(5, 6), compiler_options=opts)(
        qkv, cos, sin, k_all, length, t, True))[0, 0, 40:40 + t]
    one = run(1)[0]
    for t in (2, 3, 5, 7):
        np.testing.assert_array_equal(run(t)[0], one, err_msg=f"a {t}-token block rotated its first key differently")
    k64 = qkv[0, 0, 576:768].reshape(3, 64).astype(np.float64)
    terms = k64 * cos[0, 0], np.concatenate([-k64[:, 32:], k64[:, :32]], -1) * sin[0, 0]
    ulp = np.spacing((np.abs(terms[0]) + np.abs(terms[1])).astype(np.float32))  # of the terms: they may cancel
    assert (np.abs(one - (terms[0] + terms[1])) <= 2 * ulp).all()


@pytest.mark.parametrize("level", [1, 2])
def test_cpu_kernel_layers_give_a_token_the_same_bits_in_a_step_and_in_a_tree(level, rng):
    """The decoder on the CPU-kernel path (what lossless decoding compares across programs), compiled
    at XLA backend levels where LLVM's contractions vary with the loop: the first token's logits and
    cached keys are the same bits in a one-token step and a three-token chain verified at once."""
    import dataclasses

    from eagle_jax.cpu_jit import CPU_COMPILER_OPTIONS
    from eagle_jax.kernels import cpu_matmul

    if not cpu_matmul.available():
        pytest.skip(f"no CPU kernels: {cpu_matmul.unavailable_reason()}")
    cfg, params = twin(make_hf_model("llama"))
    cfg = dataclasses.replace(cfg, matmul_impl="cpu_kernel")
    params = unstack_layers(params)
    opts = {**CPU_COMPILER_OPTIONS, "xla_backend_optimization_level": level}
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 9)))
    cache = forward(params, cfg, prompt, cache=KVCache.create(cfg, batch=1, max_len=32)).cache
    cache = cache.advance(jnp.full((1,), 9, jnp.int32))

    def step(ids, cache, t):
        c = cfg.for_rows(t) if t > 1 else cfg
        out = forward(params, c, ids, cache=cache, block_fits=t > 1)
        return lm_logits(params, c, out.hidden), out.cache.k

    ids = (prompt + 1) % cfg.vocab_size  # the step's tokens; the chain's first is the step's
    run = lambda t: jax.jit(step, static_argnums=2, compiler_options=opts)(ids[:, :t], cache, t)
    (l1, k1), (l3, k3) = run(1), run(3)
    np.testing.assert_array_equal(np.asarray(k3)[:, :, 9], np.asarray(k1)[:, :, 9])
    np.testing.assert_array_equal(np.asarray(l3)[:, 0], np.asarray(l1)[:, 0])
    assert np.isfinite(np.asarray(l1)).all() and np.abs(np.asarray(k1)[:, :, 9]).max() > 0  # a real token
