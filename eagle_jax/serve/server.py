"""The OpenAI-compatible HTTP server (Starlette on uvicorn).

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /health`, `GET /metrics`.

Start-up: the port opens at once and `/health` answers 503 `{"status": "loading"}` while the
model, the drafter and the tree budget load and every cache bucket's compiled shapes are warmed;
then 200 `{"status": "ok"}`. Requests go to the `Scheduler` (FIFO, round-robin over up to
`max_active` generations); a client that disconnects cancels its generation; SIGTERM stops
accepting connections, lets in-flight requests finish for `shutdown_timeout` seconds, then cancels
what is left. Bad input gets HTTP 400 with `{"error": {"message", "type", "param", "code"}}` (an
unknown model 404 `model_not_found`); any unexpected failure a 500 of the same shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import anyio
import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import openai_api as api
from .metrics import ServerMetrics
from .scheduler import Job, QueueFull, Scheduler

log = logging.getLogger("eagle_jax.serve")

SERVING_CACHE_LEN = 2048  # default context of the server and the chat (a CPU-sized compile)


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What the server loads and how it schedules (the CLI's flags)."""

    model: str = "smollm2-135m-instruct"
    method: Optional[str] = None  # None: eagle3 when a drafter is packaged for the model, else vanilla
    drafter: str = "default"
    budget: Optional[object] = None  # a TreeBudget; None = the method's default
    tune_path: Optional[Path] = None  # autotune the tree budget at start-up and save it here
    tune_lookups: Optional[tuple] = None  # the lookup chains that tuning tries (None: autotune's default)
    tune_lookup_ngrams: Optional[tuple] = None  # their shortest n-grams that tuning tries (None: the default)
    dtype: str = "float32"
    attention: str = "reference"
    layers: str = "auto"  # target layers: unroll | scan | auto (Engine's `layers`)
    matmul: str = "auto"  # weight products: cpu_kernel | xla | auto (Engine's `matmul`)
    # the head's CPU-kernel rows (Engine's): auto | b16 | i8 | q8_0x8 | q4_1x8 | q8_0 | q4_1 | f16
    draft_rows: str = "auto"
    activations: str = "auto"  # the target's few-row products on float32 or int8 rows of x: auto | float32 | int8
    prefill_chunk: object = None  # Engine's `prefill_chunk`: N, (big, tail) or None (its default)
    max_cache_len: int = SERVING_CACHE_LEN
    cache_buckets: tuple[int, ...] = ()  # () = 512 and max_cache_len
    max_active: int = 8
    max_waiting: int = 256
    max_body_bytes: int = 4 << 20
    steps_per_turn: int = 1
    default_max_tokens: int = 512
    served_model_name: Optional[str] = None
    shutdown_timeout: float = 30.0
    warmup: bool = True
    api_key: Optional[str] = None  # when set, /v1/* needs `Authorization: Bearer <api_key>`

    def buckets(self) -> tuple[int, ...]:
        b = self.cache_buckets or (512, self.max_cache_len)
        out = sorted({min(x, self.max_cache_len) for x in b} | {self.max_cache_len})
        if out[0] < 2:
            raise ValueError(f"cache buckets must be at least 2 tokens, got {out}")
        return tuple(out)


def pick_method(model: str, method: Optional[str], drafter: str) -> str:
    """eagle3 with the packaged drafter when one exists for the model (or a drafter is named)."""
    if method:
        return method
    from ..engine import default_drafter_path

    return "eagle3" if drafter != "default" or default_drafter_path(model, "eagle3") is not None else "vanilla"


class ServerState:
    """The engine, scheduler and metrics behind the routes; loads in a background thread."""

    def __init__(self, opts: ServeOptions, engine=None, progress: bool = True):
        self.opts = opts
        self.engine = engine
        self.progress = progress
        self.metrics = ServerMetrics()
        self.scheduler: Optional[Scheduler] = None
        self.ready = False
        self.load_error: Optional[str] = None
        self.buckets = opts.buckets()
        self.model_name = opts.served_model_name or (engine.name if engine is not None else opts.model)
        self.method = "vanilla"
        self.t_ready: Optional[float] = None

    def _say(self, msg: str):
        if self.progress:
            print(f"[eagle_jax.serve] {msg}", file=sys.stderr, flush=True)

    def load(self):
        try:
            t0 = time.perf_counter()
            o = self.opts
            if self.engine is None:
                from ..engine import Engine

                method = pick_method(o.model, o.method, o.drafter)
                self._say(f"loading {o.model} (method {method}) ...")
                self.engine = Engine(o.model, dtype=o.dtype, attention=o.attention, max_cache_len=o.max_cache_len,
                                     layers=o.layers, matmul=o.matmul, draft_rows=o.draft_rows,
                                     activations=o.activations, method=method,
                                     drafter=o.drafter, budget=o.budget, progress=self.progress,
                                     prefill_chunk=o.prefill_chunk)
                self.model_name = o.served_model_name or self.engine.name
                if o.tune_path is not None and self.engine.method != "vanilla":
                    from ..autotune import tune_and_save

                    tune_and_save(self.engine, self.engine.method, o.tune_path, log=self._say, drafter=o.drafter,
                                  lookups=o.tune_lookups, lookup_ngrams=o.tune_lookup_ngrams)
            self.engine.max_cache_len = self.buckets[-1]
            self.method = self.engine.method
            if o.warmup:
                self.warm_up()
            self.scheduler = Scheduler(self.engine, o.max_active, o.steps_per_turn,
                                       on_finish=self.metrics.observe_job, max_waiting=o.max_waiting)
            self.scheduler.start()
            self.ready, self.t_ready = True, time.time()
            self._say(f"ready in {time.perf_counter() - t0:.1f}s: model {self.model_name!r}, method {self.method}, "
                      f"cache buckets {list(self.buckets)}")
        except Exception as e:  # noqa: BLE001 - /health reports it; the process stays up to say so
            log.exception("loading failed")
            self.load_error = f"{type(e).__name__}: {e}"
            self._say(f"loading failed: {self.load_error}")

    def warm_up(self):
        """Compile every shape a request can hit: per cache bucket, the start and the advance (all
        buckets' programs at once, `Engine.compile_streams`, then a two-token stream each)."""
        seconds = self.engine.compile_streams(self.buckets)
        self._say(f"compiled the programs of {len(self.buckets)} cache buckets in {seconds:.1f}s")
        for i, b in enumerate(self.buckets, 1):
            seconds = self.engine.warm_stream(b)
            self._say(f"warmed cache bucket {b} ({i}/{len(self.buckets)}) in {seconds:.1f}s")

    # -- request → job
    def make_job(self, req: api.GenRequest) -> Job:
        if req.model is not None and req.model not in (self.model_name, self.opts.model):
            raise api.APIError(f"the model {req.model!r} does not exist on this server; it serves "
                               f"{self.model_name!r}", "model", status=404, code="model_not_found")
        e = self.engine
        param = "messages" if req.kind == "chat" else "prompt"
        if req.kind == "chat":
            try:
                ids = e.encode(req.messages)
            except (jinja2.TemplateError, ValueError) as ex:  # the template's raise_exception, or no template
                raise api.APIError(f"the model's chat template cannot render these messages: {ex}", "messages") \
                    from None
        elif isinstance(req.prompt, str):
            ids = e.encode(req.prompt, raw=True)
        else:
            bad = [t for t in req.prompt if not 0 <= t < e.cfg.vocab_size]
            if bad:
                raise api.APIError(f"token id {bad[0]} is outside the vocabulary [0, {e.cfg.vocab_size})", "prompt")
            ids = list(req.prompt)
        if not ids:
            raise api.APIError("the prompt is empty after tokenisation", param)
        ctx = self.buckets[-1]
        if len(ids) >= ctx:
            raise api.APIError(f"the prompt has {len(ids)} tokens; this server's context is {ctx} tokens "
                               f"(prompt + completion), so at most {ctx - 1} prompt tokens fit", param,
                               code="context_length_exceeded")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(self.opts.default_max_tokens, ctx - len(ids))
        elif len(ids) + max_tokens > ctx:
            raise api.APIError(f"max_tokens={max_tokens} with a prompt of {len(ids)} tokens exceeds this server's "
                               f"context of {ctx} tokens; at most {ctx - len(ids)} new tokens fit",
                               req.max_tokens_param,
                               code="context_length_exceeded")
        cache_len = next(b for b in self.buckets if b >= len(ids) + max_tokens)
        seed = req.seed if req.seed is not None else (secrets.randbits(31) if req.temperature > 0 else 0)
        return Job(prompt_ids=ids, max_tokens=max_tokens, cache_len=cache_len, temperature=req.temperature,
                   top_p=req.top_p, top_k=req.top_k, seed=seed, stop=req.stop)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise api.APIError(f"the request body has {declared} bytes; the limit is {limit}", status=413)
    chunks, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise api.APIError(f"the request body is over the limit of {limit} bytes", status=413)
        chunks.append(part)
    return b"".join(chunks)


def _error(e: api.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class JobStream(StreamingResponse):
    """Server-sent events of one job; the job is cancelled as soon as the client hangs up.

    Starlette's own response listens for the hang-up only under servers of ASGI spec < 2.4 (as
    uvicorn's HTTP protocols report today); under 2.4 it notices one only when a later write fails,
    and the job is cancelled only once the abandoned generator is finalized: a client gone while
    its job waits in the queue, or between two events, left the generation running to its end
    (`tests/test_server.py` drives the app as a 2.4 server). Here a task waits for
    `http.disconnect` beside the writer under every spec, and `job.cancel()` runs on every way out.
    """

    def __init__(self, content, job: Job, **kw):
        super().__init__(content, **kw)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:

                async def write():
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(write)
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()
        finally:
            self.job.cancel()


def create_app(state: ServerState) -> Starlette:
    m = state.metrics

    def count(endpoint: str, status: int):
        m.requests.labels(endpoint, str(status)).inc()

    def authorize(request: Request):
        key = state.opts.api_key
        if key and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {key}"):
            raise api.APIError("a valid API key is required (Authorization: Bearer <key>)", status=401,
                               type="authentication_error", code="invalid_api_key")

    async def generate(request: Request, kind: str):
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            authorize(request)
            if not state.ready:
                msg = (f"the model failed to load: {state.load_error}" if state.load_error
                       else "the model is still loading; retry when GET /health answers 200")
                raise api.APIError(msg, status=503, type="server_error", code="not_ready")
            body = api.decode_body(await _read_body(request, state.opts.max_body_bytes))
            req = api.parse_chat(body) if kind == "chat" else api.parse_completion(body)
            job = state.make_job(req)
        except api.APIError as e:
            count(endpoint, e.status)
            return _error(e)
        job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            state.scheduler.submit(job)
        except QueueFull as e:
            count(endpoint, 503)
            resp = _error(api.APIError(str(e), status=503, type="server_error", code="overloaded"))
            resp.headers["Retry-After"] = "1"
            return resp
        except RuntimeError as e:
            count(endpoint, 503)
            return _error(api.APIError(str(e), status=503, type="server_error"))
        m.waiting.set(state.scheduler.num_waiting)
        rid = api.new_id(kind)
        count(endpoint, 200)
        if req.stream:
            return JobStream(_stream(job, req, rid), job, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(request, job, req, rid)

    def _event_error(kind: str, payload) -> Optional[api.APIError]:
        """The error a job's last event stands for: a failed generation, or one cancelled by shutdown."""
        if kind == "error":
            return api.APIError(payload, status=500, type="server_error")
        if payload == "cancelled":
            return api.APIError("the server is shutting down; the generation was cancelled", status=503,
                                type="server_error")
        return None

    def _usage(job: Job) -> dict:
        return api.usage(len(job.prompt_ids), job.completion_tokens)

    def _extra(job: Job) -> dict:
        s = job.stream
        calls = s.target_calls if s is not None else 0
        return {"method": state.method, "target_calls": calls,
                "tau": round(job.generated_tokens / calls, 4) if calls else 0.0,
                "accept_lengths": s.accept_lengths if s is not None else []}

    async def _collect(request: Request, job: Job, req: api.GenRequest, rid: str):
        parts = []
        next_check = time.monotonic() + 0.25
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    kind = None
                if time.monotonic() >= next_check:  # events may never pause: check the client on a clock
                    next_check = time.monotonic() + 0.25
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; `finally` cancels the job
                if kind is None:
                    continue
                if kind == "delta":
                    parts.append(payload)
                elif (err := _event_error(kind, payload)) is not None:
                    return _error(err)
                else:
                    return JSONResponse(api.full_response(req.kind, rid, state.model_name, "".join(parts), payload,
                                                          _usage(job), _extra(job)))
        finally:
            job.cancel()  # a no-op once finished; stops the worker if this handler was cancelled

    async def _stream(job: Job, req: api.GenRequest, rid: str):
        """The job's events as server-sent events (`JobStream` cancels the job however it ends)."""
        created = int(time.time())
        k, name = req.kind, state.model_name
        if k == "chat":
            yield api.sse(api.chunk(k, rid, name, created, role=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "delta":
                yield api.sse(api.chunk(k, rid, name, created, text=payload))
                continue
            err = _event_error(kind, payload)
            if err is not None:
                yield api.sse(err.body())
            else:
                yield api.sse(api.chunk(k, rid, name, created, finish=payload))
                if req.include_usage:
                    yield api.sse({**api.chunk(k, rid, name, created, use=_usage(job)), "eagle_jax": _extra(job)})
            break
        yield api.SSE_DONE

    async def chat(request: Request):
        return await generate(request, "chat")

    async def completions(request: Request):
        return await generate(request, "completion")

    def _model_card() -> dict:
        info = {"method": state.method, "context_length": state.buckets[-1], "cache_buckets": list(state.buckets)}
        if state.engine is not None and state.method in state.engine.budgets:
            b = state.engine.budgets[state.method]
            info["tree_budget"] = {"kind": b.kind, "total_tokens": b.total_tokens, "depth": b.depth, "top_k": b.top_k,
                                   "lookup": b.lookup, "lookup_min_ngram": b.lookup_min_ngram}
        return {"id": state.model_name, "object": "model", "created": int(state.t_ready or time.time()),
                "owned_by": "eagle_jax", "eagle_jax": info}

    def models_response(request: Request) -> JSONResponse:
        name = request.path_params.get("name")
        authorize(request)
        if name is None:
            return JSONResponse({"object": "list", "data": [_model_card()]})
        if name not in (state.model_name, state.opts.model):
            raise api.APIError(f"the model {name!r} does not exist on this server; it serves {state.model_name!r}",
                               "model", status=404, code="model_not_found")
        return JSONResponse(_model_card())

    async def models(request: Request):
        endpoint = "/v1/models" if "name" not in request.path_params else "/v1/models/{name}"
        try:
            resp = models_response(request)
        except api.APIError as e:
            count(endpoint, e.status)
            return _error(e)
        count(endpoint, 200)
        return resp

    async def health(request: Request):
        if state.ready:
            return JSONResponse({"status": "ok", "model": state.model_name, "method": state.method,
                                 "waiting": state.scheduler.num_waiting, "running": state.scheduler.num_active})
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics(request: Request):
        if state.scheduler is not None:
            m.waiting.set(state.scheduler.num_waiting)
            m.running.set(state.scheduler.num_active)
        return Response(m.render(), media_type=m.content_type)

    async def http_error(request: Request, exc: HTTPException):
        typ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse({"error": {"message": msg, "type": typ, "param": None, "code": None}},
                            status_code=exc.status_code)

    async def server_error(request: Request, exc: Exception):
        """Any other failure: an OpenAI-shaped 500. No traceback goes to the client; Starlette re-raises
        the exception after this answer, so the server logs it."""
        if request.url.path in ("/v1/chat/completions", "/v1/completions"):
            count(request.url.path, 500)
        return JSONResponse({"error": {"message": "internal server error; the server log has the details",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loader = threading.Thread(target=state.load, name="eagle_jax-load", daemon=True)
        loader.start()
        yield
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.stop)

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})


def run_server(opts: ServeOptions, host: str = "127.0.0.1", port: int = 8000, engine=None,
               log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM (blocking); 0 after a graceful shutdown."""
    import uvicorn

    state = ServerState(opts, engine)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit and state.scheduler is not None:
                print(f"[eagle_jax.serve] shutting down: {state.scheduler.num_active} running and "
                      f"{state.scheduler.num_waiting} queued requests may finish within {opts.shutdown_timeout:g}s",
                      file=sys.stderr, flush=True)
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after shutting down; a graceful stop should exit 0 instead.
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(1, int(round(opts.shutdown_timeout))), lifespan="on")
    print(f"[eagle_jax.serve] listening on http://{host}:{port} (GET /health answers 200 once the model is "
          f"loaded and warm)", file=sys.stderr, flush=True)
    _Server(config).run()
    return 0
