"""Training data: conversation loading, assistant-only masks, the grain pipeline, the draft
vocabulary, prompt sources and the self-distillation file handling. Fast: tiny tokenizers only
(plus the real SmolLM2 tokenizer when its converted directory is already cached)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eagle_jax.training import data as D
from eagle_jax.training import prompts as P
from eagle_jax.training import selfdistill as SD
from eagle_jax.training import vocab as V

from conftest import write_tiny_tokenizer

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nw3 w4<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path, 60)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def chatml_tok():
    """A word-level tokenizer with SmolLM2's ChatML layout: <|im_start|>role\\n ... <|im_end|>\\n."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), 80)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>",
                                   bos_token="<|im_start|>", additional_special_tokens=["<|endoftext|>"])
    fast.chat_template = CHATML
    return fast


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
    convs = [{"id": "a", "messages": msgs}, {"id": "b", "messages": msgs[:1] + [{"role": "assistant", "content": "w13"}]}]
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


# ---------------------------------------------------------------------------------- prompts
def test_held_out_files_consistent():
    chat = P.load_prompt_file(P.EVAL_CHAT_FILE)
    bench = P.load_prompt_file(P.BENCH_CHAT_FILE)
    assert len(chat) == 40 and len({p["id"] for p in chat}) == 40
    assert {p["prompt"] for p in bench} <= {p["prompt"] for p in chat}
    code = P.load_prompt_file(P.EVAL_CODE_FILE)
    assert len(code) == P.HUMANEVAL_EVAL_SIZE
    split = P.humaneval_split()
    assert len(split) == P.HUMANEVAL_EVAL_SIZE and split == P.humaneval_split()  # fixed
    assert sorted(int(p["id"].split("-")[1]) for p in code) == sorted(split)


def test_humaneval_split_from_package():
    try:
        ev, tr = P.humaneval_prompts("eval"), P.humaneval_prompts("train")
    except Exception as e:  # no network and no cached wheel
        pytest.skip(f"HumanEval wheel unavailable: {e}")
    assert len(ev) == 40 and len(tr) == 124 and not {p["id"] for p in ev} & {p["id"] for p in tr}
    assert [p["prompt"] for p in ev] == [p["prompt"] for p in P.load_prompt_file(P.EVAL_CODE_FILE)]


def test_near_duplicates_and_held_out_filter():
    held = [{"prompt": "Why is the sky blue?"}, {"prompt": "Write a short poem about the ocean at night."}]
    ps = [{"id": str(i), "prompt": t} for i, t in enumerate([
        "why is the sky blue", "Write a short poem about the ocean at night, please.", "How do volcanoes form?",
        "How do volcanoes form ?", "Explain how a bicycle gear works for a child.", "What is a prime number?"])]
    st = {}
    kept = P.drop_near_duplicates(ps, held, stats=st)
    assert [p["id"] for p in kept] == ["2", "4", "5"] and st == {"duplicates": 1, "near_held_out": 2}
    kept = P.drop_near_duplicates(ps[2:], reference=[{"prompt": "What is a prime number?"}])
    assert [p["id"] for p in kept] == ["2", "4"]


@pytest.mark.parametrize("raw,want", [
    (" How do I keep basil fresh?\nTopic: x", "How do I keep basil fresh?"),
    ('"What is a leap year?"', "What is a leap year?"),
    ("1. Question: Write a haiku about rain.", "Write a haiku about rain."),
    ("Sure! Here is a question: what?", None),
    ("<|im_start|>assistant hello there friend?", None),
    ("How does the", None),
    ("Why?", None),
])
def test_clean_generated_question(raw, want):
    assert P.clean_generated_question(raw) == want


def test_seed_topics(tmp_path):
    topics = P.read_seed_topics()
    assert 100 <= len(topics) <= 200 and len(set(topics)) == len(topics)
    assert P.read_seed_topics("default") == topics
    more = P.read_seed_topics("more")  # the second packaged list: new topics only
    assert len(more) >= 300 and len(set(more)) == len(more) and not set(more) & set(topics)
    f = tmp_path / "topics.txt"
    f.write_text("# a comment\n\nknots for sailing\n  tide pools \n")
    assert P.read_seed_topics(str(f)) == ["knots for sailing", "tide pools"]
    with pytest.raises(FileNotFoundError, match="no file .*nope.txt.*default, more"):
        P.read_seed_topics(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("# only a comment\n")
    with pytest.raises(ValueError, match="names no topic"):
        P.read_seed_topics(str(tmp_path / "empty.txt"))


def test_self_instruct_draws_from_the_chosen_topic_lists(tmp_path, monkeypatch):
    seen = []

    def fake_writer(engine, topics, n, **kw):  # stands in for the target writing questions
        seen.append(list(topics))
        return [{"id": f"si-{i}", "prompt": f"What is fact number {i} about {topics[i]}?", "source": "self-instruct"}
                for i in range(n)]

    monkeypatch.setattr(P, "self_instruct_prompts", fake_writer)
    f = tmp_path / "mine.txt"
    f.write_text("tide pools\n" + P.read_seed_topics("more")[0] + "\n")
    counts = {}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    train, _ = SD.collect_prompts(None, ["self-instruct"], tmp_path / "a", self_instruct_n=3, counts=counts,
                                  seed_topics=["more", str(f)])
    more = P.read_seed_topics("more")
    assert seen == [more + ["tide pools"]]  # both lists, in order, a repeated topic once
    assert counts["self-instruct"]["seed_topics"] == {"lists": ["more", str(f)], "topics": len(more) + 1}
    assert [p["prompt"] for p in train] == [f"What is fact number {i} about {more[i]}?" for i in range(3)]
    SD.collect_prompts(None, ["self-instruct"], tmp_path / "b", self_instruct_n=2)
    assert seen[-1] == P.read_seed_topics()  # the default list when none is named


def _fake_stdlib(root):
    doc = "Return the {} of the numbers in seq, ignoring values that are None."
    (root / "stats.py").write_text(
        "import os\n\n"
        f"def mean(seq, skip=True):\n    \"\"\"{doc.format('mean')}\n\n    More words here.\n    \"\"\"\n    return 0\n\n"
        "def short(x):\n    \"\"\"Too short.\"\"\"\n\n"
        f"def _private(x):\n    \"\"\"{doc.format('private')}\"\"\"\n\n"
        f"def noargs():\n    \"\"\"{doc.format('nothing')}\"\"\"\n\n"
        "class Acc(object):\n"
        f"    def add(self, value):\n        \"\"\"{doc.format('sum')}\n\n        Second paragraph.\n        \"\"\"\n        pass\n\n"
        f"    def reset(self):\n        \"\"\"{doc.format('reset')}\"\"\"\n\n"
        f"    @property\n    def total(self, x):\n        \"\"\"{doc.format('total')}\"\"\"\n\n"
        f"    @staticmethod\n    def scale(x):\n        \"\"\"{doc.format('scale')}\"\"\"\n")
    for sub in ("test", "idlelib", "pkg"):
        (root / sub).mkdir()
        (root / sub / "__init__.py").write_text(f"def helper(a):\n    \"\"\"{doc.format(sub)}\"\"\"\n")
    (root / "broken.py").write_text("def f(:\n")


def test_stdlib_code_prompts_pick_documented_public_functions(tmp_path):
    import ast

    from eagle_jax.training import code_prompts as C

    _fake_stdlib(tmp_path)
    items = C.stdlib_functions(tmp_path)
    # no private, undocumented, argument-less or property ones; no tests, no GUI tool; broken files skipped
    assert [p["id"] for p in items] == ["stdlib-pkg.helper", "stdlib-stats.mean", "stdlib-stats.Acc.add",
                                        "stdlib-stats.Acc.scale"]
    mean = items[1]["prompt"]
    assert mean.startswith("Complete the following Python function.") and "return 0" not in mean
    code = mean.split("```python\n")[1].rsplit("\n```", 1)[0]
    fn = ast.parse(code).body[0]  # the signature and the docstring, re-indented, nothing else
    assert fn.name == "mean" and len(fn.body) == 1 and ast.get_docstring(fn).endswith("More words here.")
    add = items[2]["prompt"]
    assert "method of the Python class Acc" in add and "class Acc(object):" in add and "pass" not in add
    cls = ast.parse(add.split("```python\n")[1].rsplit("\n```", 1)[0]).body[0]
    assert [type(n).__name__ for n in cls.body] == ["Expr", "FunctionDef"]
    assert ast.get_docstring(cls.body[1]).splitlines()[-1] == "Second paragraph."
    assert "@staticmethod" not in items[3]["prompt"]
    pick = C.stdlib_code_prompts(2, seed=3, root=tmp_path)
    assert pick == C.stdlib_code_prompts(2, seed=3, root=tmp_path) and len(pick) == 2
    assert all(p in items for p in pick) and C.stdlib_code_prompts(None, root=tmp_path) == items
    rest = C.stdlib_code_prompts(5, root=tmp_path, exclude={"stdlib-stats.mean", "stdlib-pkg.helper"})
    assert [p["id"] for p in rest] == ["stdlib-stats.Acc.add", "stdlib-stats.Acc.scale"]


def test_stdlib_code_source_of_this_interpreter(tmp_path):
    from eagle_jax.training import code_prompts as C

    items = C.stdlib_functions()
    assert len(items) > 500 and len({p["id"] for p in items}) == len(items)
    counts = {}
    train, evals = SD.collect_prompts(None, ["stdlib-code"], tmp_path, stdlib_code_n=40, seed=1, counts=counts)
    assert counts["stdlib-code"]["available"] >= 38 and {p["source"] for p in train} == {"stdlib-code"}
    assert {p["id"] for p in train} <= {p["id"] for p in items}
    assert len(evals) == 80 and not {p["prompt"] for p in train} & {p["prompt"] for p in evals}
    # a second set leaves out the ids a stored set has (`--exclude-ids-from`), and still finds 40
    import gzip

    with gzip.open(tmp_path / "stored.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"id": p["id"], "conversations": [{"from": "human", "value": p["prompt"]},
                                                                  {"from": "gpt", "value": "def f(): pass"}]}) + "\n"
                     for p in train)
    gone = SD.stored_ids([str(tmp_path / "*.jsonl.gz")])
    assert gone == {p["id"] for p in train}
    counts = {}
    again, _ = SD.collect_prompts(None, ["stdlib-code"], tmp_path, stdlib_code_n=40, seed=1, counts=counts,
                                  exclude_ids=gone)
    assert not {p["id"] for p in again} & gone and counts["stdlib-code"]["available"] >= 38
    assert counts["stdlib-code"]["excluded"] == len(gone)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        SD.stored_ids([str(tmp_path / "nothing-*.jsonl")])


def test_package_code_prompts_from_installed_packages(tmp_path):
    from eagle_jax.training import code_prompts as C

    pkg = tmp_path / "site" / "fakelib"
    pkg.mkdir(parents=True)
    _fake_stdlib(pkg)  # the same files as a package: ids name the package; tests and private modules left out
    (pkg / "__init__.py").write_text('def top(a, b):\n    """Return a joined with b, separated by one space each."""\n')
    (pkg / "_vendored.py").write_text('def hidden(a):\n    """Return a joined with b, separated by one space each."""\n')
    (tmp_path / "site" / "single.py").write_text("x = 1\n")
    items = C.package_functions(["fakelib"], paths=[str(tmp_path / "site")])
    assert [p["id"] for p in items] == ["pkg-fakelib.top", "pkg-fakelib.idlelib.helper", "pkg-fakelib.pkg.helper",
                                        "pkg-fakelib.stats.mean", "pkg-fakelib.stats.Acc.add",
                                        "pkg-fakelib.stats.Acc.scale"]
    assert {p["source"] for p in items} == {"package-code"}
    as_stdlib = {p["name"]: p["prompt"] for p in C.stdlib_functions(pkg)}
    assert items[3]["prompt"] == as_stdlib["mean"]  # the same request as the stdlib source writes
    for bad in ("single", "no_such_package"):
        with pytest.raises(ValueError, match=f"{bad!r} is not an installed package"):
            C.package_functions([bad], paths=[str(tmp_path / "site")])
    # the real default packages, through collect_prompts: a seeded choice, disjoint from held-out prompts
    counts = {}
    train, evals = SD.collect_prompts(None, ["package-code"], tmp_path, package_code_n=30, seed=2, counts=counts)
    assert len(train) >= 28 and {p["source"] for p in train} == {"package-code"}
    assert counts["package-code"]["packages"] == list(C.DEFAULT_PACKAGES)
    assert {p["id"].split("-", 1)[1].split(".")[0] for p in train} <= set(C.DEFAULT_PACKAGES)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in evals}


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
    SD.append_jsonl(gen, [row("a", "train"), row("b", "eval")])
    with open(gen, "a") as f:
        f.write('{"id": "c", "conv')  # a run killed mid-write
    SD._repair_tail(gen)
    assert [r["id"] for r in SD.read_jsonl(gen)] == ["a", "b"]
    SD.append_jsonl(gen, [row("c", "train"), row("a", "train")])
    counts = SD.write_splits(tmp_path)
    assert counts == {"train": {"s": {"conversations": 2, "reply_tokens": 6, "stop": 2}},
                      "eval": {"s": {"conversations": 1, "reply_tokens": 3, "stop": 1}}}
    convs = D.load_conversations(tmp_path / "train.jsonl", on_error="raise")
    assert [c["id"] for c in convs] == ["a", "c"] and convs[0]["messages"][1] == {"role": "assistant", "content": "a"}


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
