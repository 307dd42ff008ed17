"""`python -m eagle_jax.serve --chat`: an interactive terminal chat.

Each answer streams token by token; after it, a status line shows tokens, tokens/s and tau (mean
tokens per target pass). The decoding programs are compiled before the first prompt (said on
stderr), so no answer's tokens/s counts the compile. The conversation is kept (the chat template
sees every turn) until it would no longer fit the cache, when the oldest turns are dropped; the
system prompt (`--system`) is kept. Commands: `/reset` starts over (with the same system prompt),
`/exit` (or Ctrl-D) quits.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

from ..streaming import IncrementalText

HELP = "commands: /reset (new conversation), /exit (or Ctrl-D)"


def _fit(engine, history: list[dict], max_new_tokens: int) -> tuple[list[int], list[dict]]:
    """Token ids of the conversation, oldest turns dropped until prompt + answer fit the cache.

    A leading system message is kept; what follows it still starts with a user turn (templates
    that want user/assistant alternation refuse anything else), and the last turn is always kept."""
    head = history[:1] if history and history[0]["role"] == "system" else []
    turns = history[len(head):]
    while True:
        ids = engine.encode(head + turns)
        if len(ids) + max_new_tokens <= engine.max_cache_len or len(turns) <= 1:
            return ids, head + turns
        turns = turns[1:]
        while len(turns) > 1 and turns[0]["role"] != "user":
            turns = turns[1:]


def run_chat(engine, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int = 0, system: Optional[str] = None, read: Callable[[str], str] = input,
             out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The chat loop; `read` raises EOFError at end of input."""
    # compile the one shape every answer uses, so that no answer's speed counts it
    seconds = engine.warm_stream(engine.max_cache_len, temperature=temperature, top_p=top_p, top_k=top_k)
    print(f"[eagle_jax] compiled {engine.method} decoding for a {engine.max_cache_len}-token cache in "
          f"{seconds:.1f}s", file=err, flush=True)
    print(f"[eagle_jax] chatting with {engine.name} (method {engine.method}); {HELP}", file=err, flush=True)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    turn = 0
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = [{"role": "system", "content": system}] if system else []
            print("[conversation cleared]", file=err, flush=True)
            continue
        history.append({"role": "user", "content": text})
        ids, history = _fit(engine, history, max_new_tokens)
        if len(ids) + 1 > engine.max_cache_len:
            alone = "with the system prompt" if system else "alone"
            print(f"[that message {alone} has {len(ids)} tokens, more than the cache of {engine.max_cache_len}]",
                  file=err, flush=True)
            history.pop()
            continue
        n_new = min(max_new_tokens, engine.max_cache_len - len(ids))
        t0 = time.perf_counter()
        stream = engine.start_stream(ids, n_new, temperature=temperature, top_p=top_p, top_k=top_k,
                                     seed=seed + turn, cache_len=engine.max_cache_len)  # one shape, one compile
        inc = IncrementalText(engine.decode)
        try:
            while not stream.done:
                delta, _ = inc.push(stream.advance(1))
                out.write(delta)
                out.flush()
        except KeyboardInterrupt:  # stop this answer, keep the conversation
            pass
        out.write(inc.push([], final=True)[0] + "\n")
        out.flush()
        dt = time.perf_counter() - t0
        n = len(stream.tokens)
        tau = n / stream.target_calls if stream.target_calls else 0.0
        print(f"[{n} tokens, {n / max(dt, 1e-9):.1f} tok/s, tau {tau:.2f}]", file=err, flush=True)
        history.append({"role": "assistant", "content": inc.text})
        turn += 1
