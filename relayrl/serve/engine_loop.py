"""One thread owns the engine and steps it; HTTP handlers submit requests to it and await their events.

    handler (asyncio)  ── submit(ids, params) ──>  command queue  ──>  engine thread: add_request
                       <── events, via loop.call_soon_threadsafe ──   step() ... step()
    events:  ("tokens", [(new ids, new logprobs, new top logprobs)] per sample)   only for streaming requests
             ("done", RequestOutput)        the request ended (finish_reason per sample)
             ("error", UserError)           add_request refused it (a bad prompt, bad sampling settings)

Requests from concurrent clients join the engine's continuous batch as they arrive: nothing is serialized.
Every engine call happens on the engine thread, so the engine needs no lock; abort() is a command too, ordered
after the add it refers to, and frees the request's KV blocks on the thread that owns them.

A loop that is never start()ed is pumped instead (training, relayrl.serve.agents): pump() runs the commands and at
most one engine step on the caller's thread, so the driver loads new weights between two pumps and serving pauses
for exactly as long as the sync takes (requests arriving meanwhile wait in the command queue).

It imports the engine and relayrl.errors only.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from relayrl.engine.outputs import RequestOutput
from relayrl.engine.sampling_params import SamplingParams
from relayrl.errors import UserError

IDLE_WAIT_S = 0.05  # the longest the thread sleeps when no request is in flight (a submit wakes it at once)


@dataclass
class Handle:
    """A submitted request: its id and the asyncio queue its events arrive on."""

    request_id: int
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    stream: bool
    sent: list[int] = field(default_factory=list)  # per sample, the tokens already sent as "tokens" events
    episode: str | None = None  # the episode it serves (abort_episode ends all of them)

    def emit(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the client's event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """Steps `engine` on a thread of its own while requests are in flight; start() then submit() / abort()."""

    def __init__(self, engine):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[int, Handle] = {}
        self._ended: dict[str, None] = {}  # episodes aborted: a request of theirs still queued is refused (FIFO)
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="relayrl-serve-engine", daemon=True)
        self.steps = 0

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # ---- called from the server's event loop ----
    def submit(self, ids: list[int], params: SamplingParams, stream: bool = False, episode: str | None = None
               ) -> Handle:
        h = Handle(next(self._ids), asyncio.Queue(), asyncio.get_running_loop(), stream, [0] * params.n, episode)
        self._cmds.put(("add", h, ids, params))
        self._wake.set()
        return h

    def abort(self, handle: Handle) -> None:
        """Drop the request if it still runs (its KV blocks return to the pool); a no-op once it ended."""
        self._cmds.put(("abort", handle))
        self._wake.set()

    def wake(self) -> None:
        """End a pump's wait now (an agent finished without a request: its episode is to be settled)."""
        self._wake.set()

    def abort_episode(self, episode: str) -> None:
        """Abort every request of `episode` still running (an episode past its deadline); thread-safe."""
        self._cmds.put(("abort_episode", episode))
        self._wake.set()

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """fn(engine) on the engine thread, between two steps (e.g. its free block count, a weight update)."""
        fut: Future = Future()
        self._cmds.put(("call", fn, fut))
        self._wake.set()
        return fut

    @property
    def in_flight(self) -> int:
        return len(self._live)

    # ---- the engine thread (or the caller of pump) ----
    def pump(self, wait_s: float = 0.0) -> bool:
        """The commands queued so far, then one engine step if a request is in flight (waiting up to `wait_s` for
        one to arrive when none is). True if a step ran. On a loop never start()ed only: the caller owns the
        engine between two pumps. An engine failure fails the requests in flight and is raised."""
        self._drain()
        if not self.engine.has_unfinished() and wait_s > 0:
            self._wake.wait(wait_s)
            self._wake.clear()
            self._drain()
        if not self.engine.has_unfinished():
            return False
        try:
            outs = self.engine.step()
        except Exception as e:
            self._fail_all(e)
            raise
        self.steps += 1
        self._publish(outs)
        return True

    def _run(self) -> None:
        while not self._stop:
            try:
                self.pump(IDLE_WAIT_S)
            except Exception:  # the engine restarted its pool (LLMEngine._step): what was in flight has failed
                continue

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, h, ids, params = cmd
                if h.episode is not None and h.episode in self._ended:  # queued before its episode was closed
                    h.emit(("error", UserError(f"episode {h.episode!r} has ended")))
                    continue
                try:
                    self.engine.add_request(ids, params, request_id=h.request_id)
                except (UserError, ValueError) as e:
                    h.emit(("error", e))
                else:
                    self._live[h.request_id] = h
            elif cmd[0] == "abort":
                self._abort([cmd[1]])
            elif cmd[0] == "abort_episode":
                self._ended[cmd[1]] = None
                if len(self._ended) > 100_000:
                    self._ended.pop(next(iter(self._ended)))
                self._abort([h for h in self._live.values() if h.episode == cmd[1]])
            else:
                _, fn, fut = cmd
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:
                    fut.set_exception(e)

    def _abort(self, handles: list[Handle]) -> None:
        for h in handles:
            if self._live.pop(h.request_id, None) is not None:
                for out in self.engine.abort([h.request_id]):
                    h.emit(("done", out))

    def _publish(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            h = self._live.pop(out.request_id, None)
            if h is not None:
                h.emit(("done", out))
        table = self.engine.requests.samples  # read on the thread that writes it
        for rid, h in self._live.items():
            if not h.stream or rid not in table:
                continue
            news = []
            for j, s in enumerate(table[rid]):
                start, n = h.sent[j], s.num_completion_tokens
                news.append((s.completion_token_ids[start:], s.logprobs[start:], s.top_logprobs[start:n]))
                h.sent[j] = n
            if any(ids for ids, _, _ in news):
                h.emit(("tokens", news))

    def _fail_all(self, e: Exception) -> None:
        live, self._live = self._live, {}
        self.engine.abort(list(live))
        for h in live.values():
            h.emit(("error", e))
