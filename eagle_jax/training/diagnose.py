"""Why does a draft head accept what it accepts? Its first-step agreement with the target, split by
how sure the target itself is.

    python -m eagle_jax.training.diagnose --data runs/sd3/eval.jsonl --bigram-from runs/sd3/train.jsonl

For every assistant position of the conversations (the positions the training objective scores:
head at j reads the target's features at j and token t_{j+1}, and should name the target's greedy
token after t_{j+1}), it records whether the head's top-1 equals the target's argmax, and the
target's top-1 probability there. The report gives the overall first-step accuracy (acc_0 of the
objective, on more data than the trainer's eval batches), the accuracy per band of target
confidence, the share of positions whose target token is outside the draft vocabulary (never
acceptable), and optionally a bigram baseline — the most frequent follower of t_{j+1} in a
training file — so a head can be compared with the cheapest predictor there is. A head that is
weak where the target is sure (top-1 ≥ 0.9) is under-trained; one that is only weak where the
target hesitates is near what any drafter can do on that target.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..draft.heads import DraftHead, fuse_features, head_logits, head_step, to_target_ids
from ..models.config import ModelConfig
from .data import pad_example
from .objectives import _shift, target_top1, teacher

BANDS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def _batch_agreement(head: DraftHead, tparams, tcfg: ModelConfig, ids_bl, mask_bl, lengths_b):
    """Per position j: (head top-1 == target argmax at j+1, target top-1 prob at j+1, target
    argmax at j+1, scored) — scored: t_{j+2} is a valid assistant token."""
    b, l = ids_bl.shape
    feats, hidden = teacher(tparams, tcfg, head.cfg, ids_bl)

    p1, arg = target_top1(tparams, tcfg, hidden)
    pos = jnp.broadcast_to(jnp.arange(l)[None], (b, l))
    h, _ = head_step(head, tparams["embed_tokens"]["embedding"], _shift(ids_bl, 1), fuse_features(head, feats), pos)
    pred = to_target_ids(head, jnp.argmax(head_logits(head, tparams, tcfg, h), -1))
    valid = (jnp.arange(l)[None] < lengths_b[:, None]).astype(jnp.float32)
    scored = _shift(mask_bl * valid, 2) > 0
    tgt = _shift(arg, 1)
    return pred == tgt, _shift(p1, 1), tgt, scored


def head_agreement(head: DraftHead, tparams, tcfg: ModelConfig, examples: Sequence[dict], seq_len: int,
                   batch_size: int = 8, progress: bool = False) -> dict:
    """Flat arrays over the scored positions of `examples` (tokenized conversations):
    {"correct", "target_p1", "target_token", "next_token" (t_{j+1}), "in_draft_vocab"}."""
    if head.cfg.kind not in ("eagle1", "eagle3"):
        raise ValueError(f"diagnose needs an EAGLE-1 or EAGLE-3 head, got {head.cfg.kind!r}")
    run = jax.jit(lambda ids, m, n: _batch_agreement(head, tparams, tcfg, ids, m, n))
    in_vocab = np.ones((tcfg.vocab_size,), bool)
    if head.d2t is not None:
        in_vocab[:] = False
        in_vocab[np.asarray(to_target_ids(head, jnp.arange(head.cfg.draft_vocab_size)))] = True
    out = {k: [] for k in ("correct", "target_p1", "target_token", "next_token")}
    for i in range(0, len(examples), batch_size):
        if progress:
            print(f"\r[diagnose] {i}/{len(examples)} conversations", end="", file=sys.stderr, flush=True)
        chunk = [pad_example(e, seq_len) for e in examples[i:i + batch_size]]
        while len(chunk) < batch_size:  # one static shape: pad the last batch with empty rows
            chunk.append({k: np.zeros_like(v) for k, v in chunk[0].items()})
        ids = np.stack([c["input_ids"] for c in chunk])
        mask = np.stack([c["loss_mask"] for c in chunk])
        lens = np.array([c["lengths"] for c in chunk], np.int32).reshape(-1)
        correct, p1, tgt, scored = jax.device_get(run(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(lens)))
        out["correct"].append(correct[scored])
        out["target_p1"].append(p1[scored])
        out["target_token"].append(tgt[scored])
        out["next_token"].append(np.pad(ids[:, 1:], ((0, 0), (0, 1)))[scored])
    if progress:
        print(file=sys.stderr)
    res = {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in out.items()}
    res["in_draft_vocab"] = in_vocab[res["target_token"].astype(np.int64)]
    return res


def bigram_table(examples: Sequence[dict]) -> dict[int, int]:
    """The most frequent assistant token after each token in `examples` (ties: the smaller id)."""
    follow: dict[int, Counter] = defaultdict(Counter)
    for e in examples:
        ids, m = e["input_ids"], e["loss_mask"]
        for j in range(len(ids) - 1):
            if m[j + 1]:
                follow[int(ids[j])][int(ids[j + 1])] += 1
    return {t: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for t, c in follow.items()}


def summarize(agree: dict, bigram: Optional[dict[int, int]] = None, bands: Sequence[float] = BANDS) -> dict:
    """The report: overall acc_0 (positions whose target token is in the draft vocabulary, which
    the objective's loss scores), the out-of-vocabulary share, accept_0 (the same agreement over all
    positions, an out-of-vocabulary target token counted as a miss: the first draft token's chance
    of acceptance, comparable between heads with different draft vocabularies; the training
    metric `acc_0` counts so since stop 87, as SpecForge does), and per
    target-confidence band the share of positions and the head's (and the bigram's) accuracy there."""
    keep = agree["in_draft_vocab"]
    n_all = int(len(keep))
    correct, p1, tgt, nxt = (agree[k][keep] for k in ("correct", "target_p1", "target_token", "next_token"))
    big = None
    if bigram is not None:
        big = np.array([bigram.get(int(t), -1) for t in nxt]) == tgt
    rep = {"positions": n_all, "outside_draft_vocab": float(1 - keep.mean()) if n_all else 0.0,
           "acc_0": float(correct.mean()) if len(correct) else float("nan"),
           "accept_0": float(correct.sum() / n_all) if n_all else float("nan"),
           "target_top1_mean": float(p1.mean()) if len(p1) else float("nan"), "bands": []}
    if big is not None:
        rep["bigram_acc"] = float(big.mean()) if len(big) else float("nan")
    for lo, hi in zip(bands[:-1], bands[1:]):
        sel = (p1 >= lo) & ((p1 < hi) | (hi >= bands[-1]))
        band = {"target_top1": [lo, hi], "share": float(sel.mean()) if len(sel) else 0.0,
                "head_acc": float(correct[sel].mean()) if sel.any() else None}
        if big is not None:
            band["bigram_acc"] = float(big[sel].mean()) if sel.any() else None
        rep["bands"].append(band)
    return rep


def markdown(rep: dict) -> str:
    big = "bigram_acc" in rep
    lines = [f"positions: {rep['positions']}; target token outside the draft vocabulary: "
             f"{rep['outside_draft_vocab']:.1%}; head acc_0 {rep['acc_0']:.3f} (accept_0 over all "
             f"positions {rep['accept_0']:.3f})"
             + (f"; bigram baseline {rep['bigram_acc']:.3f}" if big else "")
             + f"; mean target top-1 probability {rep['target_top1_mean']:.3f}", "",
             "| target top-1 prob | share of positions | head acc_0 |" + (" bigram acc |" if big else ""),
             "|---|---|---|" + ("---|" if big else "")]
    fmt = lambda x: "–" if x is None else f"{x:.3f}"
    for b in rep["bands"]:
        lo, hi = b["target_top1"]
        lines.append(f"| [{lo:.1f}, {hi:.1f}) | {b['share']:.1%} | {fmt(b['head_acc'])} |"
                     + (f" {fmt(b['bigram_acc'])} |" if big else ""))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle_jax.training.diagnose", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="JSONL conversations (ShareGPT or messages), e.g. a held-out split")
    ap.add_argument("--drafter", default="default", help="a drafter directory (released EAGLE layout) or 'default'")
    ap.add_argument("--kind", choices=("eagle3", "eagle1"), default="eagle3", help="which packaged head 'default' is")
    ap.add_argument("--model", default=None, help="target (default: the packaged default target)")
    ap.add_argument("--bigram-from", default=None, help="JSONL conversations to build the bigram baseline from")
    ap.add_argument("--limit", type=int, default=None, help="first N conversations of --data")
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from ..draft.checkpoint import load_drafter
    from ..engine import DEFAULT_MODEL, default_drafter_path
    from ..models.checkpoint import load_hf_dir
    from ..models.registry import resolve_model
    from .data import load_examples

    model = args.model or DEFAULT_MODEL
    path = resolve_model(model)
    tcfg, tparams = load_hf_dir(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    drafter = args.drafter
    if drafter == "default":
        found = default_drafter_path(model, args.kind)
        if found is None:
            ap.error(f"no default {args.kind} drafter is packaged for {model!r}; pass --drafter PATH")
        drafter = str(found)
    head = load_drafter(drafter, tcfg)
    examples = load_examples(args.data, tok, args.seq_len)[:args.limit]
    agree = head_agreement(head, tparams, tcfg, examples, args.seq_len, args.batch_size, progress=True)
    bigram = bigram_table(load_examples(args.bigram_from, tok, args.seq_len)) if args.bigram_from else None
    rep = summarize(agree, bigram)
    rep.update(drafter=drafter, data=args.data, conversations=len(examples))
    print(markdown(rep), file=sys.stderr)
    if args.json:
        print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
