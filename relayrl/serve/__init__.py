"""The OpenAI-compatible endpoint on the rollout engine, recording every token it serves (issue 34).

    Endpoint(engine, model_name, token=...)   the ASGI app (.app), the engine loop, the recorder (relayrl.serve.app)
    ServerThread(endpoint, host, port)        uvicorn serving it from a thread (tests, a training run)
    check_bind(host, token)                   off loopback, a token is required

A front of the rollout side, never of the trainer: it imports the engine, envs (chat format, tool-call parser) and
relayrl's ground floor, plus starlette and uvicorn. Nothing in relayrl's core imports this package (the CLI's
`relayrl serve` and relayrl.jobs.serve do, lazily), so the trainer runs without the `serve` extra installed.
"""

from typing import TYPE_CHECKING

from relayrl.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "Endpoint": "relayrl.serve.app", "check_bind": "relayrl.serve.app", "ServerThread": "relayrl.serve.server",
    "Recorder": "relayrl.serve.capture", "EngineLoop": "relayrl.serve.engine_loop",
})
__all__ = ["EngineLoop", "Endpoint", "Recorder", "ServerThread", "check_bind"]

if TYPE_CHECKING:
    from relayrl.serve.app import Endpoint, check_bind
    from relayrl.serve.capture import Recorder
    from relayrl.serve.engine_loop import EngineLoop
    from relayrl.serve.server import ServerThread
