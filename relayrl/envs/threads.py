"""DaemonPool: a fixed number of daemon threads running submitted calls, each answering through a Future.

Tool calls and environment steps are the user's Python functions; one may hang, and a thread cannot be
killed. Their callers give up on a call after a timeout and abandon it; these threads are daemons, so an
abandoned call never keeps the process from exiting (concurrent.futures' pool joins its threads at exit).
A job records when it started running, so a caller can time a call from its start, not from its queueing.

It imports the standard library only; like all of envs, it must never import the engine, the trainer, sync
or the controller.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any


@dataclass
class Job:
    future: Future
    started: threading.Event  # set by the thread that runs the call, right after `started_at`
    started_at: float = 0.0  # time.monotonic()


class DaemonPool:
    """A fixed number of daemon threads running submitted calls, each answering through its job's Future."""

    def __init__(self, size: int, name: str = "relayrl-daemon"):
        self.size, self.name = size, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Any, kwargs: dict) -> Job:
        job = Job(Future(), threading.Event())
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after close()")
            if not self._threads:  # started on first use: a runner that is never used costs no threads
                for i in range(self.size):
                    thread = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            self._queue.put((job, fn, kwargs))
        return job

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, fn, kwargs = item
            future = job.future
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            job.started_at = time.monotonic()
            job.started.set()
            try:
                result = fn(**kwargs)
            except BaseException as e:  # SystemExit from a user function must not end the thread silently
                future.set_exception(e)
            else:
                future.set_result(result)
