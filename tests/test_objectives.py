"""Training objectives: the EAGLE-3 training-time-test loss equals a step-by-step computation
through the inference path (a real KV cache, one draft step at a time); EAGLE-1's loss is the
SmoothL1 + 0.1·CE of its definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_hf_model, twin
from eagle_jax.draft import DraftConfig, fuse_features, head_logits, head_step, init_head
from eagle_jax.models.decoder import KVCache, lm_logits
from eagle_jax.training.objectives import ObjectiveConfig, _shift, make_loss_fn, soft_ce_ahead, teacher


@pytest.fixture(scope="module")
def setup():
    cfg, params = twin(make_hf_model("llama", std=0.2))
    d2t = np.zeros(60, np.int32)
    d2t[20:] = 30  # draft ids 20..59 → target ids 50..89
    dc = DraftConfig.for_target("eagle3", cfg, draft_vocab_size=60, target_layers=(0, 1, 3))
    head = init_head(dc, jax.random.PRNGKey(0), d2t=d2t)
    head = head.replace(params=jax.tree.map(lambda x: x * 5 if x.ndim == 2 else x, head.params))  # non-trivial
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, (2, 11))
    loss_mask = (rng.random((2, 11)) < 0.8).astype(np.float32)
    batch = {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(loss_mask), "lengths": jnp.array([11, 8])}
    return cfg, params, head, batch


def _reference_ttt(cfg, params, head, batch, n, decay, greedy_weight=0.0):
    """Per (step i, index j): run the head exactly as drafting does and score its prediction
    against (1 - w) · p_target + w · onehot(target argmax). A target argmax outside the draft
    vocabulary is left out of the loss but counts as a miss in the accuracy."""
    ids = np.asarray(batch["input_ids"])
    b, l = ids.shape
    feats, hidden = teacher(params, cfg, head.cfg, batch["input_ids"])
    fused = fuse_features(head, feats)
    t_logits = np.asarray(lm_logits(params, cfg, hidden))
    draft_ids = np.arange(60) + np.asarray(head.d2t)
    embed = params["embed_tokens"]["embedding"]
    num = np.zeros(n)
    den = np.zeros(n)
    hits = np.zeros(n)
    scored = np.zeros(n)
    for r in range(b):
        length = int(batch["lengths"][r])
        for j in range(l):
            cache = KVCache.create(head.cfg.layer, 1, l + n)
            toks = jnp.asarray(ids[r:r + 1, 1:j + 2])
            if toks.shape[1] < j + 1:
                continue
            h, cache = head_step(head, embed, toks, fused[r:r + 1, :j + 1], jnp.arange(j + 1)[None], cache)
            cache = cache.advance(jnp.array([j + 1]))
            h = h[:, -1:]
            for i in range(n):
                if i > 0:
                    if j + 1 + i >= l:
                        break
                    h, cache = head_step(head, embed, jnp.asarray(ids[r:r + 1, j + 1 + i:j + 2 + i]), h,
                                         jnp.array([[j + i]]), cache)
                    cache = cache.advance(jnp.array([1]))
                tgt = j + 2 + i
                if tgt >= l or tgt >= length or not batch["loss_mask"][r, tgt]:
                    continue
                arg = t_logits[r, j + 1 + i].argmax()
                scored[i] += 1
                if arg not in draft_ids:
                    continue
                logp = np.asarray(jax.nn.log_softmax(head_logits(head, params, cfg, h)[0, 0]))
                p = (1 - greedy_weight) * np.asarray(jax.nn.softmax(t_logits[r, j + 1 + i][draft_ids]))
                p[list(draft_ids).index(arg)] += greedy_weight
                num[i] += -(p * logp).sum()
                den[i] += 1
                hits[i] += draft_ids[logp.argmax()] == arg
    ploss = num / np.maximum(den, 1)
    assert (den < scored).any()  # some target tokens are outside the draft vocabulary
    return ploss, hits / np.maximum(scored, 1), sum(decay ** i * ploss[i] for i in range(n))


@pytest.mark.parametrize("greedy_weight", [0.0, 0.6])
def test_ttt_loss_equals_step_by_step_drafting(setup, greedy_weight):
    cfg, params, head, batch = setup
    n = 3
    loss_fn = make_loss_fn(ObjectiveConfig("eagle3", ttt_length=n, greedy_weight=greedy_weight), head.cfg, cfg)
    loss, m = loss_fn(head.params, {"target": params, "d2t": head.d2t}, batch, jax.random.PRNGKey(0))
    ploss, acc, total = _reference_ttt(cfg, params, head, batch, n, 0.8, greedy_weight)
    np.testing.assert_allclose([float(m[f"ploss_{i}"]) for i in range(n)], ploss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([float(m[f"acc_{i}"]) for i in range(n)], acc, atol=1e-6)
    np.testing.assert_allclose(float(loss), total, rtol=1e-5)


def test_ttt_loss_sees_no_future(setup):
    """Changing tokens after position k changes no term whose inputs end before k."""
    cfg, params, head, batch = setup
    loss_fn = make_loss_fn(ObjectiveConfig("eagle3", ttt_length=2), head.cfg, cfg)
    aux = {"target": params, "d2t": head.d2t}
    base = dict(batch, loss_mask=jnp.zeros_like(batch["loss_mask"]).at[:, :6].set(1.0))
    a = loss_fn(head.params, aux, base, jax.random.PRNGKey(0))[0]
    changed = dict(base, input_ids=base["input_ids"].at[:, 7:].set(3))
    b = loss_fn(head.params, aux, changed, jax.random.PRNGKey(0))[0]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)


def test_eagle3_accuracy_counts_out_of_vocab_targets_as_misses(setup):
    """acc_i divides by every scored position (SpecForge): where the target's argmax is outside the
    draft vocabulary the head cannot be right, so a target that agrees with the head everywhere
    except at k such positions gives acc_0 = 1 - k / (scored positions), not 1."""
    cfg, params, head, batch = setup
    feats, hidden = teacher(params, cfg, head.cfg, batch["input_ids"])
    ids = np.asarray(batch["input_ids"])
    b, l = ids.shape
    h, _ = head_step(head, params["embed_tokens"]["embedding"], jnp.asarray(ids[:, 1:]),
                     fuse_features(head, feats)[:, :-1], jnp.broadcast_to(jnp.arange(l - 1)[None], (b, l - 1)))
    draft_ids = np.arange(60) + np.asarray(head.d2t)
    agree = np.zeros_like(ids)
    agree[:, 1:] = draft_ids[np.asarray(jnp.argmax(head_logits(head, params, cfg, h), -1))]
    loss_fn = make_loss_fn(ObjectiveConfig("eagle3", ttt_length=1), head.cfg, cfg)
    aux = {"target": params, "d2t": head.d2t}

    def metrics(t_argmax):
        off = dict(batch, features=feats, hidden=hidden, target_argmax=jnp.asarray(t_argmax, jnp.int32))
        return loss_fn(head.params, aux, off, jax.random.PRNGKey(0))[1]

    assert float(metrics(agree)["acc_0"]) == 1.0
    # step 0 at index j is scored when t_{j+2} is an assistant token of the row
    scored = np.asarray(batch["loss_mask"])[:, 2:] * (np.arange(2, l)[None] < np.asarray(batch["lengths"])[:, None])
    rows, cols = np.nonzero(scored)
    outside = agree.copy()
    outside[rows[:3], cols[:3] + 1] = 25  # target id 25: no draft token maps to it
    assert 25 not in draft_ids
    np.testing.assert_allclose(float(metrics(outside)["acc_0"]), 1 - 3 / scored.sum(), rtol=1e-6)


def test_eagle1_loss_definition(setup):
    cfg, params, _, batch = setup
    dc = DraftConfig.for_target("eagle1", cfg)
    head = init_head(dc, jax.random.PRNGKey(1))
    aux = {"target": params}
    loss_fn = make_loss_fn(ObjectiveConfig("eagle1", noise=0.0), dc, cfg)
    loss, m = loss_fn(head.params, aux, batch, jax.random.PRNGKey(0))
    feats, _ = teacher(params, cfg, dc, batch["input_ids"])
    ids = np.asarray(batch["input_ids"])
    h, _ = head_step(head, params["embed_tokens"]["embedding"], jnp.asarray(ids[:, 1:]), feats[:, :-1],
                     jnp.broadcast_to(jnp.arange(10)[None], (2, 10)))
    h, f = np.asarray(h)[:, :-1], np.asarray(feats)[:, 1:-1]
    mask = (np.asarray(batch["loss_mask"])[:, 2:] * (np.arange(2, 11)[None] < np.asarray(batch["lengths"])[:, None]))
    d = np.abs(h - f)
    v = (np.where(d < 1, 0.5 * d * d, d - 0.5).mean(-1) * mask).sum() / mask.sum()
    tl = np.asarray(lm_logits(params, cfg, jnp.asarray(f)))
    hl = np.asarray(jax.nn.log_softmax(lm_logits(params, cfg, jnp.asarray(h))))
    p = (-(np.asarray(jax.nn.softmax(tl)) * hl).sum(-1) * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(m["vloss"]), v, rtol=1e-5)
    np.testing.assert_allclose(float(m["ploss_0"]), p, rtol=1e-5)
    np.testing.assert_allclose(float(loss), v + 0.1 * p, rtol=1e-5)
    greedy = make_loss_fn(ObjectiveConfig("eagle1", noise=0.0, greedy_weight=0.3), dc, cfg)
    hard = -(np.take_along_axis(hl, tl.argmax(-1)[..., None], -1)[..., 0] * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(greedy(head.params, aux, batch, jax.random.PRNGKey(0))[1]["ploss_0"]),
                               0.7 * p + 0.3 * hard, rtol=1e-5)
    noisy = make_loss_fn(ObjectiveConfig("eagle1", noise=0.2), dc, cfg)(head.params, aux, batch, jax.random.PRNGKey(0))
    assert abs(float(noisy[0]) - float(loss)) > 1e-6  # the noise is applied
    g = jax.grad(lambda p: loss_fn(p, aux, batch, jax.random.PRNGKey(0))[0])(head.params)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_offline_features_give_the_online_loss(setup, kind):
    from eagle_jax.training.objectives import target_argmax

    cfg, params, head3, batch = setup
    if kind == "eagle1":
        head = init_head(DraftConfig.for_target("eagle1", cfg), jax.random.PRNGKey(1))
    else:
        head = head3
    aux = {"target": params, "d2t": head.d2t} if kind == "eagle3" else {"target": params}
    loss_fn = make_loss_fn(ObjectiveConfig(kind, ttt_length=2, noise=0.0), head.cfg, cfg)
    online = loss_fn(head.params, aux, batch, jax.random.PRNGKey(0))[0]
    feats, hidden = teacher(params, cfg, head.cfg, batch["input_ids"])
    offline = dict(batch, features=feats, hidden=hidden, target_argmax=target_argmax(params, cfg, hidden))
    np.testing.assert_allclose(float(loss_fn(head.params, aux, offline, jax.random.PRNGKey(0))[0]), float(online),
                               rtol=1e-6)


def _packed_and_unpacked(cfg, seq=16):
    """Three examples (lengths 5, 7, 4) as three padded rows, and packed as [A B | C]."""
    from eagle_jax.training.data import pack_row, pad_example

    rng = np.random.default_rng(7)
    exs = [{"input_ids": rng.integers(0, cfg.vocab_size, n).tolist(),
            "loss_mask": (rng.random(n) < 0.8).astype(np.float32).tolist()} for n in (5, 7, 4)]
    stack = lambda rows: {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
    unpacked = stack([pad_example(e, seq) for e in exs])
    packed = stack([pack_row(exs[:2], seq), pack_row(exs[2:], seq)])
    return unpacked, packed


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("features", ["online", "offline"])
def test_packed_rows_score_what_separate_rows_score(setup, kind, features):
    """A packed row keeps its examples apart (target and head attention inside a segment, positions
    restarting, no target across a boundary): loss and every metric equal the unpacked batch's."""
    from eagle_jax.training.objectives import target_argmax

    cfg, params, head3, _ = setup
    head = head3 if kind == "eagle3" else init_head(DraftConfig.for_target("eagle1", cfg), jax.random.PRNGKey(1))
    aux = {"target": params, "d2t": head.d2t} if kind == "eagle3" else {"target": params}
    loss_fn = make_loss_fn(ObjectiveConfig(kind, ttt_length=3, noise=0.0), head.cfg, cfg)
    unpacked, packed = _packed_and_unpacked(cfg)
    if features == "offline":  # features cached per example, laid side by side as the offline source does
        def add(batch, rows_of):
            feats, hidden = teacher(params, cfg, head.cfg, unpacked["input_ids"])
            fb = np.zeros((len(rows_of), 16, feats.shape[-1]), np.float32)
            hb = np.zeros((len(rows_of), 16, hidden.shape[-1]), np.float32)
            for r, members in enumerate(rows_of):
                at = 0
                for i in members:
                    n = int(unpacked["lengths"][i])
                    fb[r, at:at + n], hb[r, at:at + n] = feats[i, :n], hidden[i, :n]
                    at += n
            hb = jnp.asarray(hb)
            return dict(batch, features=jnp.asarray(fb), hidden=hb, target_argmax=target_argmax(params, cfg, hb))
        unpacked, packed = add(unpacked, [[0], [1], [2]]), add(packed, [[0, 1], [2]])
    lu, mu = loss_fn(head.params, aux, unpacked, jax.random.PRNGKey(0))
    lp, mp = loss_fn(head.params, aux, packed, jax.random.PRNGKey(0))
    assert float(mu["tokens"]) > 0 and set(mu) == set(mp)
    for k in mu:
        np.testing.assert_allclose(float(mp[k]), float(mu[k]), rtol=2e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(lp), float(lu), rtol=2e-5)
    # and the segments matter: the same row read as one example scores something else
    merged = {k: v for k, v in packed.items() if k not in ("segment_ids", "positions")}
    assert abs(float(loss_fn(head.params, aux, merged, jax.random.PRNGKey(0))[0]) - float(lu)) > 1e-4


def _dense_ttt_mask(n: int, step: int, l: int):
    """[L, n·L] visibility of rollout step `step` when every step's keys sit in slots [s·L, (s+1)·L):
    causal over the step-0 keys, then step s's key at the query's own index for 1 ≤ s ≤ step."""
    j = np.arange(l)
    eye = j[None, :] == j[:, None]
    return np.concatenate([j[None, :] <= j[:, None]] + [eye & (s <= step) for s in range(1, n)], axis=1)


@pytest.mark.parametrize("kvh,group", [(1, 1), (2, 3)])
def test_rollout_attention_is_the_dense_ttt_mask(kvh, group):
    """RolloutKeys' compact attention (step-0 block + the diagonal keys) equals dense attention over
    all n·L keys under the training-time-test mask, at every rollout step; segments included."""
    from eagle_jax.models.layers import RolloutKeys, dense_attention

    b, l, d, n = 2, 7, 8, 4
    rng = np.random.default_rng(3)
    seg = np.array([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]])
    mask0 = (np.tril(np.ones((l, l), bool))[None] & (seg[:, :, None] == seg[:, None, :]))
    keys = RolloutKeys(jnp.asarray(mask0))
    k_all = np.zeros((b, n * l, kvh, d), np.float32)
    v_all = np.zeros_like(k_all)
    for step in range(n):
        q, k, v = (rng.normal(size=(b, l, h, d)).astype(np.float32) for h in (kvh * group, kvh, kvh))
        out, keys = keys.step(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
        k_all[:, step * l:(step + 1) * l], v_all[:, step * l:(step + 1) * l] = k, v
        in_seg = np.concatenate([mask0, np.ones((b, l, (n - 1) * l), bool)], axis=2)
        mask = jnp.asarray(_dense_ttt_mask(n, step, l)[None] & in_seg)
        ref = dense_attention(jnp.asarray(q), jnp.asarray(k_all), jnp.asarray(v_all), mask)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
        assert keys.kd.shape == (b, l, step, kvh, d)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_bfloat16_compute_trains_float32_params(setup, kind):
    """compute_dtype="bfloat16": the head runs on a bf16 copy, the loss is float32 and close to the
    float32 loss, and the gradients are float32 and point the same way as float32's."""
    cfg, params, head3, batch = setup
    head = head3 if kind == "eagle3" else init_head(DraftConfig.for_target("eagle1", cfg), jax.random.PRNGKey(1))
    aux = {"target": params, "d2t": head.d2t} if kind == "eagle3" else {"target": params}
    out = {}
    for dt in ("float32", "bfloat16"):
        loss_fn = make_loss_fn(ObjectiveConfig(kind, ttt_length=3, noise=0.0, compute_dtype=dt), head.cfg, cfg)
        (loss, m), g = jax.value_and_grad(lambda p: loss_fn(p, aux, batch, jax.random.PRNGKey(0)), has_aux=True)(
            head.params)
        out[dt] = (loss, g)
    (l32, g32), (l16, g16) = out["float32"], out["bfloat16"]
    assert l16.dtype == jnp.float32 and float(l16) != float(l32)  # really computed in bf16
    np.testing.assert_allclose(float(l16), float(l32), rtol=2e-2)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g16))
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    a, b = flat(g32), flat(g16)
    assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99
    with pytest.raises(ValueError, match="compute_dtype"):
        ObjectiveConfig(kind, compute_dtype="int8")
    with pytest.raises(ValueError, match="greedy_weight"):
        ObjectiveConfig(kind, greedy_weight=1.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [1, 3])
def test_soft_ce_ahead_is_log_softmax_against_the_shifted_target(dtype, n):
    """The fused cross-entropy (value and its hand-written gradient) equals -Σ _shift(t_p, n) ·
    log_softmax(logits) and that expression's autodiff gradient; the last n indices score 0."""
    rng = np.random.default_rng(n)
    logits = jnp.asarray(rng.standard_normal((2, 9, 13)) * 3, dtype)
    t_p = jax.nn.softmax(jnp.asarray(rng.standard_normal((2, 9, 13)) * 2, jnp.float32), -1)
    w = jnp.asarray(rng.random((2, 9)), jnp.float32)

    def ref(lg):
        logp = jax.nn.log_softmax(lg.astype(jnp.float32), -1)
        return -jnp.sum(_shift(t_p, n) * logp, -1)

    got = soft_ce_ahead(logits, t_p, n)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref(logits)), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[:, -n:]) == 0)
    g = jax.grad(lambda lg: jnp.sum(w * soft_ce_ahead(lg, t_p, n)))(logits)
    g_ref = jax.grad(lambda lg: jnp.sum(w * ref(lg)))(logits.astype(jnp.float32))
    assert g.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref), rtol=tol, atol=tol)
    assert np.all(np.asarray(g[:, -n:]) == 0)
