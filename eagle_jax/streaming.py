"""Token streams: one generation cut into device calls, so a caller can emit tokens as they come
and stop between calls (a server's client disconnects; a stop string appears).

`TokenStream.advance()` runs a few steps on device (plain decoding or speculative verification
steps; each call is one jitted function, compiled once per shape) and returns the token ids that
are new since the previous call. Same seed ⇒ the same tokens as the one-shot `Engine.generate_ids`.
`IncrementalText` turns growing token lists into text deltas, holding back what could still change
(an incomplete UTF-8 sequence, the start of a stop string).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .decoding import decode_advance, decode_output, decode_start
from .engine import call_stats
from .speculative import spec_advance, spec_output, spec_start


class TokenStream:
    """A single prompt's generation in progress (batch of one).

    Built by `Engine.start_stream`; `advance(n_steps)` → new token ids; `done`, `finish_reason`,
    `target_calls` and `accept_lengths` describe it so far.
    """

    def __init__(self, engine, method: str, args: tuple):
        """args: (tokens [1, S], prompt lengths [1], max_new_tokens, eos ids, sampling params, key)."""
        self.engine, self.method = engine, method
        tokens_bs, prompt_len_b, *self._args = args
        self._read = int(np.asarray(prompt_len_b)[0])  # tokens before _read were returned already
        self.tokens: list[int] = []
        self.t_start = time.perf_counter()
        fn, a, kw = _start_call(engine, method, tokens_bs, prompt_len_b, self._args)
        self._state = fn(*a, **kw)
        self.done = False
        self._first = True

    def _output(self):
        """The one-shot functions' output for the state so far (host arrays)."""
        if self.method == "vanilla":
            return jax.device_get(decode_output(self._state, self._args[0]))
        return jax.device_get(spec_output(self._state))

    def advance(self, n_steps: int = 1) -> list[int]:
        """New token ids (the first call returns the prefill's token without running a step)."""
        if self._first:
            self._first = False
        elif not self.done:
            fn, a, kw = _advance_call(self.engine, self.method, self._state, self._args, jnp.int32(n_steps))
            self._state = fn(*a, **kw)
        # whole arrays to the host, indexed there: indexing them on the device compiled a small program
        # for every new slice length (0.1-0.2 s of a first stream, 4 programs)
        tokens, length, done = jax.device_get((self._state.tokens, self._state.length, self._state.done))
        length, done = int(length[0]), bool(done[0])
        new = [int(t) for t in tokens[0, self._read:length]]
        self._read = length
        self.tokens.extend(new)
        self.done = done
        return new

    @property
    def target_calls(self) -> int:
        return call_stats(self._output())[0]

    @property
    def accept_lengths(self) -> list[int]:
        """Tokens per target pass, the prefill's first token included (as `Generation.accept_lengths`)."""
        return call_stats(self._output())[1]

    @property
    def finish_reason(self) -> Optional[str]:
        return self.engine.finish_reason(self.tokens) if self.done else None


def _start_call(e, method: str, tokens_bs, prompt_len_b, rest: list):
    """(program, args, kwargs) that start a stream: one spelling for running it and for compiling it
    (`compile_stream`), so that both hit the same cache entry."""
    if method == "vanilla":
        return decode_start, (e.params, e.cfg, tokens_bs, prompt_len_b, *rest), {"prefill_chunk": e.prefill_chunk}
    return (spec_start, (e.params, e.cfg, e.heads[method], tokens_bs, prompt_len_b, *rest),
            {"budget": e.budgets[method], "prefill_chunk": e.prefill_chunk})


def _advance_call(e, method: str, state, rest: list, n_steps):
    """(program, args, kwargs) that advance a stream by `n_steps` (an int32 scalar) steps."""
    if method == "vanilla":
        return decode_advance, (e.params, e.cfg, state, *rest, n_steps), {}
    return spec_advance, (e.params, e.cfg, e.heads[method], state, *rest), {"budget": e.budgets[method],
                                                                           "n_steps": n_steps}


def compile_stream(engine, method: str, args: tuple) -> None:
    """Trace and compile, without running them, the two programs that a `TokenStream` with these
    arguments (as `Engine._request` builds them) runs: the start and the advance. XLA compiles a
    program, and loads one from its disk cache, without holding the GIL, so threads can compile
    several shapes at once (the server's cache buckets: `Engine.compile_streams`)."""
    tokens_bs, prompt_len_b, *rest = args
    fn, a, kw = _start_call(engine, method, tokens_bs, prompt_len_b, rest)
    lowered = fn.lower(*a, **kw)
    compiled = lowered.compile()
    # the advance gets the start's output: its types and where it lies (a different sharding is a
    # different program), as the running stream will hand them over
    state = jax.tree.map(lambda t, sh: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=sh, weak_type=t.weak_type),
                         lowered.out_info, compiled.output_shardings)
    fn, a, kw = _advance_call(engine, method, state, rest, jax.ShapeDtypeStruct((), jnp.int32))
    fn.lower(*a, **kw).compile()


class IncrementalText:
    """Detokenise a growing list of ids into text deltas, with stop strings.

    `push(ids)` → (delta, stopped). The text is always `decode(all ids)`; a delta is held back while
    it ends in incomplete characters (U+FFFD: byte-fallback tokenizers give one per byte token of a
    character not yet complete) or could be the start of a stop string. When a stop string appears,
    the text is cut before it and `stopped` is True; `tokens_used` then counts the ids up to the one
    that completed it (what a decoder that stops there would have produced), not those after it.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # emitted so far
        self.stopped = False
        self._used = 0  # ids up to the one that completed the stop string (once stopped)

    @property
    def tokens_used(self) -> int:
        """The ids that count: up to and including the one that completed a stop string, else all."""
        return self._used if self.stopped else len(self.ids)

    def _find_stop(self, text: str, start: int) -> int:
        """Where the first stop string in `text` (searched from about `start`) begins; -1 if none."""
        found = [at for s in self.stop if (at := text.find(s, max(0, start - len(s) + 1))) >= 0]
        return min(found, default=-1)

    def push(self, ids: Sequence[int], final: bool = False) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        before = len(self.ids)
        self.ids.extend(ids)
        full = self.decode(self.ids)
        if self._find_stop(full, len(self.text)) >= 0:
            # Stop where a decoder checking after every id would have: at the fewest ids whose text
            # holds a stop string (the earlier ids' text held none), cut before its first one there.
            self._used = next((n for n in range(before + 1, len(self.ids))
                               if self._find_stop(self.decode(self.ids[:n]), len(self.text)) >= 0), len(self.ids))
            if self._used < len(self.ids):
                full = self.decode(self.ids[:self._used])
            full, self.stopped = full[:self._find_stop(full, len(self.text))], True
        if not (final or self.stopped):
            full = full.rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
            full = full[:len(full) - hold]
        if not full.startswith(self.text):
            # Detokenisation changed an earlier character (rare: merged whitespace). Keep what was sent.
            full = self.text + full[len(self.text):]
        delta, self.text = full[len(self.text):], full
        return delta, self.stopped
