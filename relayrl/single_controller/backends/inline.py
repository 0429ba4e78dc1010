"""Inline backend: the group's workers are objects in the driver's own process, called directly.

    driver ── submit_all ──> InlineHost.call(...) now, on this thread ──> payload kept ──> wait() hands it over

So a role is written once, as a Worker with @dispatch methods, and runs in worker processes (local, Ray) or in the
driver's process (`parallel.backend: none`) behind the same WorkerGroup calls: inputs are split and outputs
gathered as the method's dispatch mode says, but nothing is pickled or copied (arguments and results are the
same objects) and no process, process group, heartbeat or thread count is started or changed. A worker's
exception comes back as the group's usual error (a UserError as itself, one line); an interrupt (Ctrl-C) is the
driver's own and propagates as it is.

What runs inline joins no process group (init_distributed refuses: the driver's process is not a group's rank; a
worker sees `in_group` False): a role that needs one for a world above 1 runs on the local or Ray backend, and
in a world of 1 skips it (the trainer's workers under `parallel.backend: none` do).

It imports the rest of single_controller only; like all of single_controller, it knows nothing of RL and must
never import the RL layers (controller, trainer, engine, rewards, sync, ...).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from relayrl.observe.trace import open_tracer
from relayrl.parallel.rendezvous import LOCALHOST
from relayrl.single_controller.backends.host import Payload, WorkerHost, error_payload
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker import WorkerInfo, construct


class InlineHost(WorkerHost):
    """A WorkerHost for a worker in the driver's process: it builds and closes the worker object only, and an
    interrupt (Ctrl-C, SystemExit) in a call stays the driver's own instead of becoming the worker's error."""

    caught = Exception

    def construct(self, info: WorkerInfo, cls: type, args: tuple, kwargs: dict, threads: int) -> Payload:
        try:  # no heartbeat, no thread count, no device switch: the driver's process is not the worker's own
            self.tracer = open_tracer(info.trace_dir, info.name, info.rank)
            self.info = info
            with self.tracer.span(f"construct {getattr(cls, '__name__', cls)}", rank=info.rank):
                self.worker = construct(cls, info, args, kwargs)
            return ("ok", os.getpid())
        except BaseException:
            return error_payload(f"building {getattr(cls, '__name__', cls)} inline:")

    def close(self) -> Payload:
        """Teardown hook, then drop the worker; the driver's process group (if any) is not the worker's."""
        result: Payload = ("ok", None)
        try:
            if self.worker is not None and hasattr(self.worker, "teardown"):
                self.worker.teardown()
        except BaseException:
            result = error_payload("teardown:")
        self.worker = None
        self.tracer.close()
        return result


class InlineBackend:
    master_addr = LOCALHOST

    def __init__(self, pool: ResourcePool):
        self.pool = pool
        self.hosts = [InlineHost() for _ in range(pool.world_size)]
        self._done: dict[int, Payload] = {}
        self._next = 0
        # one call at a time, as a worker process serves them: a second thread's call (a stream's, beside the
        # driver's) waits for the first to finish instead of interleaving in the worker or in the handle table
        self._lock = threading.RLock()  # re-entrant: a worker may call its own group back

    def pid(self, rank: int) -> int:
        return os.getpid()

    def device_for(self, rank: int) -> str:
        return self.pool.device_for(rank)

    def submit_all(self, calls: dict[int, tuple[str, tuple]]) -> dict[int, int]:
        """Run every rank's operation now, in rank order; wait() returns the payloads."""
        handles = {}
        with self._lock:
            for rank, (op, args) in calls.items():
                self._next += 1
                self._done[self._next] = getattr(self.hosts[rank], op)(*args)
                handles[rank] = self._next
        return handles

    def wait(self, handles: dict[int, Any], timeout: float | None) -> dict[int, Payload]:
        with self._lock:
            return {rank: self._done.pop(h) for rank, h in handles.items()}

    def stop(self, graceful: bool, timeout: float) -> None:
        for host in self.hosts:
            if host.worker is not None:  # not closed gracefully: drop it all the same
                host.close()
