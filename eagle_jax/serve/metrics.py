"""Prometheus metrics of the HTTP server (`GET /metrics`, text exposition format).

One registry per server (tests start several in one process). Names follow Prometheus
conventions: counters end in `_total`, durations are seconds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_accept: int = 16):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("eagle_jax_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("eagle_jax_generations", "Finished generations by finish reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("eagle_jax_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generation_tokens = Counter("eagle_jax_generation_tokens",
                                         "Completion tokens (up to a stop string, as billed)", registry=r)
        self.target_calls = Counter("eagle_jax_target_calls",
                                    "Target forward passes that produced tokens (prefill's included)", registry=r)
        self.tau = Gauge("eagle_jax_tau", "Mean acceptance length: tokens produced / target calls, since start",
                         registry=r)
        self.accept_length = Histogram("eagle_jax_accept_length", "Tokens produced per target pass",
                                       buckets=tuple(range(1, max_accept + 1)), registry=r)
        self.latency = Histogram("eagle_jax_request_latency_seconds", "Submit to last token", registry=r,
                                 buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("eagle_jax_time_to_first_token_seconds", "Submit to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram("eagle_jax_queue_wait_seconds", "Submit to start of prefill", registry=r,
                                    buckets=LATENCY_BUCKETS)
        self.waiting = Gauge("eagle_jax_requests_waiting", "Requests queued, not started", registry=r)
        self.running = Gauge("eagle_jax_requests_running", "Generations in flight", registry=r)
        self._tokens = 0
        self._calls = 0

    def observe_job(self, job):
        """Record a finished `scheduler.Job` (called from the scheduler thread)."""
        self.finished.labels(job.finish_reason).inc()
        self.prompt_tokens.inc(len(job.prompt_ids))
        self.generation_tokens.inc(job.completion_tokens)
        s = job.stream
        if s is not None:
            calls = s.target_calls
            self.target_calls.inc(calls)
            self._tokens += job.generated_tokens  # every token the calls made, past a stop string too
            self._calls += calls
            if self._calls:
                self.tau.set(self._tokens / self._calls)
            for a in s.accept_lengths:
                self.accept_length.observe(a)
            self.queue_wait.observe(max(s.t_start - job.t_submit, 0.0))
        if job.t_end is not None:
            self.latency.observe(job.t_end - job.t_submit)
        if job.t_first is not None:
            self.ttft.observe(job.t_first - job.t_submit)

    def render(self) -> bytes:
        return generate_latest(self.registry)
