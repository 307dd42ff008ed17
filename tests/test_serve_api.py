"""The HTTP layer of the server on a fake engine (no model, no compile): usage with stop strings,
chat-template errors, unexpected errors, field ranges, OpenAI's no-op defaults, unknown models; and
the terminal chat's history trimming."""

from __future__ import annotations

import io
import json
import time
import types

import jinja2
import openai
import pytest
from starlette.testclient import TestClient

from eagle_jax.serve.chat import _fit, run_chat
from eagle_jax.serve.server import ServeOptions, ServerState, create_app

WORDS = ["<eos>"] + [f"w{i}" for i in range(1, 50)] + ["STOP"]
STOP_ID = len(WORDS) - 1


class FakeStream:
    """A `TokenStream` that hands out scripted chunks, one per `advance`."""

    def __init__(self, chunks):
        self.chunks, self.tokens, self.done, self.t_start, self.calls = list(chunks), [], False, time.perf_counter(), 0

    def advance(self, n=1):
        new = self.chunks.pop(0) if self.chunks else []
        self.calls += 1
        self.tokens += new
        self.done = not self.chunks
        return new

    finish_reason = property(lambda self: "length" if self.done else None)
    target_calls = property(lambda self: self.calls)
    accept_lengths = property(lambda self: [1] * self.calls)


class FakeEngine:
    name, method, budgets, max_cache_len = "fake", "vanilla", {}, 128
    cfg = types.SimpleNamespace(vocab_size=len(WORDS))
    script = [[1], [2, STOP_ID, 3, 4, 5]]  # the second (speculative) step runs 3 tokens past "STOP"

    def encode(self, p, raw=False):
        if not isinstance(p, str):
            if any(m["role"] == "system" for m in p):  # as Gemma's and Mistral's templates do
                raise jinja2.exceptions.TemplateError("System role not supported")
            p = " ".join(m["content"] for m in p)
            if p == "no-template":
                raise ValueError("this tokenizer has no chat template")
            if p == "boom":
                raise RuntimeError("/secret/path/in/a/traceback")
        return [1 + (i % 40) for i, _ in enumerate(p.split())]

    def decode(self, ids):
        return " ".join(WORDS[i] for i in ids if i)

    def start_stream(self, ids, n, **kw):
        return FakeStream(self.script)


@pytest.fixture(scope="module")
def client():
    state = ServerState(ServeOptions(model="fake", max_cache_len=128, cache_buckets=(128,), warmup=False),
                        engine=FakeEngine(), progress=False)
    with TestClient(create_app(state), raise_server_exceptions=False) as c:
        for _ in range(200):
            if state.ready:
                break
            time.sleep(0.05)
        assert state.ready, state.load_error
        yield c


def _chat(content="hi", **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


def _error(r, status: int, param) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def test_usage_counts_tokens_up_to_the_stop_string(client):
    body = _chat(stop="STOP", max_tokens=50)
    r = client.post("/v1/chat/completions", json=body).json()
    assert r["choices"][0]["message"]["content"] == "w1 w2 " and r["choices"][0]["finish_reason"] == "stop"
    # w1, w2 and the token that completed "STOP"; not the 3 the step accepted after it
    assert r["usage"] == {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    assert r["eagle_jax"]["tau"] == 3.0  # tau still counts every token generated: 6 in 2 target calls
    lines = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}).text.split("\n")
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "w1 w2 "
    assert events[-1]["usage"]["completion_tokens"] == 3 and events[-1]["eagle_jax"]["tau"] == 3.0
    r = client.post("/v1/completions", json={"prompt": "w1 w2", "stop": ["w2 ST"], "max_tokens": 50}).json()
    assert r["choices"][0]["text"] == "w1 " and r["usage"]["completion_tokens"] == 3  # completed by "STOP"


def test_usage_without_a_stop_counts_every_token(client):
    r = client.post("/v1/chat/completions", json=_chat(max_tokens=50)).json()
    assert r["choices"][0]["message"]["content"] == "w1 w2 STOP w3 w4 w5" and r["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("messages", [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                      [{"role": "user", "content": "no-template"}]], ids=["raise_exception", "none"])
def test_chat_template_error_is_a_400_naming_messages(client, messages):
    err = _error(client.post("/v1/chat/completions", json={"messages": messages}), 400, "messages")
    assert err["type"] == "invalid_request_error" and "chat template" in err["message"]
    assert "System role not supported" in err["message"] or "no chat template" in err["message"]


def test_unexpected_error_is_an_openai_shaped_500(client):
    r = client.post("/v1/chat/completions", json=_chat("boom"))
    err = _error(r, 500, None)
    assert err["type"] == "server_error" and "secret" not in r.text and "Traceback" not in r.text
    assert client.post("/v1/chat/completions", json=_chat()).status_code == 200  # still serving


def test_top_k_beyond_int32_is_a_400(client):
    err = _error(client.post("/v1/chat/completions", json=_chat(top_k=2 ** 31)), 400, "top_k")
    assert "top_k" in err["message"] and str(2 ** 31 - 1) in err["message"]
    _error(client.post("/v1/completions", json={"prompt": "w1", "top_k": -2}), 400, "top_k")
    assert client.post("/v1/chat/completions", json=_chat(top_k=2 ** 31 - 1)).status_code == 200


def test_openai_no_op_defaults_are_accepted(client):
    assert client.post("/v1/completions", json={"prompt": "w1", "best_of": 1}).status_code == 200
    assert client.post("/v1/chat/completions", json=_chat(response_format={"type": "text"})).status_code == 200
    for field, value in [("best_of", 2), ("best_of", True), ("response_format", {"type": "json_object"}),
                         ("response_format", "text")]:
        err = _error(client.post("/v1/chat/completions", json=_chat(**{field: value})), 400, field)
        assert field in err["message"] and "not supported" in err["message"]


def test_unknown_model_is_a_404_model_not_found(client):
    for path, body in [("/v1/chat/completions", _chat(model="gpt-17")), ("/v1/completions", {"prompt": "w1",
                                                                                             "model": "gpt-17"})]:
        err = _error(client.post(path, json=body), 404, "model")
        assert err["code"] == "model_not_found" and "gpt-17" in err["message"]
    assert client.post("/v1/chat/completions", json=_chat(model="fake")).status_code == 200
    # the official client maps it to NotFoundError (it goes by the status)
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=client)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])


# -- the terminal chat

def _counting_engine(max_cache_len=20):
    """encode: 2 tokens per message plus one per word."""
    return types.SimpleNamespace(max_cache_len=max_cache_len,
                                 encode=lambda h: [0] * sum(len(m["content"].split()) + 2 for m in h))


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_chat_fit_keeps_the_system_prompt():
    hist = _msgs(("system", "you are a pirate"), ("user", "a b c"), ("assistant", "d e f"), ("user", "g h"))
    ids, kept = _fit(_counting_engine(), hist, max_new_tokens=8)
    assert kept == _msgs(("system", "you are a pirate"), ("user", "g h")) and len(ids) == 10
    ids, kept = _fit(_counting_engine(40), hist, max_new_tokens=8)  # everything fits: nothing dropped
    assert kept == hist and len(ids) == 20


def test_chat_fit_keeps_a_user_turn_first_after_the_system_prompt():
    hist = _msgs(("system", "s"), ("user", "a"), ("assistant", "b c d e f g"), ("user", "h"), ("assistant", "i"),
                 ("user", "j"))
    # 25 tokens > 22: dropping "a" alone would fit (20 + 2), but the assistant turn after it goes too
    ids, kept = _fit(_counting_engine(22), hist, max_new_tokens=2)
    assert kept == _msgs(("system", "s"), ("user", "h"), ("assistant", "i"), ("user", "j")) and len(ids) == 12
    ids, kept = _fit(_counting_engine(22), hist[1:], max_new_tokens=3)  # no system prompt: the same rule
    assert kept == hist[3:]


def test_chat_fit_keeps_the_last_turn_even_when_it_cannot_fit():
    hist = _msgs(("system", "s"), ("user", "a"), ("assistant", "b"), ("user", " ".join("x" * 30)))
    ids, kept = _fit(_counting_engine(), hist, max_new_tokens=2)
    assert kept == [hist[0], hist[-1]] and len(ids) == 35  # the caller reports that it does not fit


def test_chat_reset_starts_over_from_the_system_prompt():
    seen = []

    class ChatEngine(FakeEngine):
        max_cache_len = 16

        def warm_stream(self, *a, **kw):
            return 0.0

        def encode(self, h, raw=False):
            seen.append([m["role"] + ":" + m["content"] for m in h])
            return [1] * sum(len(m["content"].split()) + 2 for m in h)

        def start_stream(self, ids, n, **kw):
            return FakeStream([[1], [2]])

    lines = iter(["w1 w2", "w3 w4", "/reset", "w5"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out, err = io.StringIO(), io.StringIO()
    assert run_chat(ChatEngine(), max_new_tokens=4, system="be a pirate", read=read, out=out, err=err) == 0
    # the second turn no longer fits with the first: that one goes, the system prompt stays
    assert seen[1][0] == seen[2][0] == "system:be a pirate" and seen[2][1] == "user:w3 w4"
    assert seen[-1] == ["system:be a pirate", "user:w5"]
    assert out.getvalue().split("\n")[:3] == ["w1 w2", "w1 w2", "w1 w2"] and "cleared" in err.getvalue()
