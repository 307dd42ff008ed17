"""Streamed generation (token by token through `Engine.start_stream`) equals one-shot generation,
and text deltas with stop strings add up to the right text."""

from __future__ import annotations

import jax
import pytest

from eagle_jax.cpu_jit import TRACE_COUNTS
from eagle_jax.engine import Engine
from eagle_jax.streaming import IncrementalText


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    e = Engine(str(tiny_hf_dir), progress=False)
    e.add_method("eagle3", "random")
    e.add_method("eagle2", "oracle")
    return e


def _stream_all(stream, n_steps=1):
    chunks = []
    while not stream.done:
        chunks.append(stream.advance(n_steps))
    return chunks


@pytest.mark.parametrize("method", ["vanilla", "eagle3", "eagle2"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_stream_equals_one_shot(engine, method, temperature):
    prompt = [1, 5, 9, 33, 7, 12]
    kw = dict(temperature=temperature, top_k=20 if temperature else 0, seed=3, cache_len=128, method=method)
    ref = engine.generate_ids(prompt, 40, **kw)
    stream = engine.start_stream(prompt, 40, **kw)
    chunks = _stream_all(stream, n_steps=1)
    assert [t for c in chunks for t in c] == ref.tokens
    assert stream.target_calls == ref.target_calls
    assert stream.accept_lengths == ref.accept_lengths
    assert stream.finish_reason == ref.finish_reason
    if method == "eagle2":  # the oracle accepts whole paths: chunks hold several tokens
        assert max(len(c) for c in chunks) > 1


def test_stream_steps_per_call_and_compile_once(engine):
    prompt = [1, 8, 8, 9]
    one = engine.start_stream(prompt, 30, cache_len=128, method="eagle3")
    a = [t for c in _stream_all(one, 1) for t in c]
    before = dict(TRACE_COUNTS)
    three = engine.start_stream(prompt + [4], 25, cache_len=128, method="eagle3", seed=9)
    b = _stream_all(three, 3)
    assert TRACE_COUNTS.get("spec_start") == before.get("spec_start")
    assert TRACE_COUNTS.get("spec_advance") == before.get("spec_advance")
    assert len(b) < 25 and sum(map(len, b)) <= 25
    again = engine.start_stream(prompt, 30, cache_len=128, method="eagle3")
    assert [t for c in _stream_all(again, 4) for t in c] == a


def test_compile_streams_compiles_what_streams_run(engine):
    """`Engine.compile_streams` traces and compiles, in threads, the programs that streams of those
    cache sizes then run: running them traces and compiles none of them again."""
    names = ("spec_start", "spec_advance")
    before = {n: TRACE_COUNTS.get(n, 0) for n in names}
    assert engine.compile_streams([72, 88], method="eagle3") >= 0
    assert {n: TRACE_COUNTS.get(n, 0) for n in names} == {n: before[n] + 2 for n in names}
    compiled = []  # XLA compilations (a persistent-cache hit counts too) of the programs run below

    def listen(event, secs, fun_name="", **kw):
        if event.endswith("backend_compile_duration"):
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for cache_len in (72, 88):
            stream = engine.start_stream([1, 5, 9], 12, cache_len=cache_len, method="eagle3")
            assert sum(map(len, _stream_all(stream, 2))) == 12
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert {n: TRACE_COUNTS.get(n, 0) for n in names} == {n: before[n] + 2 for n in names}
    assert not [f for f in compiled if "spec_" in f], compiled


def test_stream_stops_between_calls(engine):
    stream = engine.start_stream([1, 5, 6], 50, cache_len=128)
    got = stream.advance() + stream.advance(2)
    assert len(got) == 3 and not stream.done  # the caller may simply stop here


def _fake_decode(ids):
    return "".join(chr(i) for i in ids)


def test_incremental_text_deltas_and_stop_strings():
    inc = IncrementalText(_fake_decode, stop=["END", "xy"])
    out = []
    for ch in "hello E":
        out.append(inc.push([ord(ch)])[0])
    assert "".join(out) == "hello "  # "E" is held: it may start "END"
    d, stopped = inc.push([ord("x")])
    assert (d, stopped) == ("E", False)  # "Ex": E is not the start of a stop string any more; x may be
    d, stopped = inc.push([ord("y"), ord("z")])
    assert (d, stopped) == ("", True) and inc.text == "hello E"


def test_incremental_text_without_stop_and_final_flush():
    inc = IncrementalText(lambda ids: "".join(chr(i) for i in ids).replace("#", "\ufffd"))
    assert inc.push([ord("a"), ord("#")]) == ("a", False)  # incomplete character held back
    assert inc.push([], final=True) == ("\ufffd", False)


def test_incremental_text_tokens_used_stops_at_the_stop_string():
    inc = IncrementalText(_fake_decode, stop=["END", "q"])
    assert inc.push([ord(c) for c in "ab"]) == ("ab", False) and inc.tokens_used == 2  # no stop: every id
    d, stopped = inc.push([ord(c) for c in "cENDxyz"])  # one speculative step runs past the stop
    assert (d, stopped) == ("c", True) and inc.tokens_used == 6 and len(inc.ids) == 9  # up to the "D"
    inc = IncrementalText(_fake_decode, stop=["abcd", "c"])
    inc.push([ord(c) for c in "xabcdy"])  # "c" completes before "abcd" does: a decoder stops there
    assert (inc.text, inc.tokens_used) == ("xab", 4)


def _byte_fallback_tokenizer():
    """A SentencePiece-style BPE with byte fallback (as Llama-2/Mistral GGUFs): characters outside the
    vocabulary become one <0xNN> token per UTF-8 byte, each decoding to U+FFFD until complete."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t in ["▁", "x", "▁x", "y"]:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok, lambda ids: tok.decode(list(ids), skip_special_tokens=True)


@pytest.mark.parametrize("per_push", [1, 2])
def test_incremental_text_byte_fallback_multibyte_characters(per_push):
    tok, decode = _byte_fallback_tokenizer()
    ids = tok.encode("x你好😀y").ids
    assert decode(ids) == "x你好😀y" and len(ids) == 13  # 3 + 3 + 4 byte tokens
    inc, deltas = IncrementalText(decode), []
    for i in range(0, len(ids), per_push):
        deltas.append(inc.push(ids[i:i + per_push], final=i + per_push >= len(ids))[0])
    assert "".join(deltas) == decode(ids) and not any("\ufffd" in d for d in deltas)
    # a stop string right after the emoji: the text before it, whole
    inc = IncrementalText(decode, stop=["y"])
    out = "".join(inc.push(ids[i:i + per_push])[0] for i in range(0, len(ids), per_push))
    assert (out, inc.stopped, inc.tokens_used) == ("x你好😀", True, len(ids))
