"""`python -m eagle_jax.serve` as a process: the server's graceful SIGTERM, the terminal chat, and
(slow) the real SmolLM2 server answering exactly as the one-shot CLI does."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_util import ServerThread, free_port

from eagle_jax.engine import Engine
from eagle_jax.serve.chat import run_chat


def _wait_ready(url: str, proc, timeout: float = 300):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError("server not ready")


def _stream(url, prompt, max_tokens, out: dict, first: threading.Event):
    text, finish, done = "", None, False
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                            "temperature": 0, "stream": True}) as r:
        for ln in r.iter_lines():
            if ln == "data: [DONE]":
                done = True
            elif ln.startswith("data: {"):
                obj = json.loads(ln[6:])
                first.set()
                ch = obj["choices"][0]
                text += ch["delta"].get("content", "")
                finish = ch["finish_reason"] or finish
    out[prompt] = (text, finish, done)


def test_sigterm_finishes_in_flight_requests_then_exits(tiny_hf_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The tiny model finishes a request in a fraction of a second, which would race the check that
    # requests are queued at SIGTERM: the server process slows every scheduler turn by 25 ms instead.
    launcher = ("import sys, time\n"
                "from eagle_jax.serve import scheduler\n"
                "turn = scheduler.Scheduler._turn\n"
                "scheduler.Scheduler._turn = lambda self, job: (time.sleep(0.025), turn(self, job))[1]\n"
                "from eagle_jax.serve.cli import main\n"
                "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher, "--model", str(tiny_hf_dir), "--port", str(port),
                             "--method", "eagle3", "--drafter", "random", "--max-cache-len", "160",
                             "--cache-buckets", "160", "--max-active", "1", "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(url, proc)
        prompts = [f"w{5 + i} w{9 + i}" for i in range(4)]  # max_active=1: three of them wait in the queue
        out, first = {}, threading.Event()
        threads = [threading.Thread(target=_stream, args=(url, p, 120, out, first)) for p in prompts]
        for t in threads:
            t.start()
            time.sleep(0.05)
        assert first.wait(60)
        t0 = time.monotonic()
        while httpx.get(url + "/health").json()["waiting"] < 3 and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        assert httpx.get(url + "/health").json()["waiting"] >= 2  # requests in flight and queued at SIGTERM
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no new connections once shutting down
            httpx.get(url + "/health", timeout=2)
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    engine = Engine(str(tiny_hf_dir), progress=False)
    engine.add_method("eagle3", "random")
    for p in prompts:
        text, finish, done = out[p]
        ref = engine.generate(p, 120, method="eagle3")
        assert done and finish == ref.finish_reason and text == ref.text


def test_chat_loop_streams_keeps_history_and_resets(tiny_hf_dir):
    """Answers, history and /reset; the programs are compiled before the first prompt is read (no
    answer traces one)."""
    from eagle_jax.cpu_jit import TRACE_COUNTS

    engine = Engine(str(tiny_hf_dir), progress=False, max_cache_len=128)
    lines = iter(["w5 w6", "", "w7", "/reset", "w5 w6", "/exit"])
    traces = []

    def read(_):
        traces.append(dict(TRACE_COUNTS))
        return next(lines)

    out, err = io.StringIO(), io.StringIO()
    assert run_chat(engine, max_new_tokens=10, read=read, out=out, err=err) == 0
    assert traces[0] == traces[-1] and traces[0].get("decode_advance")
    answers = out.getvalue().splitlines()
    first = engine.generate_ids(engine.encode("w5 w6"), 10)
    second = engine.generate_ids(engine.encode([{"role": "user", "content": "w5 w6"},
                                                {"role": "assistant", "content": first.text},
                                                {"role": "user", "content": "w7"}]), 10)
    assert answers == [first.text, second.text, first.text]  # after /reset the history is gone
    stats = [ln for ln in err.getvalue().splitlines() if "tok/s" in ln]
    assert len(stats) == 3 and all("tau 1.00" in s for s in stats)
    assert "compiled vanilla decoding for a 128-token cache" in err.getvalue().splitlines()[0]  # before any answer


def test_chat_cli_reads_stdin_until_eof(tiny_hf_dir):
    r = subprocess.run([sys.executable, "-m", "eagle_jax.serve", "--chat", "--model", str(tiny_hf_dir),
                        "--max-new-tokens", "6", "--max-cache-len", "64"], input="w5 w6\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    engine = Engine(str(tiny_hf_dir), progress=False)
    assert engine.generate("w5 w6", 6).text in r.stdout
    assert "tok/s" in r.stderr and "tau" in r.stderr


def test_cli_needs_a_mode(capsys):
    from eagle_jax.serve.cli import main

    assert main([]) == 2
    assert "--prompt" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_server_answers_like_the_cli():
    """The default server (SmolLM2 + the packaged EAGLE-3 drafter) gives the one-shot CLI's tokens."""
    prompt, n = "Name three uses of a paperclip.", 48
    r = subprocess.run([sys.executable, "-m", "eagle_jax.serve", "--prompt", prompt, "--max-new-tokens", str(n),
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    cli = json.loads(r.stdout)
    from eagle_jax.serve.server import ServeOptions, ServerState

    state = ServerState(ServeOptions(max_cache_len=256, cache_buckets=(256,)), progress=False)
    with ServerThread(state) as url:
        assert state.method == "eagle3"
        resp = httpx.post(url + "/v1/chat/completions", timeout=300,
                          json={"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                                "temperature": 0}).json()
    assert resp["choices"][0]["message"]["content"] == cli["text"]
    assert resp["usage"]["completion_tokens"] == cli["new_tokens"]
    assert resp["eagle_jax"]["method"] == "eagle3" and resp["eagle_jax"]["tau"] > 1.0


def test_engine_layer_layouts_decode_the_same(tiny_hf_dir):
    """`layers="unroll"` (the CPU default) and `layers="scan"` are two programs for one model."""
    scan = Engine(str(tiny_hf_dir), progress=False, layers="scan")
    unroll = Engine(str(tiny_hf_dir), progress=False, layers="unroll")
    assert (scan.layers, unroll.layers) == ("scan", "unroll")
    assert Engine(str(tiny_hf_dir), progress=False).layers == "unroll"  # auto, on this CPU backend
    for e in (scan, unroll):
        e.add_method("eagle3", "random")
    for p in ("w5 w6", "w9 w3 w3"):
        ref = scan.generate(p, 24)
        assert unroll.generate(p, 24).tokens == ref.tokens
        assert unroll.generate(p, 24, method="eagle3").tokens == ref.tokens
    with pytest.raises(ValueError, match="layers must be"):
        Engine(str(tiny_hf_dir), progress=False, layers="loop")
