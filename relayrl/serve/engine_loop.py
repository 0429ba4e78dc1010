"""One thread owns the engine and steps it; HTTP handlers submit requests to it and await their events.

    handler (asyncio)  ── submit(ids, params) ──>  command queue  ──>  engine thread: add_request
                       <── events, via loop.call_soon_threadsafe ──   step() ... step()
    events:  ("tokens", [(new ids, new logprobs, new top logprobs)] per sample)   only for streaming requests
             ("done", RequestOutput)        the request ended (finish_reason per sample)
             ("error", UserError)           add_request refused it (a bad prompt, bad sampling settings)

Requests from concurrent clients join the engine's continuous batch as they arrive: nothing is serialized.
Every engine call happens on the engine thread, so the engine needs no lock; abort() is a command too, ordered
after the add it refers to, and frees the request's KV blocks on the thread that owns them.

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
    def submit(self, ids: list[int], params: SamplingParams, stream: bool = False) -> Handle:
        h = Handle(next(self._ids), asyncio.Queue(), asyncio.get_running_loop(), stream, [0] * params.n)
        self._cmds.put(("add", h, ids, params))
        self._wake.set()
        return h

    def abort(self, handle: Handle) -> None:
        """Drop the request if it still runs (its KV blocks return to the pool); a no-op once it ended."""
        self._cmds.put(("abort", handle))
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

    # ---- the engine thread ----
    def _run(self) -> None:
        while not self._stop:
            self._drain()
            if not self.engine.has_unfinished():
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # the engine restarted its pool (LLMEngine._step): fail what was in flight
                self._fail_all(e)
                continue
            self.steps += 1
            self._publish(outs)

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, h, ids, params = cmd
                try:
                    self.engine.add_request(ids, params, request_id=h.request_id)
                except (UserError, ValueError) as e:
                    h.emit(("error", e))
                else:
                    self._live[h.request_id] = h
            elif cmd[0] == "abort":
                h = cmd[1]
                if self._live.pop(h.request_id, None) is not None:
                    for out in self.engine.abort([h.request_id]):
                        h.emit(("done", out))
            else:
                _, fn, fut = cmd
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:
                    fut.set_exception(e)

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
