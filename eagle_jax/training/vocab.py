"""The EAGLE-3 draft vocabulary: the most frequent target tokens of the training data.

`build_draft_vocab` returns the released-checkpoint mapping: `d2t [Vd] int32` with
`target_id = i + d2t[i]` for draft id i (draft ids are the chosen target ids in increasing order),
and `t2d [V] bool` marking the target ids that are in the draft vocabulary.
"""

from __future__ import annotations

from typing import Iterable, Sequence, Union

import numpy as np


def count_tokens(examples: Iterable, vocab_size: int, assistant_only: bool = True) -> np.ndarray:
    """Token frequencies [vocab_size] int64 over examples.

    examples: dicts with "input_ids" (and "loss_mask" when assistant_only: only tokens with mask > 0
    count, i.e. the tokens the drafter learns to predict) or plain token-id arrays (all count).
    """
    counts = np.zeros((vocab_size,), np.int64)
    for ex in examples:
        if isinstance(ex, dict):
            ids = np.asarray(ex["input_ids"], np.int64).reshape(-1)
            if assistant_only and "loss_mask" in ex:
                ids = ids[np.asarray(ex["loss_mask"]).reshape(-1) > 0]
        else:
            ids = np.asarray(ex, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token id out of range [0, {vocab_size}): min {ids.min()}, max {ids.max()}")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(token_counts: Union[np.ndarray, Iterable], draft_vocab_size: int,
                      always_include: Sequence[int] = (),
                      vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(d2t [Vd] int32, t2d [V] bool): the `draft_vocab_size` most frequent target tokens.

    token_counts: counts [V] (e.g. from `count_tokens`), or an iterable of token-id arrays (then
      vocab_size is required). Ties are broken by the lower token id; `always_include` ids (EOS,
      end-of-turn, ...) are taken first whatever their count. When fewer than Vd tokens occur, the
      rest is filled by the lowest unseen ids (so the draft vocabulary always has size Vd).
    """
    if isinstance(token_counts, np.ndarray) and token_counts.ndim == 1:
        counts = token_counts.astype(np.int64)
    else:
        if vocab_size is None:
            raise ValueError("vocab_size is required when token_counts is an iterable of token arrays")
        counts = count_tokens(token_counts, vocab_size, assistant_only=False)
    v = counts.shape[0]
    if vocab_size is not None and vocab_size != v:
        raise ValueError(f"token_counts has {v} entries but vocab_size is {vocab_size}")
    if not 0 < draft_vocab_size <= v:
        raise ValueError(f"draft_vocab_size must be in (0, {v}], got {draft_vocab_size}")
    forced = sorted({int(t) for t in always_include})
    for t in forced:
        if not 0 <= t < v:
            raise ValueError(f"always_include id {t} is outside the vocabulary [0, {v})")
    if len(forced) > draft_vocab_size:
        raise ValueError(f"{len(forced)} always_include ids do not fit a draft vocabulary of {draft_vocab_size}")
    # descending count, then ascending id (lexsort sorts by the last key first)
    order = np.lexsort((np.arange(v), -counts))
    chosen = list(forced)
    taken = np.zeros((v,), bool)
    taken[forced] = True
    for t in order:
        if len(chosen) >= draft_vocab_size:
            break
        if not taken[t]:
            chosen.append(int(t))
            taken[t] = True
    ids = np.sort(np.asarray(chosen, np.int64))
    d2t = (ids - np.arange(draft_vocab_size)).astype(np.int32)
    return d2t, taken


def draft_to_target_ids(d2t: np.ndarray) -> np.ndarray:
    """Target ids of the draft vocabulary: i + d2t[i]."""
    return np.arange(len(d2t)) + np.asarray(d2t)


def vocab_coverage(token_counts: np.ndarray, t2d: np.ndarray) -> float:
    """Fraction of the counted tokens that the draft vocabulary covers."""
    total = float(np.sum(token_counts))
    return float(np.sum(token_counts[np.asarray(t2d, bool)])) / total if total else 0.0


def remap_draft_vocab(lm_head_dv: np.ndarray, old_d2t: np.ndarray, new_d2t: np.ndarray, embed_vd: np.ndarray,
                      ridge: float = 1e-2) -> tuple[np.ndarray, dict]:
    """A trained EAGLE-3 LM head [D, Vd_old] carried over to another draft vocabulary → [D, Vd_new].

    Tokens in both vocabularies keep their trained column exactly. A token new to the draft
    vocabulary starts from its target embedding mapped into the head's space by the ridge
    least-squares fit `embed @ A ≈ lm_head.T` over the shared tokens (its direction and scale then
    resemble the trained columns, instead of zero or noise). Returns (lm_head [D, Vd_new], stats).
    """
    old_ids = draft_to_target_ids(old_d2t)
    new_ids = draft_to_target_ids(new_d2t)
    w_vd = np.asarray(lm_head_dv, np.float32).T  # Vd_old D
    emb = np.asarray(embed_vd, np.float32)
    if w_vd.shape[0] != len(old_ids):
        raise ValueError(f"lm_head has {w_vd.shape[0]} columns but the old draft vocabulary {len(old_ids)} tokens")
    col = {int(t): i for i, t in enumerate(old_ids)}
    kept = np.array([int(t) in col for t in new_ids], bool)
    out = np.zeros((len(new_ids), w_vd.shape[1]), np.float32)
    out[kept] = w_vd[[col[int(t)] for t in new_ids[kept]]]
    if (~kept).any():
        shared = old_ids[np.isin(old_ids, new_ids)] if kept.any() else old_ids
        x, y = emb[shared], w_vd[[col[int(t)] for t in shared]]
        xtx = x.T @ x
        lam = ridge * np.trace(xtx) / xtx.shape[0]  # relative to the embeddings' own scale
        a = np.linalg.solve(xtx + lam * np.eye(xtx.shape[0], dtype=np.float32), x.T @ y)
        out[~kept] = emb[new_ids[~kept]] @ a
    return out.T, {"kept": int(kept.sum()), "new": int((~kept).sum()), "dropped": int(len(old_ids) - kept.sum())}
