"""uvicorn serving an Endpoint: from a thread (ServerThread: tests, a training run's agents) or in the foreground
(serve_forever: `relayrl serve`).

It imports uvicorn and relayrl.serve's own modules.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from relayrl.serve.app import Endpoint, check_bind


class ServerThread:
    """`endpoint` served by uvicorn on host:port from a daemon thread (port 0: an ephemeral port); start() returns
    once it listens, .base_url is then http://host:port/v1."""

    def __init__(self, endpoint: Endpoint, host: str = "127.0.0.1", port: int = 0):
        check_bind(host, endpoint.token)
        self.endpoint, self.host = endpoint, host
        config = uvicorn.Config(endpoint.app, host=host, port=port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="relayrl-serve-http", daemon=True)
        self.port = port

    def start(self, timeout_s: float = 30.0, engine_thread: bool = True) -> ServerThread:
        """Serve; `engine_thread` False: the caller steps the engine (endpoint.loop.pump), as training does."""
        if engine_thread:
            self.endpoint.start()
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the endpoint did not start listening on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def episode_url(self, episode: str) -> str:
        return f"{self.url}/episodes/{episode}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.endpoint.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def serve_forever(endpoint: Endpoint, host: str, port: int) -> None:
    """Serve in the foreground until interrupted (Ctrl-C), then stop the engine loop."""
    check_bind(host, endpoint.token)
    endpoint.start()
    try:
        uvicorn.Server(uvicorn.Config(endpoint.app, host=host, port=port, log_level="info", lifespan="off")).run()
    finally:
        endpoint.close()
