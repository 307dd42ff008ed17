"""The OpenAI-compatible server, started for real on a loopback port and driven with the official
`openai` client and raw HTTP: answers equal the engine's, streaming, bad input, concurrency,
disconnects, metrics, the load-test script."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from server_util import ServerThread

from eagle_jax.engine import Engine
from eagle_jax.serve.server import ServeOptions, ServerState

CTX = 128


@pytest.fixture(scope="module")
def engine(tiny_hf_dir):
    return Engine(str(tiny_hf_dir), method="eagle3", drafter="random", progress=False)


@pytest.fixture(scope="module")
def server(engine, tiny_hf_dir):
    opts = ServeOptions(model=str(tiny_hf_dir), served_model_name="tiny", max_cache_len=CTX, cache_buckets=(64, CTX),
                        max_active=3, default_max_tokens=24)
    state = ServerState(opts, engine=engine, progress=False)
    with ServerThread(state) as url:
        yield url, state


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_ref(engine, text, n, **kw):
    return engine.generate_ids(engine.encode(text), n, **kw)


def test_health_models_and_warm_shapes(server, engine):
    url, state = server
    assert httpx.get(url + "/health").json()["status"] == "ok"
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["eagle_jax"]["method"] == "eagle3"
    assert models["data"][0]["eagle_jax"]["context_length"] == CTX
    assert httpx.get(url + "/v1/models/tiny").json() == models["data"][0]
    r = httpx.get(url + "/v1/models/gpt-17")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_completion_equals_engine(client, engine):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w17"}],
                                       max_tokens=20, temperature=0)
    ref = _chat_ref(engine, "w5 w9 w17", 20)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == ref.new_tokens and r.usage.prompt_tokens == len(engine.encode("w5 w9 w17"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["eagle_jax"]["target_calls"] == ref.target_calls


def test_completion_raw_prompt_and_token_ids(client, engine):
    ids = engine.encode("w7 w8 w9", raw=True)
    ref = engine.generate_ids(ids, 16)
    r = client.completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=16, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == ref.new_tokens
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0)
    assert r2.choices[0].text == ref.text


def test_streaming_chat_and_completion(client, server, engine):
    ref = _chat_ref(engine, "w11 w12", 20)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w11 w12"}],
                                                 max_tokens=20, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.new_tokens
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed, not one blob

    ids = engine.encode("w30 w31", raw=True)
    cref = engine.generate_ids(ids, 12)
    parts = list(client.completions.create(model="tiny", prompt="w30 w31", max_tokens=12, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == cref.text
    # raw SSE framing: data lines, the last one [DONE]
    with httpx.stream("POST", server[0] + "/v1/completions",
                      json={"prompt": "w30 w31", "max_tokens": 5, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_stop_strings_and_seeded_sampling(client, engine):
    ref = _chat_ref(engine, "w40 w41", 24)
    words = ref.text.split()
    assert len(words) >= 4, ref.text
    stop = words[3]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w40 w41"}], max_tokens=24,
                                       temperature=0, stop=[stop, "never-there"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ref.text[:ref.text.index(stop)]
    kw = dict(model="tiny", messages=[{"role": "user", "content": "w40 w41"}], max_tokens=16, temperature=1.0,
              top_p=0.95, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    s = _chat_ref(engine, "w40 w41", 16, temperature=1.0, top_p=0.95, seed=1234)
    assert a == b == s.text


BAD = [
    (b"{not json", "body", None),
    (b"[1, 2]", "object", None),
    ({"messages": "hello"}, "messages", "messages"),
    ({"messages": []}, "empty", "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role", "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 0}, "at least 1", "max_tokens"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": "ten"}, "integer", "max_tokens"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 10_000}, "context", "max_tokens"),
    ({"messages": [{"role": "user", "content": "w5"}], "temperature": -0.5}, "temperature", "temperature"),
    ({"messages": [{"role": "user", "content": "w5"}], "temperature": "hot"}, "number", "temperature"),
    ({"messages": [{"role": "user", "content": "w5"}], "top_p": 0}, "top_p", "top_p"),
    ({"messages": [{"role": "user", "content": "w5"}], "stop": [1, 2]}, "stop", "stop"),
    ({"messages": [{"role": "user", "content": "w5"}], "stream": "yes"}, "boolean", "stream"),
    ({"messages": [{"role": "user", "content": "w5"}], "n": 3}, "n=1", "n"),
    ({"messages": [{"role": "user", "content": "w5"}], "presence_penalty": 0.5}, "presence_penalty",
     "presence_penalty"),
    ({"messages": [{"role": "user", "content": " ".join(["w9"] * 200)}]}, "prompt has", "messages"),
]


@pytest.mark.parametrize("body,needle,param", BAD, ids=[b[1] for b in BAD])
def test_bad_chat_input_is_a_400_naming_the_problem(server, body, needle, param):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server[0] + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param"} and err["type"] == "invalid_request_error"
    assert needle in err["message"] and err["param"] == param


@pytest.mark.parametrize("body,param", [({"prompt": ""}, "prompt"), ({"prompt": [["w5"], ["w6"]]}, "prompt"),
                                        ({"prompt": [5, 10 ** 6]}, "prompt"), ({}, "prompt"),
                                        ({"prompt": "w5", "max_tokens": -3}, "max_tokens")])
def test_bad_completion_input(server, body, param):
    r = httpx.post(server[0] + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_unknown_route_and_method_are_json(server):
    r = httpx.get(server[0] + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server[0] + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_concurrent_requests_all_correct(server, engine):
    prompts = [f"w{10 + i} w{20 + i}" for i in range(7)]  # more than max_active=3: some queue
    refs = {p: _chat_ref(engine, p, 16).text for p in prompts}
    got, errors = {}, []

    def ask(p):
        stream = p[-1] in "02468"
        try:
            r = httpx.post(server[0] + "/v1/chat/completions", timeout=300,
                           json={"messages": [{"role": "user", "content": p}], "max_tokens": 16, "temperature": 0,
                                 "stream": stream})
            if stream:
                objs = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
                got[p] = "".join(o["choices"][0]["delta"].get("content", "") for o in objs if o["choices"])
            else:
                got[p] = r.json()["choices"][0]["message"]["content"]
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and got == refs


def _metric(url, name) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def slow_steps(monkeypatch):
    """Every stream step takes 50 ms more: a 100-token generation lasts seconds, so a hang-up that is
    noticed lands while it runs, whatever the machine's load."""
    import time

    from eagle_jax.streaming import TokenStream

    fast = TokenStream.advance

    def advance(self, n_steps=1):
        time.sleep(0.05)
        return fast(self, n_steps)

    monkeypatch.setattr(TokenStream, "advance", advance)


def _long_prompt(engine) -> str:
    return next(p for p in (f"w{i}" for i in range(5, 100)) if _chat_ref(engine, p, 100).new_tokens == 100)


def _stream_then_hang_up(url, prompt):
    """Open a streamed chat, read its first event (the role chunk, sent before any token), hang up."""
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 100,
                            "temperature": 0, "stream": True}) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                return


CANCELLED = 'eagle_jax_generations_total{reason="cancelled"}'


def _wait_for_cancelled(url, before, within=30.0):
    """The cancelled count once it moved past `before` (or after `within` s: a deadline, not a measure)."""
    import time

    t0 = time.monotonic()
    while _metric(url, CANCELLED) == before and time.monotonic() - t0 < within:
        time.sleep(0.02)
    return _metric(url, CANCELLED)


def test_disconnect_cancels_and_server_keeps_serving(server, engine, client, slow_steps):
    url = server[0]
    prompt = _long_prompt(engine)
    before, tokens = _metric(url, CANCELLED), _metric(url, "eagle_jax_generation_tokens_total")
    _stream_then_hang_up(url, prompt)
    assert _wait_for_cancelled(url, before) == before + 1
    assert _metric(url, "eagle_jax_generation_tokens_total") - tokens < 100  # cut short, not run to its end
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5 w9 w17"}],
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.content == _chat_ref(engine, "w5 w9 w17", 20).text


def test_client_that_hangs_up_while_queued_is_never_started(server, engine, monkeypatch, slow_steps):
    import time

    url, state = server
    prompt = _long_prompt(engine)
    monkeypatch.setattr(state.scheduler, "max_active", 1)
    started = []
    start = engine.start_stream
    monkeypatch.setattr(engine, "start_stream", lambda ids, *a, **kw: started.append(list(ids)) or start(ids, *a, **kw))
    ref = _chat_ref(engine, prompt, 100)
    got = {}
    busy = threading.Thread(target=lambda: got.update(httpx.post(  # holds the one slot for ~5 s
        url + "/v1/chat/completions", timeout=120, json={"messages": [{"role": "user", "content": prompt}],
                                                         "max_tokens": 100, "temperature": 0}).json()))
    busy.start()
    for _ in range(6000):
        if started:
            break
        time.sleep(0.01)
    before = _metric(url, CANCELLED)
    _stream_then_hang_up(url, "w5 w9 w17")
    assert _wait_for_cancelled(url, before) == before + 1
    assert busy.is_alive()  # dropped from the queue while the first generation still runs
    busy.join(120)
    assert got["choices"][0]["message"]["content"] == ref.text
    assert len(started) == 1  # the queued one never reached the engine


def test_hang_up_cancels_under_an_asgi_2_4_server(server, engine, slow_steps):
    """ASGI 2.4 servers leave listening for the hang-up to the app (Starlette's own streaming response
    then notices it only when a write fails): drive the app directly as such a server would."""
    import asyncio

    from eagle_jax.serve.server import create_app

    url, state = server
    app = create_app(state)
    body = json.dumps({"messages": [{"role": "user", "content": _long_prompt(engine)}], "max_tokens": 100,
                       "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    before, tokens = _metric(url, CANCELLED), _metric(url, "eagle_jax_generation_tokens_total")
    bodies = []

    async def main():
        first = asyncio.Event()
        requests = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if requests:
                return requests.pop()
            await first.wait()  # the client hangs up once it has the first event
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message["body"]:
                bodies.append(message["body"])
                first.set()

        await asyncio.wait_for(app(scope, receive, send), 60)

    asyncio.run(main())
    assert _wait_for_cancelled(url, before) == before + 1
    assert _metric(url, "eagle_jax_generation_tokens_total") - tokens < 100
    assert b"[DONE]" not in b"".join(bodies)


def test_metrics_count_requests_tokens_and_tau(server):
    url = server[0]
    text = httpx.get(url + "/metrics").text
    for name in ("eagle_jax_requests_total", "eagle_jax_generation_tokens_total", "eagle_jax_tau",
                 "eagle_jax_request_latency_seconds_bucket", "eagle_jax_time_to_first_token_seconds_count",
                 "eagle_jax_accept_length_bucket", "eagle_jax_requests_waiting"):
        assert name in text, name
    n0, t0 = _metric(url, "eagle_jax_generations_total"), _metric(url, "eagle_jax_generation_tokens_total")
    httpx.post(url + "/v1/completions", json={"prompt": "w5 w6", "max_tokens": 7}, timeout=60)
    httpx.post(url + "/v1/completions", json={"prompt": "", "max_tokens": 7})  # a 400
    assert _metric(url, "eagle_jax_generations_total") == n0 + 1
    assert 1 <= _metric(url, "eagle_jax_generation_tokens_total") - t0 <= 7
    assert _metric(url, 'eagle_jax_requests_total{endpoint="/v1/completions",status="400"}') >= 1
    assert _metric(url, "eagle_jax_tau") >= 1.0


def test_loadtest_script_reports_levels(server, tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("loadtest", Path(__file__).parent.parent / "serve" / "loadtest.py")
    lt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lt)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w6"}\n{"prompt": "w7"}\n')
    rc = lt.main(["--url", server[0], "--concurrency", "1,3", "--duration", "1.5", "--max-tokens", "8",
                  "--prompts", str(prompts)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert [lv["concurrency"] for lv in out["levels"]] == [1, 3]
    for lv in out["levels"]:
        assert lv["ok"] >= 1 and lv["errors"] == 0 and lv["completion_tokens"] >= lv["ok"]
        assert lv["latency_p50_s"] <= lv["latency_p99_s"] and lv["tau"] >= 1.0


def test_not_ready_is_503(tiny_hf_dir):
    state = ServerState(ServeOptions(model=str(tiny_hf_dir)), progress=False)
    from starlette.testclient import TestClient

    from eagle_jax.serve.server import create_app

    app = create_app(state)
    state.load = lambda: None  # stay "loading"
    with TestClient(app) as tc:
        assert tc.get("/health").status_code == 503
        r = tc.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]


def test_non_streaming_client_that_hangs_up_cancels(server, engine, slow_steps):
    import socket
    import time

    prompt = _long_prompt(engine)
    url, _ = server
    before, tokens = _metric(url, CANCELLED), _metric(url, "eagle_jax_generation_tokens_total")
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 100,
                       "temperature": 0}).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.5)
    assert _wait_for_cancelled(url, before) == before + 1
    assert _metric(url, "eagle_jax_generation_tokens_total") - tokens < 100  # cut short, not run to its end


def test_oversized_body_is_413_and_full_queue_is_503(server, monkeypatch):
    url, state = server
    big = json.dumps({"prompt": "w5 " * (3 << 20)})
    r = httpx.post(url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    monkeypatch.setattr(state.scheduler, "max_waiting", 0)
    r = httpx.post(url + "/v1/completions", json={"prompt": "w5", "max_tokens": 3})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"
    monkeypatch.undo()
    assert httpx.post(url + "/v1/completions", json={"prompt": "w5", "max_tokens": 3}, timeout=60).status_code == 200


def test_api_key_is_enforced_when_set(server, monkeypatch):
    import dataclasses

    url, state = server
    monkeypatch.setattr(state, "opts", dataclasses.replace(state.opts, api_key="sesame"))
    body = {"prompt": "w5", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    ok = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
    assert ok.completions.create(model="tiny", prompt="w5", max_tokens=2).usage.completion_tokens >= 1
