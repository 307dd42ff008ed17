"""Training data: conversation loading, assistant-only masks, the grain pipeline, the draft
vocabulary and the self-distillation file handling (prompt sources: test_prompts.py). Fast: tiny tokenizers only
(plus the real SmolLM2 tokenizer when its converted directory is already cached)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from eagle_jax.training import data as D
from eagle_jax.training import distill_files as DF
from eagle_jax.training import selfdistill as SD
from eagle_jax.training import vocab as V

from conftest import write_tiny_tokenizer

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nw3 w4<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Qwen3's layout: only the last assistant turn (after the last user turn) gets an empty <think> block, so a
# conversation's prefix renders differently from the start of the whole; a reply's reasoning is dropped.
QWEN3 = ("{%- set ns = namespace(last_query=-1) %}"
         "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
         "{%- endfor %}"
         "{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
         "{%- set content = m['content'].split('</think>')[-1].lstrip('\n') %}{{- '<|im_start|>assistant\n' }}"
         "{%- if loop.last and loop.index0 > ns.last_query %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
         "{{- content + '<|im_end|>\n' }}"
         "{%- else %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endif %}"
         "{%- endfor %}"
         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path, 60)
    return AutoTokenizer.from_pretrained(str(path))


def word_tok(template, specials=()):
    """A word-level tokenizer over ChatML's special tokens (+ `specials`) and w7 … w79."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", *specials]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), 80)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>",
                                   bos_token="<|im_start|>", additional_special_tokens=["<|endoftext|>", *specials])
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def chatml_tok():
    """A word-level tokenizer with SmolLM2's ChatML layout: <|im_start|>role\\n ... <|im_end|>\\n."""
    return word_tok(CHATML)


@pytest.fixture(scope="module")
def qwen3_tok():
    """ChatML plus Qwen3's empty <think> block in the last assistant turn (a template that is not prefix-stable)."""
    return word_tok(QWEN3, ("<think>", "</think>"))


# ---------------------------------------------------------------------------------- loading
def test_load_both_layouts(tmp_path):
    p = write_lines(tmp_path / "c.jsonl", [
        json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}),
        json.dumps({"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "r"}], "source": "x"}),
        "",
        json.dumps({"id": 7, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "a"},
                                               {"from": "gpt", "value": "b"}, {"from": "human", "value": "c"},
                                               {"from": "gpt", "value": "d"}]}),
    ])
    stats = {}
    convs = D.load_conversations(p, on_error="raise", stats=stats)
    assert [c["id"] for c in convs] == ["a", "c-2", 7]
    assert convs[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert [m["role"] for m in convs[1]["messages"]] == ["system", "user", "assistant"]
    assert convs[1]["source"] == "x"
    assert [m["role"] for m in convs[2]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert stats == {"lines": 3, "loaded": 3, "skipped": 0, "errors": []}


BAD = [
    ('{"id": 1, "conversations": [', "bad JSON"),
    ('{"id": 1}', "no 'conversations'"),
    ('{"conversations": []}', "empty conversation"),
    ('{"conversations": [{"from": "human"}]}', "no 'value'"),
    ('{"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]}', "unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant turn"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}]}', "must be a string"),
    ('[1, 2]', "expected a JSON object"),
]
GOOD = json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]})


def test_gzip_files_and_lists_of_files(tmp_path, tiny_tok):
    """Datasets stored compressed (train/data/*.jsonl.gz) and several files read as one, in order;
    a conversation id in two files is an error (the files overlap), not a silent duplicate."""
    import gzip

    line = lambda i, a: json.dumps({"id": i, "conversations": [{"from": "human", "value": "w3 w4"},
                                                               {"from": "gpt", "value": a}]})
    plain = write_lines(tmp_path / "a.jsonl", [line("x", "w5 w6"), line("y", "w7")])
    packed = tmp_path / "b.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write(line("z", "w8 w9 w10") + "\n" + json.dumps({"conversations": [{"from": "gpt", "value": "w3"}]}) + "\n")
    assert [c["id"] for c in D.load_conversations(packed, on_error="raise")] == ["z", "b-2"]
    st = {}
    both = D.load_examples([plain, packed], tiny_tok, 64, on_error="raise", stats=st)
    one = D.load_examples(plain, tiny_tok, 64) + D.load_examples(packed, tiny_tok, 64)
    assert len(both) == 4 and set(st["load"]) == {str(plain), str(packed)}
    for a, b in zip(both, one, strict=True):
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    with pytest.raises(ValueError, match="'x' is also in .*overlap"):
        D.load_examples([plain, plain], tiny_tok, 64)


@pytest.mark.parametrize("line,problem", BAD)
def test_malformed_line_raise_names_file_line(tmp_path, line, problem):
    p = write_lines(tmp_path / "bad.jsonl", [GOOD, line, GOOD])
    with pytest.raises(ValueError) as e:
        D.load_conversations(p, on_error="raise")
    assert f"{p}:2:" in str(e.value) and problem in str(e.value)


def test_malformed_lines_skipped_and_reported(tmp_path, capsys):
    p = write_lines(tmp_path / "bad.jsonl", [GOOD] + [b for b, _ in BAD] + [GOOD])
    stats = {}
    convs = D.load_conversations(p, stats=stats)
    err = capsys.readouterr().err
    assert len(convs) == 2 and stats["skipped"] == len(BAD) and stats["lines"] == len(BAD) + 2
    for i, (_, problem) in enumerate(BAD, start=2):
        assert f"{p}:{i}: skipped: " in err and problem in err
    assert f"skipped {len(BAD)} malformed line(s)" in err
    assert [ln for ln, _ in stats["errors"]] == list(range(2, len(BAD) + 2))


def test_on_error_must_be_known(tmp_path):
    with pytest.raises(ValueError, match="on_error"):
        D.load_conversations(write_lines(tmp_path / "x.jsonl", [GOOD]), on_error="ignore")


# ---------------------------------------------------------------------------------- masks
def masked_text(tok, ex):
    ids = ex["input_ids"][ex["loss_mask"] > 0]
    return tok.decode(ids.tolist())


def mask_runs(ex):
    """Maximal runs of masked positions as (start, end)."""
    m = np.concatenate([[0], ex["loss_mask"], [0]])
    d = np.diff(m)
    return list(zip(np.where(d == 1)[0], np.where(d == -1)[0]))


def test_mask_single_turn_tiny(tiny_tok):
    msgs = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8 w9"}]
    ex = D.tokenize_conversation(tiny_tok, msgs, 64)
    assert ex["input_ids"].dtype == np.int32 and ex["loss_mask"].dtype == np.float32
    assert masked_text(tiny_tok, ex) == "w7 w8 w9 </s>"
    assert int(ex["loss_mask"].sum()) == 4 and ex["loss_mask"][-4:].all()


def test_mask_multi_turn_chatml(chatml_tok):
    msgs = [{"role": "user", "content": "w10 w11"}, {"role": "assistant", "content": "w12 w13 w14"},
            {"role": "user", "content": "w12 w15"}, {"role": "assistant", "content": "w16"}]
    ex = D.tokenize_conversation(chatml_tok, msgs, 256)
    runs = mask_runs(ex)
    assert len(runs) == 2
    got = [chatml_tok.decode(ex["input_ids"][s:e].tolist()) for s, e in runs]
    assert got == ["w12 w13 w14 <|im_end|>", "w16 <|im_end|>"]
    for s, _ in runs:  # the role header right before each reply is not masked
        assert chatml_tok.decode(ex["input_ids"][s - 2:s].tolist()) == "<|im_start|> assistant"
    # the same words in the user turn stay unmasked
    ids = ex["input_ids"].tolist()
    w12 = chatml_tok.convert_tokens_to_ids("w12")
    assert sorted(ex["loss_mask"][[i for i, t in enumerate(ids) if t == w12]].tolist()) == [0.0, 1.0]


def test_mask_with_system_turn(chatml_tok):
    msgs = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w21"},
            {"role": "assistant", "content": "w22 w23"}]
    ex = D.tokenize_conversation(chatml_tok, msgs, 256)
    assert masked_text(chatml_tok, ex) == "w22 w23 <|im_end|>"


def test_mask_smollm2_tokenizer():
    from eagle_jax.models import registry

    d = registry.alias_dir("smollm2-135m-instruct")
    if not (d / "tokenizer_config.json").exists():
        pytest.skip("the SmolLM2 conversion is not cached")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!\n\nHow  are you?"},
            {"role": "user", "content": "Fine."}, {"role": "assistant", "content": "def f(x):\n    return x"}]
    ex = D.tokenize_conversation(tok, msgs, 512)
    got = [tok.decode(ex["input_ids"][s:e].tolist()) for s, e in mask_runs(ex)]
    assert got == ["Hello!\n\nHow  are you?<|im_end|>", "def f(x):\n    return x<|im_end|>"]
    # the whole sequence is exactly what the engine's encode feeds the target for the prompt part
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False).input_ids
    assert ex["input_ids"][:len(p_ids)].tolist() == p_ids and not ex["loss_mask"][:len(p_ids)].any()


QWEN3_CHAT = [{"role": "system", "content": "w20"},
              {"role": "user", "content": "w12 w13 w10"}, {"role": "assistant", "content": "w12 w13"},
              {"role": "user", "content": "w14"}, {"role": "assistant", "content": "w15 w16 w17"},
              {"role": "user", "content": "w18 w19"}, {"role": "assistant", "content": "w18"}]


def test_mask_multi_turn_qwen3_think_block(qwen3_tok):
    """Qwen3's template is not prefix-stable (the <think> block of a turn's rendering as the last one is
    gone once a user turn follows): each reply is located in the full rendering, the mask covers
    exactly the replies (+ <|im_end|>), never the think block, the headers or the user's copy of a reply."""
    msgs = QWEN3_CHAT
    full = qwen3_tok.apply_chat_template(msgs, tokenize=False)
    assert not full.startswith(qwen3_tok.apply_chat_template(msgs[:3], tokenize=False))
    assert full.count("<think>") == 1
    ex = D.tokenize_conversation(qwen3_tok, msgs, 256)
    runs = mask_runs(ex)
    got = [qwen3_tok.decode(ex["input_ids"][s:e].tolist()) for s, e in runs]
    assert got == ["w12 w13 <|im_end|>", "w15 w16 w17 <|im_end|>", "w18 <|im_end|>"]
    before = [qwen3_tok.decode(ex["input_ids"][s - 2:s].tolist()) for s, _ in runs]
    assert before == ["<|im_start|> assistant", "<|im_start|> assistant", "<think> </think>"]
    assert int(ex["loss_mask"].sum()) == 3 + 4 + 2
    stats = {}
    out = D.tokenize_conversations(qwen3_tok, [{"id": "q", "messages": msgs}], 256, stats=stats)
    assert stats["examples"] == 1 and stats["dropped_unlocated"] == 0
    np.testing.assert_array_equal(out[0]["loss_mask"], ex["loss_mask"])


def test_unlocatable_reply_dropped_and_counted(qwen3_tok, capsys):
    """A reply the template rewrote in a turn that is not prefix-stable (Qwen3 drops an earlier turn's
    reasoning) cannot be located: that conversation is dropped and counted, the others are kept."""
    rewritten = [QWEN3_CHAT[1], {"role": "assistant", "content": "<think>w9</think>\n\nw10"}, *QWEN3_CHAT[3:5]]
    with pytest.raises(D.ReplyNotFound, match="assistant turn 1"):
        D.tokenize_conversation(qwen3_tok, rewritten, 256)
    stats = {}
    convs = [{"id": "bad", "messages": rewritten}, {"id": "good", "messages": QWEN3_CHAT}]
    out = D.tokenize_conversations(qwen3_tok, convs, 256, stats=stats)
    assert [e["id"] for e in out] == ["good"]
    assert stats["examples"] == 1 and stats["dropped_unlocated"] == 1 and stats["dropped_too_long"] == 0
    assert "dropped 1 conversation(s) with an assistant reply that the chat template rewrote" in capsys.readouterr().err


def _spans_before_the_fix(tokenizer, messages):
    """The prefix-by-prefix location of replies that every prefix-stable template used before."""
    eot = tokenizer.eos_token
    def render(ms, gen=False):
        return tokenizer.apply_chat_template(ms, tokenize=False, add_generation_prompt=gen) if ms else ""

    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or not m["content"]:
            continue
        prev, cur = render(messages[:i]), render(messages[:i + 1])
        start = cur.find(m["content"], len(prev))
        if start >= 0:
            end = start + len(m["content"])
            mt = re.match(r"\s*" + re.escape(eot), cur[end:])
            end += mt.end() if mt else 0
        else:
            gen = render(messages[:i], True)
            start, end = len(gen) if cur.startswith(gen) else len(prev), len(cur.rstrip())
        spans.append((start, end))
    return render(messages), spans


def test_prefix_stable_templates_keep_their_masks(chatml_tok, tiny_tok, monkeypatch):
    """For prefix-stable templates the masks are the ones of the prefix-by-prefix location: a reply
    whose text the user turn before it already holds, and a template that rewrites replies."""
    upper = word_tok(CHATML.replace("message['content'] + '<|im_end|>'", "message['content'] | upper + '<|im_end|>'"))
    convs = [QWEN3_CHAT, [{"role": "user", "content": "w30 w31"}, {"role": "assistant", "content": "w30 w31"},
                          {"role": "user", "content": "w32 w30"}, {"role": "assistant", "content": "w30"}],
             [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w5"}]]
    cases = [(tok, msgs) for tok in (chatml_tok, tiny_tok, upper) for msgs in convs]
    got = [D.tokenize_conversation(tok, msgs, 256) for tok, msgs in cases]
    monkeypatch.setattr(D, "assistant_char_spans", _spans_before_the_fix)
    want = [D.tokenize_conversation(tok, msgs, 256) for tok, msgs in cases]
    for (tok, msgs), g, w in zip(cases, got, want, strict=True):
        np.testing.assert_array_equal(g["input_ids"], w["input_ids"])
        np.testing.assert_array_equal(g["loss_mask"], w["loss_mask"])
    assert masked_text(upper, got[-1]) == "<unk> <|im_end|>"  # the rewritten reply: all after the header


def test_truncation_and_drop(tiny_tok, capsys):
    msgs = [{"role": "user", "content": "w5 w6 w7 w8 w9"}, {"role": "assistant", "content": "w10 w11 w12"}]
    full = D.tokenize_conversation(tiny_tok, msgs, 100)
    n = len(full["input_ids"])
    first = int(np.argmax(full["loss_mask"]))
    cut = D.tokenize_conversation(tiny_tok, msgs, first + 2)
    assert len(cut["input_ids"]) == first + 2 and cut["loss_mask"].sum() == 2
    assert np.array_equal(cut["input_ids"], full["input_ids"][:first + 2])
    assert D.tokenize_conversation(tiny_tok, msgs, first) is None
    stats = {}
    convs = [{"id": "a", "messages": msgs},
             {"id": "b", "messages": msgs[:1] + [{"role": "assistant", "content": "w13"}]}]
    exs = D.tokenize_conversations(tiny_tok, convs, first, stats=stats)
    assert exs == [] and stats["dropped_too_long"] == 2
    assert "dropped 2 conversation(s)" in capsys.readouterr().err
    exs = D.tokenize_conversations(tiny_tok, convs, n - 1, stats=stats)
    assert [e["id"] for e in exs] == ["a", "b"] and stats["truncated"] == 1 and stats["dropped_too_long"] == 0


def test_truncated_reply_keeps_eos_unmasked(tiny_tok):
    msgs = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    assert masked_text(tiny_tok, D.tokenize_conversation(tiny_tok, msgs, 64, truncated=True)) == "w6 w7"
    conv = {"id": "x", "messages": msgs, "finish": "length"}
    assert masked_text(tiny_tok, D.tokenize_conversations(tiny_tok, [conv], 64)[0]) == "w6 w7"


# ---------------------------------------------------------------------------------- grain
def toy_examples(n=37, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(3, 20))
        ids = rng.integers(1, 50, size=length).astype(np.int32)
        ids[0] = 1000 + i  # identifies the example
        mask = (rng.random(length) < 0.5).astype(np.float32)
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def batch_ids(b):
    return [int(x) for x, n in zip(b["input_ids"][:, 0], b["lengths"]) if n > 0]


def test_batches_static_and_padded():
    exs = toy_examples()
    it = D.make_dataset(exs, batch_size=4, seq_len=16, seed=0, shard_index=0, shard_count=1)
    b = next(it)
    assert b["input_ids"].shape == (4, 16) and b["input_ids"].dtype == np.int32
    assert b["loss_mask"].shape == (4, 16) and b["loss_mask"].dtype == np.float32
    assert b["lengths"].shape == (4,) and b["lengths"].dtype == np.int32
    for row in range(4):
        ex = exs[int(b["input_ids"][row, 0]) - 1000]
        n = min(len(ex["input_ids"]), 16)
        assert b["lengths"][row] == n
        assert np.array_equal(b["input_ids"][row, :n], ex["input_ids"][:n]) and not b["input_ids"][row, n:].any()
        assert np.array_equal(b["loss_mask"][row, :n], ex["loss_mask"][:n]) and not b["loss_mask"][row, n:].any()


def test_deterministic_resume():
    exs = toy_examples()
    kw = dict(batch_size=4, seq_len=16, seed=3, shard_index=0, shard_count=1)
    it = D.make_dataset(exs, **kw)
    for _ in range(12):  # past the first epoch (37 examples): reshuffled epochs too
        next(it)
    state = it.get_state()
    expect = [next(it) for _ in range(6)]
    fresh = D.make_dataset(exs, **kw)
    fresh.set_state(json.loads(json.dumps(state)) if _jsonable(state) else state)
    got = [next(fresh) for _ in range(6)]
    for a, b in zip(expect, got):
        for k in a:
            assert np.array_equal(a[k], b[k])
    other = D.make_dataset(exs, **{**kw, "seed": 4})
    assert batch_ids(next(other)) != batch_ids(next(D.make_dataset(exs, **kw)))


def _jsonable(x):
    try:
        json.dumps(x)
        return True
    except TypeError:
        return False


def test_epochs_reshuffle_and_cover():
    exs = toy_examples(20)
    it = D.make_dataset(exs, batch_size=5, seq_len=8, seed=0, shard_index=0, shard_count=1)
    e1 = sum((batch_ids(next(it)) for _ in range(4)), [])
    e2 = sum((batch_ids(next(it)) for _ in range(4)), [])
    assert sorted(e1) == sorted(e2) == list(range(1000, 1020)) and e1 != e2


def test_process_shards_disjoint_and_cover():
    exs = toy_examples(37)
    seen = []
    for shard in range(2):
        it = D.make_dataset(exs, batch_size=4, seq_len=8, seed=0, num_epochs=1, shard_index=shard, shard_count=2,
                            drop_remainder=False)
        ids = sum((batch_ids(b) for b in it), [])
        assert len(ids) == len(set(ids))
        seen.append(set(ids))
    assert not (seen[0] & seen[1]) and seen[0] | seen[1] == set(range(1000, 1037))
    with pytest.raises(ValueError, match="shard_index"):
        D.make_dataset(exs, 4, 8, shard_index=2, shard_count=2)


def test_short_last_batch_padded_with_empty_rows():
    it = D.make_dataset(toy_examples(6), batch_size=4, seq_len=8, seed=0, num_epochs=1, shuffle=False,
                        shard_index=0, shard_count=1, drop_remainder=False)
    batches = list(it)
    assert len(batches) == 2 and batches[1]["input_ids"].shape == (4, 8)
    assert batches[1]["lengths"].tolist()[2:] == [0, 0] and not batches[1]["loss_mask"][2:].any()


def test_pack_plan_fits_and_covers_once():
    lengths = [9, 3, 16, 20, 5, 7, 1, 8, 12, 4]
    plan = D.pack_plan(lengths, 16)
    flat = sorted(i for row in plan for i in row)
    assert flat == list(range(len(lengths)))
    assert all(sum(min(lengths[i], 16) for i in row) <= 16 for row in plan)
    assert len(plan) == 6  # first-fit decreasing: 16 and 20 alone; 12+4, 9+7, 8+5+3; then 1 on its own
    assert D.pack_plan(lengths, 16) == plan  # deterministic


def test_pack_row_segments_and_positions():
    exs = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [0, 1]}]
    r = D.pack_row(exs, 8)
    assert r["input_ids"].tolist() == [5, 6, 7, 8, 9, 0, 0, 0] and r["lengths"] == 5
    assert r["loss_mask"].tolist() == [0, 1, 1, 0, 1, 0, 0, 0]
    assert r["segment_ids"].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert r["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="do not fit"):
        D.pack_row(exs + exs, 8)


def test_packed_dataset_covers_every_example_once_per_epoch():
    exs = toy_examples(37)
    it = D.make_dataset(exs, batch_size=3, seq_len=16, seed=0, num_epochs=1, shard_index=0, shard_count=1,
                        drop_remainder=False, pack=True)
    seen, rows = [], 0
    for b in it:
        assert b["segment_ids"].shape == b["positions"].shape == (3, 16)
        for r in range(3):
            seg = b["segment_ids"][r]
            for k in range(1, seg.max() + 1):
                at = np.flatnonzero(seg == k)
                ex = exs[int(b["input_ids"][r, at[0]]) - 1000]
                n = min(len(ex["input_ids"]), 16)
                assert len(at) == n and b["positions"][r, at].tolist() == list(range(n))
                assert np.array_equal(b["input_ids"][r, at], ex["input_ids"][:n])
                assert np.array_equal(b["loss_mask"][r, at], ex["loss_mask"][:n])
                seen.append(int(b["input_ids"][r, at[0]]))
            rows += int(b["lengths"][r] > 0)
    assert sorted(seen) == list(range(1000, 1037)) and rows < 37


# ---------------------------------------------------------------------------------- vocab
def test_draft_vocab_order_ties_and_mapping():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3], np.int64)
    d2t, t2d = V.build_draft_vocab(counts, 4)
    target = V.draft_to_target_ids(d2t)
    assert target.tolist() == [0, 2, 3, 5]  # 9, 9 (tie: lower id first), 7, 5; sorted by id
    assert d2t.dtype == np.int32 and d2t.tolist() == [0, 1, 1, 2]
    assert t2d.dtype == bool and np.flatnonzero(t2d).tolist() == target.tolist()
    # ties at the cut: 3 of {2, 3} with equal counts → the lower id wins
    assert V.draft_to_target_ids(V.build_draft_vocab(counts, 1)[0]).tolist() == [2]
    # round trip: every draft id maps to a target id in t2d and back to its index
    t2d_index = np.cumsum(t2d) - 1
    assert all(t2d_index[t] == i for i, t in enumerate(target))


def test_draft_vocab_always_include_and_fill():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3], np.int64)
    d2t, t2d = V.build_draft_vocab(counts, 3, always_include=(6,))
    assert V.draft_to_target_ids(d2t).tolist() == [2, 3, 6]
    d2t, _ = V.build_draft_vocab(np.array([0, 4, 0, 0, 2]), 4)  # unseen ids fill the rest, lowest first
    assert V.draft_to_target_ids(d2t).tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError):
        V.build_draft_vocab(counts, 9)
    with pytest.raises(ValueError):
        V.build_draft_vocab(counts, 2, always_include=(1, 3, 4))


def test_count_tokens_assistant_only():
    exs = [{"input_ids": np.array([1, 2, 3, 3]), "loss_mask": np.array([0, 0, 1, 1], np.float32)},
           {"input_ids": np.array([2, 4]), "loss_mask": np.array([1, 0], np.float32)}]
    assert V.count_tokens(exs, 6).tolist() == [0, 0, 1, 2, 0, 0]
    assert V.count_tokens(exs, 6, assistant_only=False).tolist() == [0, 1, 2, 2, 1, 0]
    d2t, _ = V.build_draft_vocab([np.array([4, 4, 1])], 2, vocab_size=6)
    assert V.draft_to_target_ids(d2t).tolist() == [1, 4]


# ---------------------------------------------------------------------------------- self-distill files
def test_plan_batches_cover_once():
    lengths = list(np.random.default_rng(0).integers(5, 300, size=53))
    batches = SD.plan_batches(lengths, 8, seed=1)
    flat = sum(batches, [])
    assert sorted(flat) == list(range(53)) and all(len(b) <= 8 for b in batches)


def test_resume_files_and_splits(tmp_path):
    gen = tmp_path / "generated.jsonl"
    row = lambda i, split: {"id": i, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
                            "source": "s", "split": split, "finish": "stop", "new_tokens": 3}
    DF.append_jsonl(gen, [row("a", "train"), row("b", "eval")])
    with open(gen, "a") as f:
        f.write('{"id": "c", "conv')  # a run killed mid-write
    DF._repair_tail(gen)
    assert [r["id"] for r in DF.read_jsonl(gen)] == ["a", "b"]
    DF.append_jsonl(gen, [row("c", "train"), row("a", "train")])
    counts = DF.write_splits(tmp_path)
    assert counts == {"train": {"s": {"conversations": 2, "reply_tokens": 6, "stop": 2}},
                      "eval": {"s": {"conversations": 1, "reply_tokens": 3, "stop": 1}}}
    convs = D.load_conversations(tmp_path / "train.jsonl", on_error="raise")
    assert [c["id"] for c in convs] == ["a", "c"] and convs[0]["messages"][1] == {"role": "assistant", "content": "a"}


def test_stopped_run_keeps_its_summary(tmp_path, capsys):
    # what a run writes before generating; a time box then kills it (no final summary)
    DF.update_summary(tmp_path, model="m", prompts={"self-instruct": {"used": 2}}, complete=False)
    row = {"id": "a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
           "source": "self-instruct", "split": "train", "finish": "length", "new_tokens": 7}
    DF.append_jsonl(tmp_path / "generated.jsonl", [row])
    assert SD.main(["--out", str(tmp_path), "--splits-only"]) == 0
    files = {"train": {"self-instruct": {"conversations": 1, "reply_tokens": 7, "stop": 0}}}
    assert json.loads(capsys.readouterr().out) == files
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"model": "m", "prompts": {"self-instruct": {"used": 2}}, "complete": False, "files": files}
    assert not list(tmp_path.glob("*.tmp"))


def test_remap_draft_vocab_keeps_shared_columns_and_fits_new_ones(rng):
    v, d = 60, 8
    emb = rng.normal(size=(v, d)).astype(np.float32)
    a_true = rng.normal(size=(d, d)).astype(np.float32)
    old_ids = np.arange(0, 40)
    new_ids = np.arange(10, 55)
    lm = (emb[old_ids] @ a_true).T  # trained columns that are exactly linear in the embeddings
    out, st = V.remap_draft_vocab(lm, old_ids - np.arange(40), new_ids - np.arange(45), emb, ridge=1e-9)
    assert out.shape == (d, 45) and st == {"kept": 30, "new": 15, "dropped": 10}
    np.testing.assert_array_equal(out[:, :30], lm[:, 10:40])  # shared tokens: exact copies
    np.testing.assert_allclose(out[:, 30:], (emb[40:55] @ a_true).T, rtol=1e-3, atol=1e-3)
    same, st = V.remap_draft_vocab(lm, old_ids - np.arange(40), old_ids - np.arange(40), emb)
    np.testing.assert_array_equal(same, lm)
    assert st["new"] == 0
    with pytest.raises(ValueError, match="columns"):
        V.remap_draft_vocab(lm[:, :5], old_ids - np.arange(40), new_ids - np.arange(45), emb)
