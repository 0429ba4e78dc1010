"""This module keeps the states of a rollout fleet's replicas (relayrl.roles.fleet's RolloutFleet is built on it):
which serve, which start, join, drain, were lost or retired, and the moves between those states — a loss, a restart,
a resize, a growth into a cluster's room, a join. It runs no request; the fleet, its stepper, its sync and
`relayrl fleet` read and move these states.

Each replica (a numbered slot; numbers are never reused) is in one state:

    serving    routed to; synced every step
    starting   its process builds its engine (a restart, or one added by `relayrl fleet` or by autoscale()), waited
               for by a thread of the fleet
    joining    built: the next weight sync gives it the fleet's weights and version, verifies it, and it serves
    draining   asked to leave (`relayrl fleet --replicas N` lower): takes no new request; closed at a sync point once
               it holds nothing (lockstep: the next one; streaming: once it finished what it held)
    lost       its process died or stopped (kill -9 is seen at once, SIGSTOP within parallel.heartbeat_timeout_s; on
               Ray, also its node leaving): the requests it held move to the replicas in service (the fleet and its
               stepper); it is restarted at once, up to max_restarts times, after which the run goes on without it
               and says so; on a cluster with no room for it (room()), it waits for room without spending a restart
    retired    drained, or past its restarts

Processes start from the driver's main thread (a worker dies with the thread that started it: relayrl.parallel.launch):
a loss noticed on another thread is restarted at the next sync point (maintain()); Ray actors (spawn_anywhere) start
from a thread of the fleet at once. Each replica keeps a place (which of the machine's device groups its process takes:
replica_devices) across restarts; one added takes the first place no replica holds.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from relayrl.errors import RunFault
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.rollout.router import Router

SERVING, STARTING, JOINING, DRAINING, LOST, RETIRED = "serving", "starting", "joining", "draining", "lost", "retired"
ACTIVE = (SERVING, STARTING, JOINING)  # what counts towards the fleet's size (`relayrl fleet --replicas N`)


class FleetLostError(RunFault):
    """No replica of the fleet is left in service: the run stops (a checkpoint of its last finished step is saved)."""


def replica_devices(count: int, trainer: int, tp: int) -> list[int]:
    """The first GPU of each place a replica of `tp` ranks takes on a node of `count` GPUs beside `trainer` trainer
    ranks on cuda:0..trainer-1 (local processes): tp consecutive GPUs after the trainer's, as many groups as fit; where
    not even one group fits after them, groups over all of the node's GPUs from cuda:0 (shared with the trainer's
    processes, as on a one-GPU machine). Replicas beyond the groups share them, place p on group p mod their number.
    A node with fewer GPUs than tp: ValueError (the preflight says it in one line first)."""
    if count < tp:
        raise ValueError(f"an engine of rollout.tp={tp} ranks needs {tp} GPUs; the node has {count}")
    start = trainer if count - trainer >= tp else 0
    return list(range(start, start + (count - start) // tp * tp, tp))


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def stderr_notice(line: str) -> None:
    print(f"relayrl: {line}", file=sys.stderr, flush=True)


@dataclass
class Replica:
    """One slot of the fleet: its role (the last one it had, after a loss), its state, its restarts."""

    role: RolloutRole | None
    state: str
    restarts: int = 0
    place: int = 0  # which of the machine's device groups it takes (spawn), kept across its restarts
    waiting: bool = False  # lost, its restart waiting for room on the cluster (a Ray node to join)
    starting: Future | None = None  # the start of its (new) process: a RolloutRole once its engine is built
    group: object | None = None  # that process's worker group, while it starts (close() stops it unwaited)
    reason: str = ""  # why it was lost (one line)


class ReplicaStates:
    """The replicas of a fleet and their states (see the module docstring); RolloutFleet adds the requests."""

    def __init__(self, replicas: list[RolloutRole], router: Router, *,
                 spawn: Callable[[str, int], object] | None = None, max_restarts: int = 2,
                 notice: Callable[[str], None] = stderr_notice, losable: bool = True,
                 room: Callable[[], int] | None = None, spawn_anywhere: bool = False,
                 replicas_max: int | None = None):
        """spawn(name, place): start one more rollout worker's process (at `place`: which of the machine's device
        groups it takes, replica_devices; its engine builds in it, RolloutRole.ready waits for it) — what restarts a
        lost replica and adds one; None: neither (a fleet of given roles). losable=False: a replica's loss is the
        run's (a colocated fleet's replicas are the trainer's own ranks): lose() re-raises. room(): how many more
        replicas the cluster could place now (Ray: relayrl.single_controller.backends.ray.room); None: no limit
        known (local processes). spawn_anywhere: spawn may run on any thread (a Ray actor does not die with the
        thread that started it; a local process does), so a start runs wholly on a thread of the fleet.
        replicas_max: grow, one replica at a time, while room() has room (autoscale())."""
        if len(replicas) != router.replicas:
            raise ValueError(f"{len(replicas)} replicas for a router of {router.replicas}")
        self.slots = [Replica(role, SERVING, place=r) for r, role in enumerate(replicas)]
        self.router, self.spawn, self.max_restarts, self.notice = router, spawn, max_restarts, notice
        self.losable, self.room, self.spawn_anywhere, self.replicas_max = losable, room, spawn_anywhere, replicas_max
        self._grown: int | None = None  # the replica autoscale() added last (it adds another once this one serves)
        self.tokenizer = replicas[0].tokenizer
        self.lost_total = self.restarts_total = 0  # over the run
        self.partial: str | None = None  # the engines' setting for requests in flight across a sync (streaming)
        self.holding: Callable[[int], int] = lambda r: 0  # requests replica r holds (a stream's stepper tells)
        self._starts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="relayrl-fleet-start")

    def _added(self, r: int) -> None:
        """Replica r was added (a new slot): the fleet's per-replica figures grow with it."""

    @property
    def replicas(self) -> list[RolloutRole | None]:
        """Every slot's role, by number (a lost or retired slot's last one)."""
        return [s.role for s in self.slots]

    def numbered(self, *states: str) -> list[int]:
        return [r for r, s in enumerate(self.slots) if s.state in states]

    @property
    def serving(self) -> list[int]:
        return self.numbered(SERVING)

    @property
    def size(self) -> int:
        """Replicas serving, starting or joining: the fleet's size as `relayrl fleet` counts it."""
        return len(self.numbered(*ACTIVE))

    def lose(self, r: int, error: BaseException) -> None:
        """Replica r's process died or stopped: out of service, its process stopped, a restart begun (or deferred
        to the next sync point, off the main thread), or, past its restarts, retired."""
        if not self.losable:
            raise error
        slot = self.slots[r]
        if slot.state in (LOST, RETIRED):
            return
        draining = slot.state == DRAINING
        slot.state, slot.reason = LOST, one_line(error)
        self.lost_total += 1
        self.router.clear(r)
        if slot.role is not None:
            slot.role.close()  # a stopped process is killed; nothing of it is waited for
        left = self.serving
        self.notice(f"rollout replica {r} lost: {slot.reason}; " + (
            f"its requests move to replica(s) {', '.join(map(str, left))}" if left else "no replica is left"))
        if draining:
            slot.state = RETIRED  # it was leaving anyway: not restarted
        elif self.spawn_anywhere or threading.current_thread() is threading.main_thread():
            self._restart(r)

    def _restart(self, r: int) -> None:
        slot = self.slots[r]
        if self.spawn is None or slot.restarts >= self.max_restarts:
            slot.state = RETIRED
            tries = f"after {slot.restarts} restart(s)" if self.spawn is not None else "(no restarts: no spawn)"
            self.notice(f"rollout replica {r} is not restarted {tries}; the run goes on with "
                        f"{len(self.numbered(*ACTIVE))} replica(s)")
            return
        if self.room is not None and self.room() < 1:  # e.g. its node left the cluster: not a failed restart
            if not slot.waiting:
                slot.waiting = True
                self.notice(f"rollout replica {r} waits for room on the cluster to restart (looked for at each sync)")
            return
        slot.waiting = False
        slot.restarts += 1
        self.restarts_total += 1
        self._start(r)

    def _start(self, r: int) -> None:
        """Replica r's new process, started from this (the main) thread, its engine built in it and waited for
        by a thread of the fleet; with spawn_anywhere, started by that thread too."""
        slot = self.slots[r]
        if self.spawn_anywhere:
            slot.state, slot.group = STARTING, None
            slot.starting = self._starts.submit(self._spawn_ready, slot, f"rollout{r}", slot.place)
            return
        try:
            group = self.spawn(f"rollout{r}", slot.place)
        except Exception as e:  # e.g. no memory for another process: counts as a failed restart
            slot.starting = Future()
            slot.starting.set_exception(e)
        else:
            slot.group = group
            slot.starting = self._starts.submit(RolloutRole.ready, group, self.tokenizer)
        slot.state = STARTING

    def _spawn_ready(self, slot: Replica, name: str, place: int) -> RolloutRole:
        group = slot.group = self.spawn(name, place)
        return RolloutRole.ready(group, self.tokenizer)

    def resize(self, n: int) -> None:
        """The fleet's size becomes n (>= 1): replicas added (started now, joining at a sync once built) or the
        highest-numbered ones drained (starting ones first). From the driver's main thread. A growing fleet's
        ceiling (replicas_max) becomes n: autoscale() does not undo what was asked."""
        if n < 1:
            raise ValueError(f"a fleet needs at least 1 replica, got {n}")
        if self.spawn is None and n > self.size:
            raise ValueError("this fleet cannot start replicas (it was given its roles)")
        if self.replicas_max is not None:
            self.replicas_max, self._grown = n, None
        self._add_or_drain(n)

    def autoscale(self) -> int | None:
        """Between two steps (main thread): a growing fleet (replicas_max, on a cluster whose room it can measure)
        adds one replica when the cluster has room for it (a node joined) and none is starting, none lost waits
        for room, and the replica it added last serves (one that never came up stops the growth, in one line).
        Returns the replica added, or None."""
        if self.replicas_max is None or self.room is None or self.size >= self.replicas_max:
            return None
        if self.numbered(STARTING, LOST):
            return None
        if self._grown is not None and self.slots[self._grown].state != SERVING:
            if self.slots[self._grown].state == RETIRED:
                self.notice(f"the fleet stops growing: replica {self._grown}, added when the cluster had room, did "
                            f"not come up ({self.slots[self._grown].reason or 'retired'})")
                self.replicas_max = self.size
            return None
        if self.room() < 1:
            return None
        self.notice(f"the cluster has room for another rollout replica (up to rollout.replicas_max="
                    f"{self.replicas_max})")
        self._add_or_drain(self.size + 1)
        self._grown = len(self.slots) - 1
        return self._grown

    def _add_or_drain(self, n: int) -> None:
        while self.size < n:
            r = self.router.add()
            held = {s.place for s in self.slots if s.state != RETIRED}  # a lost one keeps its place for its restart
            self.slots.append(Replica(None, STARTING, place=next(p for p in range(len(self.slots) + 1)
                                                                  if p not in held)))
            self._added(r)
            self._start(r)
            self.notice(f"rollout replica {r} is starting (the fleet's size: {self.size})")
        if self.size > n:
            order = self.numbered(STARTING, JOINING)[::-1] + self.serving[::-1]
            for r in order[:self.size - n]:
                self.slots[r].state = DRAINING
                self.notice(f"rollout replica {r} is draining (the fleet's size: {self.size})")

    def maintain(self) -> list[int]:
        """At a sync point (main thread, nothing in flight): restarts deferred from other threads begun; started
        replicas that finished building become joining (or, failed, are restarted again or retired); drained
        replicas closed. Returns the replicas joining at this sync."""
        for r in self.numbered(LOST):
            self._restart(r)
        for r in self.numbered(STARTING, DRAINING):
            slot = self.slots[r]
            if slot.starting is None or not slot.starting.done():
                if slot.state == DRAINING and slot.starting is None and not self.holding(r):
                    self._retire(r)  # (a stream's replica holding requests finishes them first)
                continue
            try:
                role = slot.starting.result()
            except Exception as e:
                slot.starting = slot.group = None
                if slot.state == DRAINING:
                    slot.state = RETIRED
                    continue
                slot.state, slot.reason = LOST, f"its {'re' if slot.restarts else ''}start failed: {one_line(e)}"
                self.notice(f"rollout replica {r} did not start: {one_line(e)}")
                self._restart(r)  # again (lost until it starts: waiting for room, it is tried at each sync), or retired
                continue
            slot.starting, slot.group, slot.role = None, None, role
            if slot.state == DRAINING:
                self._retire(r)
            else:
                slot.state = JOINING
                self.router.clear(r)
        return self.numbered(JOINING)

    def _retire(self, r: int) -> None:
        slot = self.slots[r]
        if slot.role is not None:
            slot.role.close()
        slot.state = RETIRED
        self.router.clear(r)
        self.notice(f"rollout replica {r} drained and closed (the fleet's size: {self.size})")

    def joined(self, r: int) -> None:
        """Replica r holds the fleet's verified weights now: in service (with the fleet's `partial` setting)."""
        if self.partial is not None:
            self.slots[r].role.set_partial(self.partial)
        self.slots[r].state = SERVING
        self.slots[r].reason = ""

    def exhausted(self) -> FleetLostError:
        why = "; ".join(f"replica {r}: {s.reason}" for r, s in enumerate(self.slots) if s.reason)
        return FleetLostError(f"every rollout replica is lost ({why or 'none in service'}); the run stops: resume it "
                              "from its last checkpoint with relayrl train --resume")
