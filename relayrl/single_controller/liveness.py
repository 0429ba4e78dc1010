"""Deadlines and heartbeats: how a worker group notices a worker that is dead, stopped or hung.

Two mechanisms back every call a group makes:

    deadline    each call has one, by the kind its method declares (`@dispatch(..., deadline=...)`):
                build (construction), compute (model work), control (bookkeeping), close
    heartbeat   every worker process bumps a counter in the group's store once a second from a
                thread of its own; the group reads the counters while it waits, and a worker whose
                counter has not moved for `heartbeat_timeout_s` is stopped (SIGSTOP) or hung

A dead process is seen at once (its pipe or its Ray actor fails). A worker stuck in a collective
because a peer is stopped keeps beating: the stopped peer is the one reported. A worker that is
alive but busy for ever (an endless loop) keeps beating too: its call's deadline catches it.
Either way the group raises WorkerLostError or CallDeadlineError (one line naming the role, rank,
pid and call), marks itself broken, and its shutdown kills the processes without raising.

This module imports the standard library, torch.distributed (through the store) and relayrl's
ground floor only; like all of single_controller it must never import the RL layers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from relayrl.errors import RunFault
from relayrl.parallel.rendezvous import StoreAddress, join_store

HEARTBEAT_S = 1.0  # how often a worker beats
CHECK_S = 1.0  # how often a waiting group looks at the beats
KEY = "relayrl/heartbeat/{rank}"


@dataclass(frozen=True)
class Deadlines:
    """Seconds a call of each kind may take (None: no deadline for that kind)."""

    build: float | None = 1800.0  # start a worker and build its model (FSDP init, weight loading)
    compute: float | None = 3600.0  # one step's model work: generate, update, logprobs, a checkpoint
    control: float | None = 300.0  # bookkeeping: layouts, connecting groups, stats
    close: float | None = 120.0  # teardown hooks, the last barrier

    def of(self, kind: str) -> float | None:
        return getattr(self, kind)


@dataclass(kw_only=True, frozen=True)
class GroupOptions:
    """How a worker group runs: where (backend), how long calls may take, how a hang is noticed.

    heartbeat_timeout_s: a worker that sent no heartbeat for this long is reported stopped or hung
    (None: heartbeats are not checked). error_grace_s: after one rank failed, how long to wait for
    the others before declaring them stuck. threads: torch threads per worker process. trace_dir: where
    each worker appends its spans (relayrl.observe.trace; None: off); it travels in the WorkerInfo."""

    backend: str = "local"
    deadlines: Deadlines = field(default_factory=Deadlines)
    heartbeat_timeout_s: float | None = 30.0
    error_grace_s: float = 10.0
    threads: int = 1
    trace_dir: str | None = None

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s is not None and self.heartbeat_timeout_s < 2 * HEARTBEAT_S:
            raise ValueError(f"heartbeat_timeout_s must be at least {2 * HEARTBEAT_S:g}s (beats come every "
                             f"{HEARTBEAT_S:g}s), got {self.heartbeat_timeout_s}")


class WorkerLostError(RunFault):
    """A worker process died, or stopped answering heartbeats (stopped or hung)."""


class CallDeadlineError(RunFault, TimeoutError):
    """A call ran past its deadline."""


# ---------------------------------------------------------------------------- the worker's side
def start_heartbeat(store: StoreAddress, rank: int) -> threading.Thread:
    """Beat from a daemon thread of this process until the store goes away (the group is gone)."""

    def beat() -> None:
        try:
            client = join_store(store, timeout_s=60.0)
            key = KEY.format(rank=rank)
            while True:
                client.add(key, 1)
                time.sleep(HEARTBEAT_S)
        except Exception:  # the group's store is gone: so is the group
            return

    thread = threading.Thread(target=beat, daemon=True, name="relayrl-heartbeat")
    thread.start()
    return thread


# ---------------------------------------------------------------------------- the group's side
class Liveness:
    """The group's view of its workers' heartbeats (read from its own store)."""

    def __init__(self, store, world_size: int, timeout_s: float | None):
        self.store, self.timeout_s = store, timeout_s
        self._count = [0] * world_size
        self._changed = [time.monotonic()] * world_size
        self._started = [False] * world_size  # judged only after a first beat (start-up is the build's)
        # per rank: calls on disjoint ranks from several threads (GroupHandle.call_ranks) each get their ranks read
        self._last_check = [0.0] * world_size

    def stale(self, ranks) -> list[tuple[int, float]]:
        """(rank, seconds since its last beat) of the given ranks that stopped beating."""
        if self.timeout_s is None or self.store is None:
            return []
        now = time.monotonic()
        due = [r for r in ranks if now - self._last_check[r] >= CHECK_S]
        out = []
        for r in due:
            self._last_check[r] = now
            try:
                n = self.store.add(KEY.format(rank=r), 0)
            except Exception:  # a store we host cannot fail short of this process dying
                return []
            if n != self._count[r]:
                self._count[r], self._changed[r], self._started[r] = n, now, True
            elif self._started[r] and now - self._changed[r] > self.timeout_s:
                out.append((r, now - self._changed[r]))
        return out
