"""Training data for EAGLE heads: conversations in, padded token batches out.

* `load_conversations(path)` reads JSONL (plain, or gzip-compressed when the name ends in `.gz`) in the
  ShareGPT layout
  (`{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`) or the UltraChat/OpenAI
  layout (`{"id", "messages": [{"role": "user"|"assistant"|"system", "content"}]}`) into
  `{"id", "messages": [{"role", "content"}], ...}`. A malformed line is never dropped silently: it
  raises `ValueError("file:line: problem")` (`on_error="raise"`) or is reported on stderr with its
  line number and counted (`on_error="skip"`, the default).
* `tokenize_conversation(tokenizer, messages, max_len)` applies the target's chat template and
  marks the assistant tokens: `loss_mask[t] = 1` iff token t belongs to an assistant reply (its
  content and its end-of-turn token, e.g. `<|im_end|>`; never the role header, the newline the
  template writes after the turn, or a system/user turn). The spans come from rendering the
  conversation prefix by prefix (where a template is not prefix-stable, e.g. Qwen3's, which writes an
  empty `<think>` block in the last assistant turn only, each reply is located in the full rendering
  instead) and mapping character spans to tokens through the fast tokenizer's offsets, so BPE merges
  across a boundary cannot shift the mask.
* `make_dataset(examples, batch_size, seq_len, seed, ...)` is a grain pipeline (shard by process →
  shuffle → repeat → pad → batch) whose iterator yields static-shape numpy batches
  `{"input_ids": int32 [B, L], "loss_mask": float32 [B, L], "lengths": int32 [B]}` and supports
  `get_state()` / `set_state()` for deterministic resume.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


class ConversationError(ValueError):
    """One line of a conversation file is malformed (the message names the problem)."""


class ReplyNotFound(ValueError):
    """An assistant reply's text is not where the chat template's rendering should hold it (the
    template rewrote it in a turn that is not prefix-stable), so its tokens cannot be located."""


def _warn(msg: str) -> None:
    print(f"[eagle_jax.data] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- reading
def normalize_conversation(obj) -> dict:
    """One parsed JSON line → `{"id", "messages", **other fields}`; ConversationError if malformed.

    Accepts the ShareGPT layout (`conversations` of `{"from", "value"}`) and the `messages` layout
    (`{"role", "content"}`). Roles are mapped to user / assistant / system; a conversation must
    have at least one assistant turn with text, and system turns may only come first.
    """
    if not isinstance(obj, dict):
        raise ConversationError(f"expected a JSON object, got {type(obj).__name__}")
    if "conversations" in obj:
        turns, key, role_key, text_key = obj["conversations"], "conversations", "from", "value"
    elif "messages" in obj:
        turns, key, role_key, text_key = obj["messages"], "messages", "role", "content"
    else:
        raise ConversationError("no 'conversations' (ShareGPT) or 'messages' field")
    if not isinstance(turns, list):
        raise ConversationError(f"'{key}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise ConversationError(f"empty conversation ('{key}' is [])")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ConversationError(f"{key}[{i}] is not an object")
        if role_key not in turn:
            raise ConversationError(f"{key}[{i}] has no '{role_key}' field")
        if text_key not in turn:
            raise ConversationError(f"{key}[{i}] has no '{text_key}' field")
        raw_role, text = turn[role_key], turn[text_key]
        role = ROLE_ALIASES.get(str(raw_role).lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise ConversationError(f"{key}[{i}] has unknown role {raw_role!r} "
                                    f"(expected one of human/gpt/system/user/assistant)")
        if not isinstance(text, str):
            raise ConversationError(f"{key}[{i}].{text_key} must be a string, got {type(text).__name__}")
        if role == "system" and messages and messages[-1]["role"] != "system":
            raise ConversationError(f"{key}[{i}] is a system turn after the conversation started")
        messages.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise ConversationError("no assistant turn with text (nothing to train on)")
    out = {k: v for k, v in obj.items() if k not in ("conversations", "messages")}
    out["messages"] = messages
    return out


def load_conversations(path, on_error: str = "skip", stats: Optional[dict] = None) -> list[dict]:
    """Read a JSONL file of conversations (ShareGPT or `messages` layout; see module docstring).

    on_error: "raise" → ValueError naming `file:line` and the problem at the first bad line;
      "skip" → each bad line is reported on stderr with `file:line` and skipped, then a summary
      line gives the count. Blank lines are ignored. Lines without an id get `"<file stem>-<line>"`.
    stats: if given, filled with {"lines", "loaded", "skipped", "errors": [(line, problem), ...]}.
    """
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    path = Path(path)
    out, errors, n_lines = [], [], 0
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            n_lines += 1
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConversationError(f"bad JSON ({e.msg} at column {e.colno})") from None
                conv = normalize_conversation(obj)
            except ConversationError as e:
                where = f"{path}:{lineno}"
                if on_error == "raise":
                    raise ValueError(f"{where}: {e}") from None
                _warn(f"{where}: skipped: {e}")
                errors.append((lineno, str(e)))
                continue
            conv.setdefault("id", f"{Path(path.name.removesuffix('.gz')).stem}-{lineno}")
            out.append(conv)
    if errors:
        _warn(f"{path}: skipped {len(errors)} malformed line(s) of {n_lines}; loaded {len(out)}")
    if stats is not None:
        stats.update(lines=n_lines, loaded=len(out), skipped=len(errors), errors=errors)
    return out


# ---------------------------------------------------------------------------------- tokenizing
def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _end_of_turn_text(tokenizer) -> Optional[str]:
    tok = getattr(tokenizer, "eos_token", None)
    return tok if isinstance(tok, str) and tok else None


def _through_eot(text: str, end: int, eot: Optional[str]) -> int:
    """`end`, moved past the end-of-turn text when it follows (after optional whitespace)."""
    mt = re.match(r"\s*" + re.escape(eot), text[end:]) if eot else None
    return end + mt.end() if mt else end


def assistant_char_spans(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [(start, end)] character spans of each assistant reply incl. end-of-turn).

    Renders messages[:i] and messages[:i+1]. Where the template is prefix-stable at reply i (the
    second extends the first and the full rendering extends the second), the reply's content is
    located after the prefix (if the template rewrote it: everything after the generation prompt).
    Otherwise (Qwen3's template gives only the last assistant turn an empty `<think>` block, so a
    reply renders differently once a later user turn exists) the content is searched in the full
    rendering, from where messages[:i]'s rendering departs from it (and not before the previous
    reply's end) to the next end-of-turn text; ReplyNotFound if it is not there. The end-of-turn
    token (the tokenizer's eos text) is included when it follows the content (after optional
    whitespace).
    """
    eot = _end_of_turn_text(tokenizer)
    full = _render(tokenizer, messages)
    spans, last_end = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"]:
            continue
        prev = _render(tokenizer, messages[:i])
        cur = _render(tokenizer, messages[:i + 1])
        if cur.startswith(prev) and full.startswith(cur):
            start = cur.find(m["content"], len(prev))
            if start >= 0:
                end = _through_eot(cur, start + len(m["content"]), eot)
            else:  # the template rewrote the content: take everything after the generation prompt
                gen = _render(tokenizer, messages[:i], add_generation_prompt=True)
                start = len(gen) if cur.startswith(gen) else len(prev)
                end = len(cur.rstrip())
        else:
            lo = max(last_end, len(os.path.commonprefix([prev, full])))
            hi = full.find(eot, lo) if eot else -1
            start = full.find(m["content"], lo, len(full) if hi < 0 else hi)
            if start < 0:
                raise ReplyNotFound(f"the text of assistant turn {i} is not in its turn of the chat template's "
                                    f"rendering (the template is not prefix-stable and rewrote it)")
            end = _through_eot(full, start + len(m["content"]), eot)
        spans.append((start, end))
        last_end = end
    return full, spans


def tokenize_conversation(tokenizer, messages: Sequence[dict], max_len: int,
                          truncated: bool = False) -> Optional[dict]:
    """Chat-template a conversation; returns {"input_ids": int32 [L], "loss_mask": float32 [L]} with
    L <= max_len, or None when no assistant token falls within the first max_len tokens.

    loss_mask[t] = 1 iff token t is part of an assistant reply (content + end-of-turn token).
    truncated: the last reply was cut off by a generation limit, so its end-of-turn token is not a
    real prediction target and stays unmasked. ReplyNotFound: a reply cannot be located (see
    `assistant_char_spans`).
    """
    ex, _ = _tokenize(tokenizer, messages, max_len, truncated)
    return ex


def _tokenize(tokenizer, messages, max_len, truncated):
    full, spans = assistant_char_spans(tokenizer, messages)
    if truncated and spans:
        last_i = max(i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"])
        content = messages[last_i]["content"]
        s, _ = spans[-1]
        spans[-1] = (s, s + len(content))
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], np.int32)
        offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), np.float32)
        for s, e in spans:
            # a token belongs to the reply if its characters overlap the span (empty-offset tokens never do)
            mask[(offsets[:, 0] < e) & (offsets[:, 1] > s) & (offsets[:, 1] > offsets[:, 0])] = 1.0
    else:  # slow tokenizers have no offsets: diff the token counts of text prefixes
        n_tok = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)
        ids = np.asarray(tokenizer(full, add_special_tokens=False).input_ids, np.int32)
        mask = np.zeros(len(ids), np.float32)
        for s, e in spans:
            mask[n_tok(full[:s]):n_tok(full[:e])] = 1.0
    n_full = len(ids)
    ids, mask = ids[:max_len], mask[:max_len]
    if not mask.any():
        return None, n_full
    return {"input_ids": ids, "loss_mask": mask}, n_full


def tokenize_conversations(tokenizer, conversations: Iterable[dict], max_len: int,
                           stats: Optional[dict] = None, progress: bool = False) -> list[dict]:
    """Tokenize many conversations (`{"id", "messages", ...}`); conversations whose first assistant
    token lies past max_len, or one of whose replies the chat template's rendering does not hold
    (ReplyNotFound), are dropped and counted (reported on stderr). Each example keeps its id:
    {"id", "input_ids", "loss_mask"}. stats gets {"examples", "dropped_too_long",
    "dropped_unlocated", "truncated", "tokens", "assistant_tokens"}."""
    out, dropped, unlocated, cut = [], [], [], 0
    convs = list(conversations)
    it = convs
    if progress:
        from tqdm import tqdm

        it = tqdm(convs, desc="tokenizing", file=sys.stderr, unit="conv")
    for c in it:
        try:
            ex, full_len = _tokenize(tokenizer, c["messages"], max_len, truncated=c.get("finish") == "length")
        except ReplyNotFound:
            unlocated.append(c.get("id"))
            continue
        if ex is None:
            dropped.append(c.get("id"))
            continue
        cut += full_len > max_len
        ex["id"] = c.get("id")
        out.append(ex)
    if dropped:
        _warn(f"dropped {len(dropped)} conversation(s) whose first assistant token is past max_len={max_len} "
              f"(e.g. {dropped[:3]})")
    if unlocated:
        _warn(f"dropped {len(unlocated)} conversation(s) with an assistant reply that the chat template rewrote "
              f"(its text is not in the rendering, e.g. {unlocated[:3]})")
    if stats is not None:
        stats.update(examples=len(out), dropped_too_long=len(dropped), dropped_unlocated=len(unlocated),
                     truncated=int(cut),
                     tokens=int(sum(len(e["input_ids"]) for e in out)),
                     assistant_tokens=int(sum(e["loss_mask"].sum() for e in out)))
    return out


def load_examples(path, tokenizer, max_len: int, on_error: str = "skip", stats: Optional[dict] = None,
                  progress: bool = False) -> list[dict]:
    """`load_conversations` + `tokenize_conversations`: a JSONL file, or a list of them read in order
    (e.g. datasets generated in several sessions), → tokenized examples. An id that an earlier file
    already had is an error: the files overlap. stats gets {"load": ..., "tokenize": ...}."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    load_st, tok_st = {}, {}
    convs, seen = [], {}
    for p in paths:
        st: dict = {}
        for c in load_conversations(p, on_error=on_error, stats=st):
            if c["id"] in seen:
                raise ValueError(f"{p}: conversation id {c['id']!r} is also in {seen[c['id']]}: the files overlap "
                                 f"(a line without an id is named '<file stem>-<line>')")
            seen[c["id"]] = p
            convs.append(c)
        load_st = st if len(paths) == 1 else {**load_st, str(p): st}
    out = tokenize_conversations(tokenizer, convs, max_len, stats=tok_st, progress=progress)
    if stats is not None:
        stats.update(load=load_st, tokenize=tok_st)
    return out


# ---------------------------------------------------------------------------------- batching
def pad_example(ex: dict, seq_len: int, pad_id: int = 0) -> dict:
    """Right-pad (or cut) one example to seq_len: {"input_ids", "loss_mask", "lengths"}."""
    ids = np.asarray(ex["input_ids"], np.int32)[:seq_len]
    mask = np.asarray(ex["loss_mask"], np.float32)[:seq_len]
    n = len(ids)
    out_ids = np.full((seq_len,), pad_id, np.int32)
    out_mask = np.zeros((seq_len,), np.float32)
    out_ids[:n], out_mask[:n] = ids, mask
    return {"input_ids": out_ids, "loss_mask": out_mask, "lengths": np.int32(n)}


def pack_plan(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Rows of example indices whose (cut) lengths fit `seq_len` together: first-fit decreasing
    (ties by index, so the plan is deterministic). Each example appears exactly once."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    order = sorted(range(len(lengths)), key=lambda i: (-min(lengths[i], seq_len), i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = min(lengths[i], seq_len)
        for r, f in enumerate(free):
            if n <= f:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(seq_len - n)
    return rows


def pack_row(exs: Sequence[dict], seq_len: int, pad_id: int = 0) -> dict:
    """Several examples in one row of seq_len: `pad_example`'s keys plus "segment_ids" (1, 2, ... per
    example, 0 on padding) and "positions" (restarting at 0 in each example). The objectives keep
    the examples apart: attention stays inside a segment and no target crosses a boundary, so a
    packed row scores exactly what its examples would score in rows of their own."""
    out = pad_example({"input_ids": [], "loss_mask": []}, seq_len, pad_id)
    seg = np.zeros((seq_len,), np.int32)
    pos = np.zeros((seq_len,), np.int32)
    at = 0
    for k, ex in enumerate(exs):
        row = pad_example(ex, seq_len, pad_id)
        n = int(row["lengths"])
        if at + n > seq_len:
            raise ValueError(f"examples of {at + n} tokens do not fit one row of {seq_len}")
        out["input_ids"][at:at + n] = row["input_ids"][:n]
        out["loss_mask"][at:at + n] = row["loss_mask"][:n]
        seg[at:at + n], pos[at:at + n] = k + 1, np.arange(n)
        at += n
    out["lengths"] = np.int32(at)
    out["segment_ids"], out["positions"] = seg, pos
    return out


def _stack_batch(rows: Sequence[dict], batch_size: int, seq_len: int, pad_id: int) -> dict:
    """Stack padded rows; a short final batch is filled with empty rows (length 0, mask 0, zeros in
    any attached arrays) so every batch has the static shape [batch_size, seq_len, ...]."""
    out = {"input_ids": np.full((batch_size, seq_len), pad_id, np.int32),
           "loss_mask": np.zeros((batch_size, seq_len), np.float32),
           "lengths": np.zeros((batch_size,), np.int32)}
    for k, v in (rows[0].items() if rows else ()):
        if k not in out:
            out[k] = np.zeros((batch_size,) + np.shape(v), np.asarray(v).dtype)
    for i, r in enumerate(rows):
        for k in out:
            out[k][i] = r[k]
    return out


def _default_shard():
    import jax

    return jax.process_index(), jax.process_count()


def make_dataset(examples: Sequence[dict], batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                 num_epochs: Optional[int] = None, shard_index: Optional[int] = None,
                 shard_count: Optional[int] = None, drop_remainder: bool = True, pad_id: int = 0,
                 read_options=None, pack: bool = False, attach: Optional[Callable[[list, dict], dict]] = None,
                 stats: Optional[dict] = None):
    """A grain iterator over padded batches of `examples` (dicts with input_ids / loss_mask).

    Pipeline: MapDataset.source → this process's shard (`ds[shard_index::shard_count]`, by default
    jax.process_index() of jax.process_count(): disjoint shards that together cover the data) →
    shuffle(seed) → repeat(num_epochs; None = forever, reshuffled each epoch) → pad to seq_len →
    batch(batch_size). With drop_remainder=False a short last batch is padded with empty rows, so
    shapes never change. Returns a `grain.DatasetIterator`: `next(it)` gives
    {"input_ids": int32 [B, L], "loss_mask": float32 [B, L], "lengths": int32 [B]};
    `it.get_state()` / `it.set_state(state)` resume deterministically (restoring a saved state in a
    fresh iterator built with the same arguments yields the same next batches).
    pack=True: the elements are rows of several examples (`pack_plan` over this process's shard,
    `pack_row`), which add "segment_ids" and "positions" [B, L] to the batch.
    attach(indices, row) -> dict: more per-row arrays for the batch (e.g. cached target features),
    given the row's example indices (into `examples`, in row order) and its padded/packed arrays.
    stats: filled with {"examples": this shard's examples, "rows": elements per epoch}.
    """
    import grain

    if shard_index is None or shard_count is None:
        di, dc = _default_shard()
        shard_index = di if shard_index is None else shard_index
        shard_count = dc if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, {shard_count}), got {shard_index}")
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if len(examples) < shard_count:
        raise ValueError(f"{len(examples)} examples cannot be sharded over {shard_count} processes")
    mine = list(range(len(examples)))[shard_index::shard_count]
    if pack:
        rows = [[mine[k] for k in row] for row in pack_plan([len(examples[i]["input_ids"]) for i in mine], seq_len)]
    else:
        rows = [[i] for i in mine]
    if stats is not None:
        stats.update(examples=len(mine), rows=len(rows))

    def build(idx: list) -> dict:
        row = (pack_row([examples[i] for i in idx], seq_len, pad_id) if pack
               else pad_example(examples[idx[0]], seq_len, pad_id))
        if attach is not None:
            row.update(attach(idx, row))
        return row

    ds = grain.MapDataset.source(rows)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    ds = ds.map(build).batch(batch_size, drop_remainder=drop_remainder,
                             batch_fn=lambda rs: _stack_batch(rs, batch_size, seq_len, pad_id))
    if read_options is None:  # grain's default (16 threads, 500 elements ahead) starves a small host
        read_options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    return iter(ds.to_iter_dataset(read_options))
