"""The Engine's tokenizer snapshot (`eagle_jax.text_codec`): the same ids, chat text and decoded
text as transformers' tokenizer, on the real SmolLM2 tokenizer and on templates that use every
feature of transformers' jinja2 environment; reused by a later process without importing
transformers; captured again when a tokenizer file changes or the snapshot is unreadable; and not
used for a tokenizer it could not reproduce."""

import json
import subprocess
import sys

from pathlib import Path

import jinja2
import numpy as np
import pytest

import eagle_jax
from eagle_jax import text_codec

from eagle_jax.text_codec import SnapshotCodec, _HFCodec, load_codec, load_tokenizer, snapshot_key
from conftest import write_tiny_tokenizer

DATA = Path(eagle_jax.__file__).parent / "data"
TEXTS = ["", " ", "  two leading spaces", "trailing  ", "\n\n\t", "naïve café 🦅 中文 ﬁ",
         "x = [1, 2]\n\tdef f():",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> and <s> </s> w5", "a" * 300]
CHATS = [
    [{"role": "user", "content": "Écris un haïku sur le décodage spéculatif, s'il te plaît. 🦅"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello <|im_end|>"},
     {"role": "user", "content": "  spaces  \n"}],
    [{"role": "user", "content": "q", "name": None}, {"role": "assistant", "content": "a", "reasoning": "think"},
     {"role": "user", "content": "more", "tool_calls": None}],
]
FEATURES_TEMPLATE = """{%- set ns = namespace(n=0, seen=[]) -%}
{%- for m in messages -%}
  {%- if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif -%}
  {%- if loop.index > 3 %}{% break %}{% endif -%}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
    <s> w3 {% generation %}{{ m['content'] }}{% endgeneration %} {{ m | tojson }}
  {{ dict(role=m.role, k=[1, 2]) | tojson(indent=1) }} {{ m.get('thinking', '') }} {{ m.reasoning_content }}
  </s>
{% endfor -%}
{%- if add_generation_prompt %}<s> w4 {{ eos_token }} {{ bos_token }} {{ ns.n }} {{ strftime_now('%Y') }}{% endif %}"""
FEATURE_CHATS = [
    [{"role": "user", "content": "w5 w6 é\n"}, {"role": "skip", "content": "w7"},
     {"role": "assistant", "content": "w8", "reasoning_content": "r1"}, {"role": "user", "content": "w9"}],
    [{"role": "assistant", "content": "w8", "thinking": "t"}, {"role": "user", "content": None}],
]


def _same(codec, tok, chats, texts, rng, n_ids):
    for text in texts:
        assert codec.encode(text) == tok(text).input_ids, text
        assert codec.encode(text, add_special_tokens=False) == tok(text, add_special_tokens=False).input_ids, text
    for chat in chats:
        want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert codec.render_chat(chat) == want, chat
        texts = texts + [want]
    for text in texts:
        ids = tok(text).input_ids
        assert codec.decode(ids) == tok.decode(ids, skip_special_tokens=True)
    for _ in range(20):  # any ids: special, byte-level pieces cut mid-character, ...
        ids = [int(i) for i in rng.integers(0, n_ids, size=int(rng.integers(1, 40)))]
        assert codec.decode(ids) == tok.decode(ids, skip_special_tokens=True), ids
    assert codec.eos_token_id == tok.eos_token_id


def _tiny_dir(path, template=None, bos_eos=False, **config):
    """A tiny tokenizer directory; `bos_eos`: its tokenizer.json adds <s> and </s>, truncates, pads."""
    path.mkdir()
    write_tiny_tokenizer(path, 40)
    if bos_eos:
        from tokenizers import Tokenizer, processors

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", 1), ("</s>", 2)])
        tok.enable_truncation(max_length=4)  # which transformers turns off for a plain call
        tok.enable_padding(length=64, pad_id=0)
        tok.save(str(path / "tokenizer.json"))
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(config)
    cfg_file.write_text(json.dumps(cfg))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return path


def test_snapshot_of_the_real_tokenizer_equals_transformers(smollm2_engine, tmp_path):
    codec, tok = load_codec(smollm2_engine.path, tmp_path)
    assert isinstance(codec, SnapshotCodec) and tok is not None
    again, none = load_codec(smollm2_engine.path, tmp_path)  # from the file just written
    assert isinstance(again, SnapshotCodec) and none is None
    prompts = []
    for name in ("eval_chat_prompts", "eval_code_prompts"):  # held-out chat prompts and HumanEval's
        with open(DATA / f"{name}.jsonl") as f:
            prompts += [json.loads(line)["prompt"] for line in f][:6]
    _same(again, tok, CHATS + [[{"role": "user", "content": p}] for p in prompts[:12]], TEXTS + prompts,
          np.random.default_rng(0), len(tok))
    assert smollm2_engine.encode(CHATS[2]) == tok.apply_chat_template(CHATS[2], add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False)


@pytest.mark.parametrize("bos_eos", [False, True])
def test_snapshot_reproduces_templates_and_post_processor(tmp_path, bos_eos):
    """Whitespace control, loop controls, namespace, dict, tojson, {% generation %}, reasoning
    aliases, None-valued keys, special tokens in the template; and the tokenizer's post-processor."""
    d = _tiny_dir(tmp_path / "tok", FEATURES_TEMPLATE, bos_eos=bos_eos)
    codec, tok = load_codec(d, tmp_path / "cache")
    assert isinstance(codec, SnapshotCodec)
    codec = load_codec(d, tmp_path / "cache")[0]
    assert codec.encode("w5 w6") == ([1, 5, 6, 2] if bos_eos else [5, 6])
    assert codec.encode("w5 w6", add_special_tokens=False) == [5, 6]
    _same(codec, tok, FEATURE_CHATS, TEXTS, np.random.default_rng(1), 40)
    for bad in ([], [{"role": "bad", "content": "w5"}]):
        with pytest.raises((ValueError, jinja2.exceptions.TemplateError)) as ours:
            codec.render_chat(bad)
        with pytest.raises(type(ours.value)) as theirs:
            tok.apply_chat_template(bad, tokenize=False, add_generation_prompt=True)
        assert str(ours.value) == str(theirs.value)


def test_messages_with_other_values_go_through_transformers(tmp_path, monkeypatch):
    d = _tiny_dir(tmp_path / "tok", FEATURES_TEMPLATE)
    tok = load_codec(d, tmp_path / "cache")[1]
    loads = []
    monkeypatch.setattr(text_codec, "load_tokenizer", lambda path: loads.append(path) or tok)
    codec = load_codec(d, tmp_path / "cache")[0]  # from the snapshot: no tokenizer loaded
    chat = [{"role": "user", "content": np.str_("w5")}, {"role": "assistant", "content": "w6", "n": np.int64(3)}]
    assert not loads
    for _ in range(2):
        assert codec.render_chat(chat) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert loads == [d]  # loaded once, on the first chat that needed it


def test_later_process_reads_the_snapshot_without_transformers(tmp_path):
    d, cache = _tiny_dir(tmp_path / "tok", FEATURES_TEMPLATE), tmp_path / "cache"
    codec, tok = load_codec(d, cache)
    code = ("import json, sys; from eagle_jax.text_codec import load_codec; "
            "c, tok = load_codec(sys.argv[1], sys.argv[2]); "
            "chat = [{'role': 'user', 'content': 'w5 w6'}]; "
            "print(json.dumps([tok is None, 'transformers' in sys.modules, c.encode(c.render_chat(chat), False), "
            "c.decode([1, 5, 2, 7])]))")
    out = subprocess.run([sys.executable, "-c", code, str(d), str(cache)], capture_output=True, text=True, check=True)
    chat = [{"role": "user", "content": "w5 w6"}]
    want = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert json.loads(out.stdout) == [True, False, want.input_ids, tok.decode([1, 5, 2, 7], skip_special_tokens=True)]


def test_changed_files_and_unreadable_snapshots_are_captured_again(tmp_path, capsys):
    d, cache = _tiny_dir(tmp_path / "tok", "{% for m in messages %}w5 {{ m['content'] }} {% endfor %}"), tmp_path / "c"
    chat = [{"role": "user", "content": "w7"}]
    assert load_codec(d, cache)[0].render_chat(chat) == "w5 w7 "
    key = snapshot_key(d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}w6 {{ m['content'] }} {% endfor %}")
    assert snapshot_key(d) != key
    assert load_codec(d, cache)[0].render_chat(chat) == "w6 w7 "
    snap = cache / "tokenizers" / f"{snapshot_key(d)}.json"
    snap.write_text("{not json")
    codec, tok = load_codec(d, cache)
    assert tok is not None and codec.render_chat(chat) == "w6 w7 " and "capturing it again" in capsys.readouterr().err
    assert json.loads(snap.read_text())["format"] == 1


def test_tokenizers_a_snapshot_cannot_reproduce_stay_with_transformers(tmp_path):
    d = _tiny_dir(tmp_path / "tok", clean_up_tokenization_spaces=True)
    codec, tok = load_codec(d, tmp_path / "cache")
    assert isinstance(codec, _HFCodec) and codec.tok is tok
    other = _tiny_dir(tmp_path / "qwen2")  # AutoTokenizer gives qwen2 its own class (Qwen2Tokenizer)
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    codec2, tok2 = load_codec(other, tmp_path / "cache")
    assert type(tok2).__name__ != "TokenizersBackend" and isinstance(codec2, _HFCodec)
    assert not (tmp_path / "cache" / "tokenizers").exists()
    assert codec.decode(tok("w5 w6").input_ids) == tok.decode(tok("w5 w6").input_ids, skip_special_tokens=True)
    assert load_tokenizer(d).clean_up_tokenization_spaces


def test_without_a_packages_version_there_is_no_snapshot(tmp_path, monkeypatch):
    """A snapshot's name covers the library versions; where one cannot be read, an upgrade would go
    unseen, so the tokenizer stays with transformers."""
    d = _tiny_dir(tmp_path / "tok")

    def version(pkg):
        raise text_codec.metadata.PackageNotFoundError(pkg)

    monkeypatch.setattr(text_codec.metadata, "version", version)
    codec, tok = load_codec(d, tmp_path / "cache")
    assert isinstance(codec, _HFCodec) and codec.tok is tok and snapshot_key(d) is None
    assert not (tmp_path / "cache" / "tokenizers").exists()
