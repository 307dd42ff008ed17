"""The generation scheduler: one worker thread owns the device and interleaves requests.

Requests wait in a FIFO queue; up to `max_active` are in flight at once and advance round-robin,
one `TokenStream.advance` (a few speculative steps) per turn, so every stream makes progress and a
new request starts after at most one turn of each running one. Each job reports to its asyncio
consumer through `Job.events` (thread-safe hand-off); a job whose consumer went away is cancelled
at its next turn, or dropped from the queue unstarted. `stop()` ends the worker: running and
waiting jobs finish with "cancelled".

Batching: the streams are batch-of-one states of static shape; batching several requests into one
speculative step (the stretch goal) would replace the round-robin turn with one batched advance over
the active states of the same cache bucket — `Job` and the queue stay as they are.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..streaming import IncrementalText, TokenStream

log = logging.getLogger("eagle_jax.serve")


class QueueFull(RuntimeError):
    pass


@dataclass
class Job:
    """One generation request as the worker sees it."""

    prompt_ids: list[int]
    max_tokens: int
    cache_len: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    loop: Optional[asyncio.AbstractEventLoop] = None
    events: Optional[asyncio.Queue] = None
    # filled in by the worker
    stream: Optional[TokenStream] = None
    text: Optional[IncrementalText] = None
    finish_reason: Optional[str] = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: Optional[float] = None
    t_end: Optional[float] = None
    _cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def generated_tokens(self) -> int:
        """Every token the device produced (a speculative step may run past a stop string)."""
        return len(self.stream.tokens) if self.stream is not None else 0

    @property
    def completion_tokens(self) -> int:
        """The tokens billed: a stopped text counts up to the token that completed its stop string."""
        if self.text is not None and self.text.stopped:
            return self.text.tokens_used
        return self.generated_tokens

    def cancel(self):
        """Ask the worker to drop this job at its next turn (safe from any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def post(self, kind: str, payload=None):
        if self.loop is not None and self.events is not None:
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass


class Scheduler:
    """FIFO admission, round-robin turns, one worker thread.

    Args:
      engine: the loaded `Engine` (its method, heads and budgets are used as they are).
      max_active: generations in flight at once (each holds its own KV cache).
      max_waiting: queued requests beyond which `submit` refuses (`QueueFull`): back-pressure, so a
        flood gets fast 503s instead of unbounded latency.
      steps_per_turn: device steps per turn (speculative steps or plain tokens).
      on_finish: called in the worker thread with each finished job (metrics).
    """

    def __init__(self, engine, max_active: int = 8, steps_per_turn: int = 1,
                 on_finish: Optional[Callable[[Job], None]] = None, max_waiting: int = 256):
        self.engine = engine
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.steps_per_turn = steps_per_turn
        self.on_finish = on_finish
        self.waiting: collections.deque[Job] = collections.deque()
        self.active: list[Job] = []
        self._cond = threading.Condition()
        self._running = False
        self._thread: Optional[threading.Thread] = None

    # -- control
    def start(self):
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="eagle_jax-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0):
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job):
        with self._cond:
            if not self._running:
                raise RuntimeError("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"the server is at capacity ({len(self.active)} running, {len(self.waiting)} "
                                f"queued); retry later")
            self.waiting.append(job)
            self._cond.notify()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_active(self) -> int:
        return len(self.active)

    # -- worker
    def _loop(self):
        while True:
            with self._cond:
                while self._running and not self.waiting and not self.active:
                    self._cond.wait()
                if not self._running:
                    pending = list(self.waiting) + self.active
                    self.waiting.clear()
                    self.active.clear()
                    break
                gone = [j for j in self.waiting if j.cancelled]  # hung up while queued: never started
                if gone:
                    self.waiting = collections.deque(j for j in self.waiting if not j.cancelled)
                while self.waiting and len(self.active) < self.max_active:
                    self.active.append(self.waiting.popleft())
                turn = list(self.active)
            for job in gone:
                self._finish(job, "cancelled")
            for job in turn:
                if self._turn(job):
                    with self._cond:
                        self.active.remove(job)
        for job in pending:
            self._finish(job, "cancelled")

    def _turn(self, job: Job) -> bool:
        """Advance one job; True when it is finished (done, stopped, cancelled or failed)."""
        if job.cancelled:
            self._finish(job, "cancelled")
            return True
        try:
            if job.stream is None:
                job.text = IncrementalText(self.engine.decode, job.stop)
                job.stream = self.engine.start_stream(
                    job.prompt_ids, job.max_tokens, temperature=job.temperature, top_p=job.top_p, top_k=job.top_k,
                    seed=job.seed, cache_len=job.cache_len)
            ids = job.stream.advance(self.steps_per_turn)
        except Exception as e:  # noqa: BLE001 - report to the client, keep serving
            log.exception("generation failed")
            job.post("error", f"generation failed: {type(e).__name__}: {e}")
            self._finish(job, "error")
            return True
        delta, stopped = job.text.push(ids, final=job.stream.done)
        if ids and job.t_first is None:
            job.t_first = time.perf_counter()
        if delta:
            job.post("delta", delta)
        if stopped or job.stream.done:
            self._finish(job, "stop" if stopped else job.stream.finish_reason)
            return True
        return False

    def _finish(self, job: Job, reason: str):
        job.finish_reason = reason
        job.t_end = time.perf_counter()
        if reason != "error":
            job.post("done", reason)
        if self.on_finish is not None:
            try:
                self.on_finish(job)
            except Exception:  # noqa: BLE001
                log.exception("on_finish hook failed")
