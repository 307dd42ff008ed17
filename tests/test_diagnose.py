"""The head diagnostic (training/diagnose.py): its first-step accuracy is the objective's acc_0 on
the same positions, its confidence bands partition those positions, and its bigram baseline is
the most frequent follower."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_hf_model, twin
from eagle_jax.draft import DraftConfig, init_head
from eagle_jax.training.diagnose import bigram_table, head_agreement, markdown, summarize
from eagle_jax.training.objectives import ObjectiveConfig, make_loss_fn


@pytest.fixture(scope="module")
def setup():
    cfg, params = twin(make_hf_model("llama", std=0.2))
    rng = np.random.default_rng(3)
    examples = []
    for n in (9, 16, 5, 13, 16):
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        mask = (np.arange(n) >= 3).astype(np.float32).tolist()  # a 3-token "prompt", then the reply
        examples.append({"input_ids": ids, "loss_mask": mask})
    return cfg, params, examples


def _heads(cfg):
    d2t = np.zeros(60, np.int32)
    d2t[20:] = 30  # draft ids 20..59 → target ids 50..89: some target tokens are outside
    e3 = init_head(DraftConfig.for_target("eagle3", cfg, draft_vocab_size=60, target_layers=(0, 1, 3)),
                   jax.random.PRNGKey(10), d2t=d2t)
    e1 = init_head(DraftConfig.for_target("eagle1", cfg), jax.random.PRNGKey(10))  # seeds with some hits
    boost = lambda h: h.replace(params=jax.tree.map(lambda x: x * 5 if x.ndim == 2 else x, h.params))
    return {"eagle3": boost(e3), "eagle1": boost(e1)}


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_first_step_accuracy_is_the_objectives_acc_0(setup, kind):
    cfg, params, examples = setup
    head = _heads(cfg)[kind]
    seq = 16
    agree = head_agreement(head, params, cfg, examples, seq, batch_size=2)  # 3 batches, the last padded
    rep = summarize(agree)
    batch = {"input_ids": jnp.asarray([np.pad(e["input_ids"], (0, seq - len(e["input_ids"]))) for e in examples]),
             "loss_mask": jnp.asarray([np.pad(e["loss_mask"], (0, seq - len(e["loss_mask"]))) for e in examples]),
             "lengths": jnp.asarray([len(e["input_ids"]) for e in examples])}
    ocfg = ObjectiveConfig(kind=kind, ttt_length=1, noise=0.0)
    aux = {"target": params, "d2t": head.d2t}
    _, m = make_loss_fn(ocfg, head.cfg, cfg)(head.params, aux, batch, jax.random.PRNGKey(0))
    # the objective's acc_0 counts a target outside the draft vocabulary as a miss (SpecForge): accept_0
    assert rep["accept_0"] == pytest.approx(float(m["acc_0"]), abs=1e-6)
    assert 0 < rep["accept_0"] <= rep["acc_0"] < 1  # a comparison of two zeros would prove little
    # scored: j whose t_{j+2} is a reply token, i.e. j + 2 in [3, n)
    assert rep["positions"] == sum(max(len(e["input_ids"]) - 3, 0) for e in examples)
    if kind == "eagle3":
        assert 0 < rep["outside_draft_vocab"] < 1
        inside = agree["in_draft_vocab"]
        tok = agree["target_token"]
        assert np.all(inside == (((tok >= 0) & (tok < 20)) | ((tok >= 50) & (tok < 90))))
    else:
        assert rep["outside_draft_vocab"] == 0


def test_bands_partition_the_positions(setup):
    cfg, params, examples = setup
    rep = summarize(head_agreement(_heads(cfg)["eagle3"], params, cfg, examples, 16, batch_size=4))
    shares = [b["share"] for b in rep["bands"]]
    assert sum(shares) == pytest.approx(1.0)
    weighted = sum(b["share"] * b["head_acc"] for b in rep["bands"] if b["head_acc"] is not None)
    assert weighted == pytest.approx(rep["acc_0"])
    assert "| target top-1 prob |" in markdown(rep)


def test_bigram_baseline():
    ex = [{"input_ids": [1, 2, 3, 2, 3, 2, 4], "loss_mask": [0, 0, 1, 1, 1, 1, 1]},
          {"input_ids": [5, 2, 4, 2, 4], "loss_mask": [0, 1, 1, 1, 1]}]
    # followers into assistant tokens: 2→3 (×2), 2→4 (×3), 3→2 (×2), 5→2, 4→2
    assert bigram_table(ex) == {2: 4, 3: 2, 5: 2, 4: 2}
    agree = {"correct": np.array([True, False, True]), "target_p1": np.array([0.95, 0.4, 0.8]),
             "target_token": np.array([4, 9, 2]), "next_token": np.array([2, 2, 3]),
             "in_draft_vocab": np.array([True, True, True])}
    rep = summarize(agree, bigram_table(ex))
    assert rep["bigram_acc"] == pytest.approx(2 / 3)
    assert rep["acc_0"] == pytest.approx(2 / 3)
    top = rep["bands"][-1]
    assert (top["share"], top["head_acc"], top["bigram_acc"]) == (pytest.approx(1 / 3), 1.0, 1.0)
    assert rep["accept_0"] == pytest.approx(2 / 3)  # every target token in the vocabulary


def test_accept_0_counts_out_of_vocabulary_positions_as_misses():
    agree = {"correct": np.array([True, False, True, False]), "target_p1": np.array([0.95, 0.4, 0.8, 0.99]),
             "target_token": np.array([4, 9, 2, 7]), "next_token": np.array([2, 2, 3, 1]),
             "in_draft_vocab": np.array([True, True, True, False])}
    rep = summarize(agree)
    assert rep["acc_0"] == pytest.approx(2 / 3)  # the objective's positions: in the vocabulary only
    assert rep["accept_0"] == pytest.approx(2 / 4)
    assert rep["outside_draft_vocab"] == pytest.approx(1 / 4)
    assert "accept_0 over all positions 0.500" in markdown(rep)
