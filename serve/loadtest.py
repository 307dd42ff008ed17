"""Load test for `python -m eagle_jax.serve --port P`: N concurrent clients for a bounded time.

    python serve/loadtest.py --url http://127.0.0.1:8000 --concurrency 1,4,16 --duration 60

Each client sends streamed chat completions back to back (prompts cycled from a JSONL file of
`{"prompt": ...}` lines) until the duration is over; requests still running then are allowed to
finish (they count) up to --timeout. Per concurrency level it reports requests, errors,
throughput (completion tokens/s and requests/s over the level's wall time), latency and
time-to-first-token percentiles, and the server's tau from the responses' `eagle_jax` usage
fields when the server gives them. The last stdout line is one JSON object with every level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "eagle_jax" / "data" / "eval_chat_prompts.jsonl"


def load_prompts(path: Path) -> list[str]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            obj = json.loads(line)
            if not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{n}: expected an object with a string \"prompt\"")
            out.append(obj["prompt"])
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, body: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    first, usage, text, err, calls = None, None, [], None, 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                msg = (await r.aread()).decode(errors="replace")[:200]
                return {"ok": False, "error": f"HTTP {r.status_code}: {msg}", "latency": time.perf_counter() - t0}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"].get("message", "error")
                    continue
                if obj.get("usage"):
                    usage = obj["usage"]
                    calls = (obj.get("eagle_jax") or {}).get("target_calls", 0)
                for ch in obj.get("choices", []):
                    piece = ch.get("delta", {}).get("content")
                    if piece:
                        if first is None:
                            first = time.perf_counter() - t0
                        text.append(piece)
    except (httpx.HTTPError, OSError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "latency": time.perf_counter() - t0}
    lat = time.perf_counter() - t0
    if err is not None:
        return {"ok": False, "error": err, "latency": lat}
    return {"ok": True, "latency": lat, "ttft": first if first is not None else lat,
            "tokens": (usage or {}).get("completion_tokens", 0), "target_calls": calls, "chars": sum(map(len, text))}


async def run_level(url: str, prompts: list[str], concurrency: int, duration: float, max_tokens: int,
                    temperature: float, timeout: float, model: str | None) -> dict:
    deadline = time.perf_counter() + duration
    results: list[dict] = []
    counter = iter(range(10 ** 9))

    async def client_loop(client):
        while time.perf_counter() < deadline:
            i = next(counter)
            body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": max_tokens,
                    "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
            if model:
                body["model"] = model
            results.append(await one_request(client, url, body, timeout))

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    errors: dict[str, int] = {}
    for r in results:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    calls = sum(r["target_calls"] for r in ok)
    lat, ttft = [r["latency"] for r in ok], [r["ttft"] for r in ok]
    return {"concurrency": concurrency, "wall_s": round(wall, 2), "requests": len(results), "ok": len(ok),
            "errors": sum(errors.values()), "error_kinds": errors, "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2), "tau": round(tokens / calls, 3) if calls else None,
            "requests_per_s": round(len(ok) / wall, 3),
            **{f"latency_p{q}_s": round(percentile(lat, q), 3) for q in (50, 90, 99)},
            **{f"ttft_p{q}_s": round(percentile(ttft, q), 3) for q in (50, 90, 99)}}


def table(levels: list[dict]) -> str:
    cols = ["concurrency", "requests", "errors", "tokens_per_s", "tau", "requests_per_s", "latency_p50_s",
            "latency_p90_s", "latency_p99_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s"]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    rows += ["| " + " | ".join(str(lv[c]) for c in cols) + " |" for lv in levels]
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels, run one after another")
    p.add_argument("--duration", type=float, default=60.0, help="seconds each level sends new requests")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with {\"prompt\"} lines")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds")
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's own)")
    args = p.parse_args(argv)
    prompts = load_prompts(args.prompts)
    try:
        health = httpx.get(f"{args.url}/health", timeout=10).json()
    except (httpx.HTTPError, OSError, ValueError) as e:
        print(f"error: cannot reach {args.url}/health: {e}", file=sys.stderr)
        return 2
    if health.get("status") != "ok":
        print(f"error: the server is not ready: {health}", file=sys.stderr)
        return 2
    levels = []
    for c in (int(x) for x in args.concurrency.split(",")):
        print(f"[loadtest] concurrency {c} for {args.duration:g}s ...", file=sys.stderr, flush=True)
        levels.append(asyncio.run(run_level(args.url, prompts, c, args.duration, args.max_tokens, args.temperature,
                                            args.timeout, args.model)))
    print(table(levels), file=sys.stderr)
    print(json.dumps({"server": health, "max_tokens": args.max_tokens, "levels": levels}))
    return 0 if all(lv["errors"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
