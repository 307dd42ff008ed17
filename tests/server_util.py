"""Run the real HTTP server on a loopback port inside the test process (a uvicorn thread)."""

from __future__ import annotations

import socket
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(state) as url:` — serves until the block ends, ready when entered."""

    def __init__(self, state, ready_timeout: float = 600.0):
        import uvicorn

        from eagle_jax.serve.server import create_app

        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port, log_level="warning",
                             lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.ready_timeout = ready_timeout

    def __enter__(self) -> str:
        self.thread.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.ready_timeout:
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200:
                    return self.url
                if r.json().get("status") == "error":
                    raise RuntimeError(f"server failed to load: {r.json()}")
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become ready")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
