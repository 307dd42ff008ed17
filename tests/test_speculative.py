"""Speculative decoding on a tiny target: greedy output identical to plain greedy for every
method and head; sampled output distributed as the target's; one compile per budget."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import speculative
from eagle_jax.cpu_jit import TRACE_COUNTS
from eagle_jax.decoding import generate_tokens, pack_prompts
from eagle_jax.draft import DraftConfig, TreeBudget, init_head, oracle_head
from eagle_jax.draft.drafting import draft_tree
from eagle_jax.sampling import SamplingParams
from eagle_jax.speculative import speculative_generate
from eagle_jax.tree import DEFAULT_STATIC_TREE, StaticTree, node_depths
from test_sampling import _chi2_pvalue

DYNAMIC = TreeBudget("dynamic", total_tokens=12, depth=4, top_k=3)
STATIC = TreeBudget("static", static_tree=DEFAULT_STATIC_TREE)
PAIR = TreeBudget("dynamic", total_tokens=2, depth=1, top_k=2)  # no expansion: the root and one node
LOOKUP = TreeBudget("dynamic", total_tokens=8, depth=2, top_k=3, lookup=5)  # the chain deeper than the tree


def _heads(cfg, params):
    d2t = np.zeros(60, np.int32)
    d2t[30:] = 20  # draft ids 30..59 map to target ids 50..79: a real reduced vocabulary
    return {
        "oracle": oracle_head(cfg, params),
        "eagle1-random": init_head(DraftConfig.for_target("eagle1", cfg), jax.random.PRNGKey(1)),
        "eagle3-random": init_head(DraftConfig.for_target("eagle3", cfg, draft_vocab_size=60),
                                   jax.random.PRNGKey(2), d2t=d2t),
        "oracle-draft-vocab": oracle_head(cfg, params, d2t=d2t),
    }


def _run(fn, params, cfg, prompts, max_new, eos=(-1,), sp=None, seed=0, cache_len=96, **kw):
    toks, lens = pack_prompts(prompts, cache_len)
    sp = sp or SamplingParams.create(len(prompts))
    head = (kw.pop("head"),) if "head" in kw else ()
    chunk = kw.pop("prefill_chunk", 16)
    return fn(params, cfg, *head, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(max_new),
              jnp.asarray(eos, jnp.int32), sp, jax.random.PRNGKey(seed), prefill_chunk=chunk, **kw), lens


def _rows(out, lens):
    return [np.asarray(out.tokens[i, lens[i]:out.length[i]]).tolist() for i in range(len(lens))]


@pytest.mark.parametrize("head_name", ["oracle", "eagle1-random", "eagle3-random", "oracle-draft-vocab"])
@pytest.mark.parametrize("budget", [DYNAMIC, STATIC, PAIR], ids=["dynamic", "static", "pair"])
def test_greedy_speculative_equals_plain_greedy(tiny_llama, head_name, budget, rng):
    _, cfg, params = tiny_llama
    head = _heads(cfg, params)[head_name]
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (4, 17, 33)]
    ref, lens = _run(generate_tokens, params, cfg, prompts, 40)
    out, _ = _run(speculative_generate, params, cfg, prompts, 40, head=head, budget=budget)
    assert _rows(out, lens) == _rows(ref, lens)
    # Bookkeeping: one prefill call, then one per step; accept lengths add up to the tokens.
    acc = np.asarray(out.accept_lengths)
    for i in range(3):
        steps = int((acc[i] > 0).sum())
        assert int(out.target_calls[i]) == steps + 1
        assert acc[i].sum() + 1 >= int(out.num_new[i]) > acc[i].sum() - budget.max_depth - 1
    if head_name == "oracle" and budget in (STATIC, PAIR):  # the rank-0 chain is the target's own greedy chain
        assert all((a[a > 0][:-1] == budget.max_depth + 1).all() for a in acc)


@pytest.mark.parametrize("k", [1, 2, 4, 10])
def test_drafting_top_k_is_lax_top_k_ties_included(k, rng):
    """Drafting's top-k (argmax passes for small k: XLA:CPU turned a top-k in the drafting program into
    a full sort) gives lax.top_k's values and ids, ties to the lower id."""
    from eagle_jax.draft.drafting import _top_k_rows

    x = rng.integers(-3, 3, (5, 40)).astype(np.float32)  # many ties
    x[1, 3:] = -np.inf  # fewer finite values than k: -inf ties, never an id twice
    x = jnp.asarray(x)
    got, want = _top_k_rows(x, k), jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


def test_prefill_in_big_and_tail_chunks_keeps_speculation_lossless(tiny_llama, rng):
    """A (big, tail) prefill plan (`decoding.prefill_plan`) runs the target and the head over the
    prompt in chunks of two sizes: speculative greedy still equals plain greedy, and the head's
    state at the root is the one whole chunks give."""
    _, cfg, params = tiny_llama
    head = _heads(cfg, params)["eagle3-random"]
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (4, 17, 30)]  # 30: one chunk of 16, 4 of 4
    ref, lens = _run(generate_tokens, params, cfg, prompts, 30, prefill_chunk=(16, 4))
    out, _ = _run(speculative_generate, params, cfg, prompts, 30, head=head, budget=DYNAMIC, prefill_chunk=(16, 4))
    assert _rows(out, lens) == _rows(ref, lens)
    whole, _ = _run(speculative.spec_start, params, cfg, prompts, 30, head=head, budget=DYNAMIC, prefill_chunk=32)
    split, _ = _run(speculative.spec_start, params, cfg, prompts, 30, head=head, budget=DYNAMIC,
                    prefill_chunk=(16, 4))
    np.testing.assert_allclose(np.asarray(split.h_root), np.asarray(whole.h_root), rtol=1e-5, atol=1e-5)
    assert np.asarray(split.dcache.length).tolist() == np.asarray(whole.dcache.length).tolist() == [4, 17, 30]
    assert np.asarray(split.root).tolist() == np.asarray(whole.root).tolist()


@pytest.mark.parametrize("head_name", ["eagle1-random", "eagle3-random"])
def test_draft_prefill_gives_one_whole_pass_keys_and_root_state(tiny_llama, head_name, rng):
    """The head's prefill writes only keys and values for a prompt's positions before the last and
    runs the last alone (`draft_prefill`): the same cache and state at the root as one whole pass
    of the head over every position, for prompts of 1 to 33 tokens in one batch, in big and tail
    chunks."""
    from eagle_jax.draft.heads import create_draft_cache, fuse_features, head_step

    _, cfg, params = tiny_llama
    head = _heads(cfg, params)[head_name]
    lens, s = np.array([1, 4, 17, 33]), 40
    toks = rng.integers(3, cfg.vocab_size, (len(lens), s)).astype(np.int32)
    root = rng.integers(3, cfg.vocab_size, len(lens)).astype(np.int32)
    feats = jax.random.normal(jax.random.PRNGKey(3), (len(lens), s, head.cfg.feature_size))
    cache = create_draft_cache(head.cfg, len(lens), s + 8)
    prefill = jax.jit(speculative.draft_prefill, static_argnames="chunk")
    got, h_root = prefill(head, params, feats, jnp.asarray(toks), jnp.asarray(lens), jnp.asarray(root), cache,
                          chunk=(16, 4))
    nxt = np.concatenate([toks[:, 1:], np.zeros_like(toks[:, :1])], axis=1)  # position j reads t_{j+1}
    nxt[np.arange(len(lens)), lens - 1] = root
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (len(lens), s))
    h, want = head_step(head, params["embed_tokens"]["embedding"], jnp.asarray(nxt), fuse_features(head, feats),
                        pos, cache)
    assert np.asarray(got.length).tolist() == lens.tolist()
    for i, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(h_root[i]), np.asarray(h[i, n - 1]), rtol=1e-5, atol=1e-5)
        for a, b in ((got.k, want.k), (got.v, want.v)):
            np.testing.assert_allclose(np.asarray(a[:, i, :n]), np.asarray(b[:, i, :n]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_name,budget", [
    ("eagle3-random", LOOKUP), ("oracle-draft-vocab", LOOKUP),
    ("eagle3-random", dataclasses.replace(LOOKUP, lookup_min_ngram=3)),  # chains found by trigrams only
    ("eagle1-random", TreeBudget("static", static_tree=DEFAULT_STATIC_TREE, lookup=3))])
def test_greedy_speculative_with_a_lookup_chain_equals_plain_greedy(tiny_llama, head_name, budget, rng):
    """Trees with a prompt-lookup chain grafted on decode plain greedy's tokens; with a random
    head (whose drafts the target almost never takes) the chain is what gets accepted on prompts
    that repeat themselves, so it cuts the target passes."""
    _, cfg, params = tiny_llama
    head = _heads(cfg, params)[head_name]
    motif = list(rng.integers(3, cfg.vocab_size, 5))
    prompts = [motif * 4, list(rng.integers(3, cfg.vocab_size, 9)) + motif * 3, list(rng.integers(3, 40, 30))]
    ref, lens = _run(generate_tokens, params, cfg, prompts, 40)
    out, _ = _run(speculative_generate, params, cfg, prompts, 40, head=head, budget=budget)
    assert _rows(out, lens) == _rows(ref, lens)
    acc = np.asarray(out.accept_lengths)
    assert acc.max() <= budget.max_depth + 1
    if head_name.endswith("random"):
        plain, _ = _run(speculative_generate, params, cfg, prompts, 40, head=head,
                        budget=dataclasses.replace(budget, lookup=0))
        assert _rows(plain, lens) == _rows(ref, lens)
        assert int(out.target_calls.sum()) < int(plain.target_calls.sum())
        if budget.lookup_min_ngram == 1:  # unigram matches find the motif's long runs here
            assert acc.max() > plain.accept_lengths.max()


def test_a_dynamic_tree_gives_the_chain_its_weakest_rows_only_where_one_was_found(tiny_llama):
    """Per batch row: with a chain, the head's best N - L nodes plus the chain's new nodes; without
    one, exactly the tree the head drafts without lookup."""
    _, cfg, params = tiny_llama
    head = _heads(cfg, params)["eagle3-random"]
    seqs = [[5, 6, 7, 8, 9] * 2 + [5, 6], list(range(20, 32))]  # row 0 ends in "9 5 6", seen before
    toks, lens = pack_prompts(seqs, 64)
    st = speculative.spec_start(params, cfg, head, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(8),
                                jnp.asarray([-1], jnp.int32), SamplingParams.create(2), jax.random.PRNGKey(0),
                                budget=LOOKUP, prefill_chunk=16)
    st = st._replace(tokens=jnp.asarray(toks), length=jnp.asarray(lens), root=jnp.asarray([6, 31]))
    plain = dataclasses.replace(LOOKUP, lookup=0)
    with_chain = speculative.propose_tree(head, params, cfg, st, LOOKUP)
    without = speculative.propose_tree(head, params, cfg, st, plain)
    n_short = LOOKUP.total_tokens - LOOKUP.lookup
    short = speculative.propose_tree(head, params, cfg, st, dataclasses.replace(plain, total_tokens=n_short))
    for x, y in zip(with_chain, without):  # row 1 has no chain: the plain tree
        np.testing.assert_array_equal(np.asarray(x[1]), np.asarray(y[1]))
    for x, y in zip(with_chain, short):  # row 0: the head's best nodes, then the chain's new ones
        np.testing.assert_array_equal(np.asarray(x[0, :n_short]), np.asarray(y[0]))
    new = np.asarray(with_chain.valid_bn[0, n_short:])
    chain = [7, 8, 9, 5, 6]  # what followed the earlier "9 5 6"
    k = int(new.sum())
    assert k and new.tolist() == [False] * (5 - k) + [True] * k  # after the part the tree already had
    assert np.asarray(with_chain.tokens_bn[0, n_short:])[new].tolist() == chain[5 - k:]


@pytest.mark.parametrize("head_name", ["oracle", "eagle3-random"])
def test_greedy_speculative_with_unrolled_target_layers(tiny_llama, head_name, rng):
    """The engine's CPU layout (target layers unrolled) decodes the scan's greedy tokens."""
    from eagle_jax.models.decoder import unstack_layers

    _, cfg, params = tiny_llama
    unrolled = unstack_layers(params)
    head = _heads(cfg, unrolled)[head_name]
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (6, 21)]
    ref, lens = _run(generate_tokens, params, cfg, prompts, 30)
    plain, _ = _run(generate_tokens, unrolled, cfg, prompts, 30)
    out, _ = _run(speculative_generate, unrolled, cfg, prompts, 30, head=head, budget=DYNAMIC)
    assert _rows(plain, lens) == _rows(ref, lens)
    assert _rows(out, lens) == _rows(ref, lens)


@pytest.mark.parametrize("head_name", ["oracle", "eagle3-random"])
def test_greedy_speculative_up_to_the_end_of_the_buffer(tiny_llama, head_name, rng):
    """Rows that run into the end of their token buffer: the last steps' trees, draft levels and
    re-feeds go to the caches' last slots, which `_start` sizes the caches for (with too little
    room their keys would be lost). The same tokens as plain greedy, and the same acceptance as
    when the budget, not the buffer, stops them: the drafts at the end are what they are anywhere
    else."""
    _, cfg, params = tiny_llama
    head = _heads(cfg, params)[head_name]
    prompts = [list(rng.integers(3, cfg.vocab_size, 22)) for _ in range(3)]
    ref, lens = _run(generate_tokens, params, cfg, prompts, 60, cache_len=40)
    assert [int(x) for x in ref.length] == [40] * 3  # every row stopped by the buffer, not the budget
    chain = TreeBudget("dynamic", total_tokens=8, depth=6, top_k=1)  # the oracle's steps: 23, 31, 39 (cut)
    for budget in (DYNAMIC, chain, TreeBudget("dynamic", total_tokens=3, depth=1, top_k=2)):
        out, _ = _run(speculative_generate, params, cfg, prompts, 60, cache_len=40, head=head, budget=budget)
        roomy, _ = _run(speculative_generate, params, cfg, prompts, 40 - 22, cache_len=96, head=head, budget=budget)
        assert _rows(out, lens) == _rows(roomy, lens) == _rows(ref, lens)
        steps = int(out.steps)
        assert steps == int(roomy.steps)
        np.testing.assert_array_equal(np.asarray(out.accept_lengths)[:, :steps],
                                      np.asarray(roomy.accept_lengths)[:, :steps])


def test_eos_inside_an_accepted_run_stops_there(tiny_llama):
    _, cfg, params = tiny_llama
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    free, lens = _run(generate_tokens, params, cfg, prompts, 30)
    eos = _rows(free, lens)[0][9]
    ref, _ = _run(generate_tokens, params, cfg, prompts, 30, eos=(eos,))
    out, _ = _run(speculative_generate, params, cfg, prompts, 30, eos=(eos,), head=oracle_head(cfg, params),
                  budget=STATIC)
    assert _rows(out, lens) == _rows(ref, lens)
    assert _rows(out, lens)[0][-1] == eos


def test_one_compile_per_budget(tiny_llama):
    _, cfg, params = tiny_llama
    head = _heads(cfg, params)["eagle1-random"]
    _run(speculative_generate, params, cfg, [[1, 2, 3]], 5, head=head, budget=DYNAMIC)
    before = TRACE_COUNTS["speculative"]
    for i, (p, n, t) in enumerate([([4, 5, 6, 7], 30, 0.0), ([9] * 20, 12, 0.7), ([3], 50, 1.2)]):
        out, _ = _run(speculative_generate, params, cfg, [p], n, head=head, budget=DYNAMIC, seed=i,
                      sp=SamplingParams.create(1, t, 0.9, 20))
        assert int(out.steps) > 3  # many steps, one compiled function
    assert TRACE_COUNTS["speculative"] == before
    _run(speculative_generate, params, cfg, [[1, 2, 3]], 5, head=head, budget=STATIC)
    assert TRACE_COUNTS["speculative"] == before + 1


def _exact_three_tokens(params, cfg, prompt, sp1):
    """P(t1, t2, t3) of the target, enumerated."""
    from eagle_jax.models.decoder import forward, lm_logits
    from eagle_jax.sampling import target_probs

    def probs(seqs):
        sp = SamplingParams.create(len(seqs), float(sp1.temperature[0]), float(sp1.top_p[0]), int(sp1.top_k[0]))
        h = forward(params, cfg, jnp.asarray(seqs)).hidden[:, -1]
        return np.asarray(target_probs(lm_logits(params, cfg, h), sp), np.float64)

    joint = {}
    p1 = probs([prompt])[0]
    for t1 in np.flatnonzero(p1):
        p2 = probs([prompt + [t1]])[0]
        t2s = np.flatnonzero(p2)
        p3 = probs([prompt + [t1, t2] for t2 in t2s])
        for t2, row in zip(t2s, p3):
            for t3 in np.flatnonzero(row):
                joint[(t1, t2, t3)] = p1[t1] * p2[t2] * row[t3]
    return joint


@pytest.mark.slow  # 6000 sampled rows a run (about a minute each)
@pytest.mark.parametrize("head_name,budget", [("oracle", DYNAMIC), ("eagle3-random", DYNAMIC),
                                               ("eagle3-random", LOOKUP)])
def test_sampled_speculative_tokens_follow_the_target(tiny_llama, head_name, budget, monkeypatch):
    _, cfg, params = tiny_llama
    head = _heads(cfg, params)[head_name]
    # With a chain, a prompt that repeats itself: the first step's chain copies "15 92 65".
    prompt, n = ([3, 14, 15, 92, 65] if not budget.lookup else [14, 15, 92, 65, 3, 14]), 6000
    sp = SamplingParams.create(n, 0.9, 1.0, 4)
    joint = _exact_three_tokens(params, cfg, prompt, SamplingParams.create(1, 0.9, 1.0, 4))
    out, _ = _run(speculative_generate, params, cfg, [prompt] * n, 3, sp=sp, seed=11, cache_len=16, head=head,
                  budget=budget)
    p = len(prompt)
    draws = [tuple(r) for r in np.asarray(out.tokens[:, p:p + 3])]
    first = np.asarray(out.accept_lengths)[:, 0]
    if head_name == "oracle":  # drafts really were accepted (the test exercises acceptance)
        assert first.mean() > 1.5
    elif budget.lookup:  # the random head's drafts are not taken; the chain's are, where the root matched
        assert (first > 1).mean() > 0.02
    assert _chi2_pvalue(draws, joint) > 1e-3

    # Power: a sampler that accepts from a sharpened p (not the target's) is caught. The bias sits in
    # the acceptance every variant shares, so one variant (the oracle's, the most drafts accepted) shows it.
    if head_name != "oracle":
        return
    real = speculative.accept_from_logits
    monkeypatch.setattr(speculative, "accept_from_logits",
                        lambda key, tok, par, val, logits, sp, d: real(key, tok, par, val, logits * 1.5, sp, d))
    speculative_generate.clear_cache()
    biased, _ = _run(speculative_generate, params, cfg, [prompt] * n, 3, sp=sp, seed=11, cache_len=16, head=head,
                     budget=budget)
    speculative_generate.clear_cache()
    assert _chi2_pvalue([tuple(r) for r in np.asarray(biased.tokens[:, p:p + 3])], joint) < 1e-6


def _assert_same(a, b):
    """Two pytrees (trees, caches) with equal leaves, bit for bit."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _three_row_start(params, cfg, head, rng, budget):
    """The state after prefilling three random prompts (4, 17 and 33 tokens) for `budget`."""
    prompts = [list(rng.integers(3, cfg.vocab_size, n)) for n in (4, 17, 33)]
    toks, lens = pack_prompts(prompts, 64)
    return speculative.spec_start(params, cfg, head, jnp.asarray(toks), jnp.asarray(lens), jnp.int32(8),
                                  jnp.asarray([-1], jnp.int32), SamplingParams.create(3), jax.random.PRNGKey(0),
                                  budget=budget, prefill_chunk=16)


def test_dynamic_depth_is_clipped_to_what_the_tree_can_hold(tiny_llama, rng):
    """A tree of N nodes drafts N - 2 expansion levels, however deep the budget asks: the tree is
    the one the unclipped drafter (5 levels) gives — deeper levels could never be kept."""
    _, cfg, params = tiny_llama
    clipped = TreeBudget("dynamic", total_tokens=5, depth=5, top_k=3)
    assert (clipped.depth, clipped.max_depth) == (3, 4)
    assert TreeBudget("dynamic", total_tokens=2, depth=5, top_k=3).depth == 0  # the root's first choice alone
    assert TreeBudget("dynamic", total_tokens=24, depth=5, top_k=4).depth == 5
    unclipped = TreeBudget("dynamic", total_tokens=5, depth=3, top_k=3)
    object.__setattr__(unclipped, "depth", 5)  # what the drafter did before the clip
    flat = _heads(cfg, params)["eagle3-random"]
    # Peaked logits: the best nodes form a chain down to level N - 1 (the deepest a tree of N holds).
    peaked = flat.replace(params={**flat.params, "lm_head": {"kernel": 200.0 * flat.params["lm_head"]["kernel"]}})
    for head in (flat, peaked, _heads(cfg, params)["eagle1-random"]):
        st = _three_row_start(params, cfg, head, rng, unclipped)
        a = draft_tree(head, params, cfg, st.h_root, st.root, st.dcache, clipped)
        b = draft_tree(head, params, cfg, st.h_root, st.root, st.dcache, unclipped)
        assert bool(jnp.all(b.valid_bn))
        if head is peaked:
            assert int(jnp.max(node_depths(b.parents_bn, b.valid_bn, unclipped.max_depth))) == 4
        _assert_same(a, b)


def test_a_two_token_tree_drafts_no_level_and_equals_the_one_node_chain(tiny_llama, rng):
    """A 2-token dynamic tree (depth clipped to 0) is the tree that drafting a dropped level gave
    before (depth 1), and the static chain [[0]]; it writes nothing to the head's cache. A depth-0
    tree of 3 is the root's two best children: the static tree [[0], [1]]."""
    _, cfg, params = tiny_llama
    pair = TreeBudget("dynamic", total_tokens=2, depth=3, top_k=2)
    assert (pair.depth, pair.top_k, pair.draft_depth, pair.max_depth, pair.scratch) == (0, 1, 1, 1, 0)
    assert pair == TreeBudget("dynamic", total_tokens=2, depth=1, top_k=4)  # the same tree: one program
    wasted = TreeBudget("dynamic", total_tokens=2, depth=1, top_k=2)
    object.__setattr__(wasted, "depth", 1)  # what the drafter did before stop 72
    siblings = TreeBudget("dynamic", total_tokens=3, depth=0, top_k=5)
    assert (siblings.depth, siblings.top_k, siblings.max_depth) == (0, 2, 1)
    twins = {pair: TreeBudget("static", static_tree=StaticTree.from_json([[0]])),
             siblings: TreeBudget("static", static_tree=StaticTree.from_json([[0], [1]]))}
    for head in _heads(cfg, params).values():
        st = _three_row_start(params, cfg, head, rng, wasted)
        draft = lambda budget: draft_tree(head, params, cfg, st.h_root, st.root, st.dcache, budget)
        tree, cache = speculative.draft_tree_and_cache(head, params, cfg, st.h_root, st.root, st.dcache, pair)
        _assert_same(tree, draft(wasted))
        _assert_same(cache, st.dcache)
        for budget, static in twins.items():
            _assert_same(draft(budget), draft(static))


ONE_ROW_BUDGETS = {"dynamic": DYNAMIC, "static": STATIC,
                   "chain": TreeBudget("dynamic", total_tokens=8, depth=6, top_k=1),
                   "serving": TreeBudget("dynamic", total_tokens=3, depth=1, top_k=2),
                   "pair": PAIR}


@pytest.mark.parametrize("budget_name", list(ONE_ROW_BUDGETS))
@pytest.mark.parametrize("head_name", ["oracle", "eagle3-random", "eagle1-random"])
def test_one_row_writes_windows_and_equals_plain_greedy_up_to_the_buffer_end(tiny_llama, head_name, budget_name,
                                                                             rng):
    """One row, as `serve` decodes: the head's draft levels and re-feed and the commit of the
    accepted path are written as windows (`layers.BlockStart`, `speculative._commit_path`), the
    target's layers unrolled as on the CPU. Plain greedy's tokens up to the last slot of the
    buffer, and the oracle, drafting the target's own chain, has every step's chain accepted
    (a key written to the wrong slot would cut it short)."""
    from eagle_jax.models.decoder import unstack_layers

    _, cfg, params = tiny_llama
    unrolled = unstack_layers(params)
    head = _heads(cfg, unrolled)[head_name]
    budget = ONE_ROW_BUDGETS[budget_name]
    prompts = [list(rng.integers(3, cfg.vocab_size, 22))]
    ref, lens = _run(generate_tokens, unrolled, cfg, prompts, 60, cache_len=40)
    assert int(ref.length[0]) == 40  # stopped by the buffer, not the budget
    out, _ = _run(speculative_generate, unrolled, cfg, prompts, 60, cache_len=40, head=head, budget=budget)
    assert _rows(out, lens) == _rows(ref, lens)
    if head_name == "oracle" and budget_name in ("chain", "static"):  # the rank-0 chain is the target's greedy
        acc = np.asarray(out.accept_lengths)[0, :int(out.steps)]
        assert (acc[:-1] == budget.max_depth + 1).all(), acc


@pytest.mark.parametrize("head_name", ["oracle", "eagle3-random"])
def test_draft_cache_slots_past_the_committed_length_never_matter(tiny_llama, head_name, rng):
    """Drafting writes its scratch keys into the head's cache in place and the re-feed writes over
    them (no copy of the cache a step: `drafting.draft_tree_and_cache`), so whatever lies past the
    committed length must be invisible to every later query, in the head's cache as in the
    target's (where the tree's rows land and the accepted path is moved). Both caches filled with
    large random values there give the same tokens and the same accepted lengths, step for step."""
    from eagle_jax.models.decoder import unstack_layers

    _, cfg, params = tiny_llama
    unrolled = unstack_layers(params)
    head = _heads(cfg, unrolled)[head_name]
    budget = TreeBudget("dynamic", total_tokens=6, depth=3, top_k=2)
    toks, lens = pack_prompts([list(rng.integers(3, cfg.vocab_size, 13))], 64)
    args = (jnp.int32(40), jnp.asarray([-1], jnp.int32), SamplingParams.create(1), jax.random.PRNGKey(0))
    st = speculative.spec_start(unrolled, cfg, head, jnp.asarray(toks), jnp.asarray(lens), *args, budget=budget,
                                prefill_chunk=16)

    first = 1 if head.cfg.kind == "oracle" else 0  # the oracle's slot 0 holds t_0: draft slot s is its s + 1

    def scrambled(c, seed, first=0):
        past = jnp.arange(c.max_len)[None, None, :, None, None] >= first + c.length[None, :, None, None, None]
        noise = lambda x, k: jnp.where(past, 1e3 * jax.random.normal(k, x.shape, x.dtype), x)
        return c.replace(k=noise(c.k, jax.random.PRNGKey(seed)), v=noise(c.v, jax.random.PRNGKey(seed + 1)))

    both = lambda s, seed: s._replace(dcache=scrambled(s.dcache, seed, first), tcache=scrambled(s.tcache, seed + 2))
    runs = []
    for scramble in (False, True):
        s = jax.tree.map(jnp.copy, both(st, 7) if scramble else st)
        for _ in range(4):  # a few calls: the state between calls is scrambled again
            s = speculative.spec_advance(unrolled, cfg, head, s, *args, budget=budget, n_steps=jnp.int32(3))
            if scramble:
                s = both(s, 10 * int(s.step))
        runs.append(s)
    a, b = runs
    assert int(a.step) == int(b.step) >= 4
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.acc), np.asarray(b.acc))


def test_a_step_copies_neither_cache(tiny_llama, rng):
    """The compiled step of one row writes drafting's scratch, the re-feed and the accepted path
    into the caches in place: no copy of either cache (XLA copied the head's whole cache every
    step while drafting wrote into a copy of it, 2 x 45 us for SmolLM2's head) and no loop of a
    scatter over a cache (`write_block`)."""
    from eagle_jax.models.decoder import unstack_layers

    _, cfg, params = tiny_llama
    unrolled = unstack_layers(params)
    head = _heads(cfg, unrolled)["eagle3-random"]
    budget = TreeBudget("dynamic", total_tokens=6, depth=3, top_k=2)
    toks, lens = pack_prompts([list(rng.integers(3, cfg.vocab_size, 13))], 64)
    args = (jnp.int32(40), jnp.asarray([-1], jnp.int32), SamplingParams.create(1), jax.random.PRNGKey(0))
    st = speculative.spec_start(unrolled, cfg, head, jnp.asarray(toks), jnp.asarray(lens), *args, budget=budget,
                                prefill_chunk=16)
    hlo = speculative.spec_advance.lower(unrolled, cfg, head, st, *args, budget=budget,
                                         n_steps=jnp.int32(3)).compile().as_text()
    for cache in (st.dcache, st.tcache):
        shape = "f32[" + ",".join(map(str, cache.k.shape)) + "]"
        copies = [ln for ln in hlo.splitlines() if f"= {shape}" in ln and " copy(" in ln]
        loops = [ln for ln in hlo.splitlines()  # a scatter that XLA:CPU expanded into a loop over its keys
                 if " while(" in ln and shape in ln.split(" while(")[0] and '/scatter"' in ln]
        assert not copies and not loops, (copies + loops)[:2]
