"""This module runs a rollout fleet: `rollout.replicas` engines, each in a rollout worker process of its own, behind
one router, as ONE RolloutEngine to the rest of relayrl (the sources, the evaluator, the driver).

    driver ── RolloutFleet ──> Router (relayrl.rollout.router): each request (a prompt, its n samples) to a replica
              (a RolloutEngine)    by least outstanding work with prefix affinity, among those in service
                                ──> RolloutRole x N (relayrl.roles.rollout_worker), each a worker process holding an
                                    LLMEngine (its TP ranks below it); their generate calls run at once, one driver
                                    thread each, and the outputs come back in the prompts' order

What is sampled does not depend on the routing: every request of a run carries its own seed (relayrl.rollout.source
sampling_params), and a seeded request's samples are the same in any batch on any replica
(tests/engine/test_llm_engine.py: test_seeded_sampling_independent_of_batch; tests/fleet: the same run on 1, 2 and 4
replicas). The weight sync reaches each replica by its own handle (relayrl.roles.fleet_sync); the fleet's
weights_version is the one its replicas in service hold (all equal after a verified sync).

Each replica (a numbered slot; numbers are never reused) is in one state:

    serving    routed to; synced every step
    starting   its process builds its engine (a restart, or one added by `relayrl fleet`), from a thread of the fleet
    joining    built: the next weight sync gives it the fleet's weights and version, verifies it, and it serves
    draining   asked to leave (`relayrl fleet --replicas N` lower): takes no new request; closed at a sync point once
               it holds nothing (lockstep: the next one; streaming: once it finished what it held)
    lost       its process died or stopped (kill -9 is seen at once, SIGSTOP within parallel.heartbeat_timeout_s):
               the requests it held are routed again to the replicas in service and resume there from the tokens it
               had reported (generate runs in rounds of GENERATE_STEPS engine steps, relayrl.roles.fleet_stepper:
               re-prefilled, each sample's seeded stream advanced past them), so every sample is the one it would
               have been, none lost or duplicated (counted: fleet/rerouted_requests, fleet/reprefilled_tokens); it is
               restarted at once, up to rollout.replica_restarts times, after which the run goes on without it and
               says so
    retired    drained, or past its restarts

No replica in service when a request must run: FleetLostError (a RunFault): one line naming each loss; the train job
saves a resumable checkpoint of the last finished step and exits non-zero (relayrl.jobs.train).

Processes start from the driver's main thread (a worker dies with the thread that started it: relayrl.parallel.launch):
a loss noticed on another thread is restarted at the next sync point (maintain()).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from relayrl.engine.sampling_params import SamplingParams
from relayrl.errors import RunFault
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.rollout.router import Router
from relayrl.single_controller.liveness import GroupOptions

# the engine's figures, fleet-wide: counters add up; a peak is the highest replica's (with its utilisation)
SUMMED = ("engine/preemptions", "engine/reprefills", "engine/prefill_tokens", "engine/forked_samples",
          "engine/prefix_lookup_tokens")
PEAK = "engine/peak_blocks_used"
QUEUE_PEAKS = ("engine/peak_running", "engine/peak_waiting")  # fleet-wide: the busiest replica's

SERVING, STARTING, JOINING, DRAINING, LOST, RETIRED = "serving", "starting", "joining", "draining", "lost", "retired"
ACTIVE = (SERVING, STARTING, JOINING)  # what counts towards the fleet's size (`relayrl fleet --replicas N`)
GENERATE_STEPS = 16  # engine steps a replica runs per call of the fleet's generate (its progress reported between)


class FleetLostError(RunFault):
    """No replica of the fleet is left in service: the run stops (a checkpoint of its last finished step is saved)."""


def settle(futures: dict[int, Future]) -> tuple[dict[int, object], dict[int, BaseException]]:
    """Every future waited for: (results, errors), each by key."""
    done, failed = {}, {}
    for k, f in futures.items():
        try:
            done[k] = f.result()
        except BaseException as e:
            failed[k] = e
    return done, failed


def adopt_version(engine, version: int) -> None:
    """A replica that joined late carries the fleet's weights version (its own count of syncs is 1): the versions
    its samples carry then name the same policy as every other replica's. Runs in its worker (nothing in flight)."""
    engine.reset_prefix_cache()  # nothing cached under the old number may be read under the new
    engine.weights_version = engine.block_manager.version = version


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


class RolloutFleet:
    """N rollout roles behind a router: a RolloutEngine (relayrl.engine.protocols)."""

    def __init__(self, replicas: list[RolloutRole], router: Router, *,
                 spawn: Callable[[str], object] | None = None, max_restarts: int = 2,
                 notice: Callable[[str], None] = stderr_notice, losable: bool = True,
                 room: Callable[[], int] | None = None, spawn_anywhere: bool = False,
                 replicas_max: int | None = None):
        """spawn(name, place): start one more rollout worker's process (at `place`: which of the machine's device
        groups it takes, relayrl.roles.fleet.replica_devices) (its engine builds in it; RolloutRole.ready waits
        for it) — what restarts a lost replica and adds one; None: neither (a fleet of given roles). losable=False:
        a replica's loss is the run's (a colocated fleet's replicas are the trainer's own ranks): lose() re-raises.
        room(): how many more replicas the cluster could place now (Ray: relayrl.single_controller.backends.ray.room);
        None: no limit known (local processes). spawn_anywhere: spawn may run on any thread (a Ray actor does not
        die with the thread that started it; a local process does), so a start runs wholly on a thread of the
        fleet. replicas_max: grow, one replica at a time, while room() has room (autoscale())."""
        if len(replicas) != router.replicas:
            raise ValueError(f"{len(replicas)} replicas for a router of {router.replicas}")
        self.slots = [Replica(role, SERVING, place=r) for r, role in enumerate(replicas)]
        self.router, self.spawn, self.max_restarts, self.notice = router, spawn, max_restarts, notice
        self.losable, self.room, self.spawn_anywhere, self.replicas_max = losable, room, spawn_anywhere, replicas_max
        self._grown: int | None = None  # the replica autoscale() added last (it adds another once this one serves)
        self.tokenizer, self.pad_id = replicas[0].tokenizer, replicas[0].pad_id
        self.tokens = [0] * len(replicas)  # tokens each generated since the last reset_stats
        self.busy = [0.0] * len(replicas)  # seconds each spent in generate calls since then
        self.lost_total = self.restarts_total = 0  # over the run
        self.rerouted = 0  # requests routed again since the last reset_stats (their replica was lost)
        self.reprefilled = 0  # the tokens those had generated, resumed from (re-prefilled) on another replica
        self.recovery_s = 0.0  # from the first loss noticed in a generate call to its end, since the last reset
        self.partial: str | None = None  # the engines' setting for requests in flight across a sync (streaming)
        self.holding: Callable[[int], int] = lambda r: 0  # requests replica r holds (a stream's stepper tells)
        self.live: dict[int, dict[str, float]] = {}  # a stream's stepper's last view of each replica: queue, running
        self._version = min(r.weights_version for r in replicas)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(replicas)), thread_name_prefix="relayrl-fleet")
        self._starts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="relayrl-fleet-start")

    @classmethod
    def own_processes(cls, n: int, model_dir, engine_kwargs: dict, options: GroupOptions, tokenizer,
                      device: str = "cpu", block_size: int = 16, router: dict | None = None,
                      max_restarts: int = 2, replicas_max: int | None = None,
                      cpus_per_replica: float = 0.1, gpus: list[int] | None = None, tp: int = 1) -> RolloutFleet:
        """n replicas, each the engine loaded from `model_dir` in a rollout worker of its own: all started, then
        all waited for (they build at once; on a failure every one is stopped). Lost replicas are restarted the
        same way, up to max_restarts times each; router: the Router's keyword arguments. On Ray (options.backend)
        a restart or an added replica waits for room on the cluster, and replicas_max grows the fleet into it;
        cpus_per_replica: what Ray reserves for each (rollout.replica_cpus), with tp GPUs on cuda. gpus (local
        processes on cuda): the first GPU of each place a replica takes (replica_devices); a replica keeps its place
        across restarts, one added takes the first place no replica holds, else shares place p mod their number."""
        def spawn(name: str, place: int):
            where = device if not gpus else f"{device}:{gpus[place % len(gpus)]}"
            return RolloutRole.start_process(model_dir, engine_kwargs, options, where, name, cpus_per_replica, tp)

        room = None
        if options.backend == "ray":
            from relayrl.single_controller.backends.ray import room as ray_room
            from relayrl.single_controller.resource_pool import ResourcePool

            room = partial(ray_room, ResourcePool([1], device=device, cpus_per_process=cpus_per_replica))

        groups = []
        try:
            for r in range(n):
                groups.append(spawn(f"rollout{r}", r))
        except BaseException:
            for g in groups:
                g.shutdown(raise_errors=False)
            raise
        started = []
        try:
            for g in groups:
                started.append(RolloutRole.ready(g, tokenizer))
        except BaseException:
            for g in groups:
                g.shutdown(raise_errors=False)
            raise
        return cls(started, Router(n, block_size, **(router or {})), spawn=spawn, max_restarts=max_restarts,
                   room=room, spawn_anywhere=room is not None, replicas_max=replicas_max)

    # ------------------------------------------------------------------ the replicas and their states
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

    def status(self) -> dict:
        """Each state's replicas, by number, and the losses and restarts so far (relayrl fleet prints it)."""
        out: dict = {state: self.numbered(state) for state in (SERVING, STARTING, JOINING, DRAINING, LOST, RETIRED)}
        out |= {"size": self.size, "lost_total": self.lost_total, "restarts_total": self.restarts_total,
                "version": self.weights_version, "replicas_max": self.replicas_max,
                "waiting": [r for r, s in enumerate(self.slots) if s.state == LOST and s.waiting],
                "reasons": {str(r): s.reason for r, s in enumerate(self.slots) if s.reason}}
        return out

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
            self.tokens.append(0)
            self.busy.append(0.0)
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
                slot.reason = f"its {'re' if slot.restarts else ''}start failed: {one_line(e)}"
                self.notice(f"rollout replica {r} did not start: {one_line(e)}")
                self._restart(r)
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

    def set_partial(self, value: str | None) -> None:
        """What every engine does with requests in flight across a weight update (a stream sets it): the replicas
        in service now, and each that joins later."""
        self._each(lambda role: role.set_partial(value))
        self.partial = value

    def exhausted(self) -> FleetLostError:
        why = "; ".join(f"replica {r}: {s.reason}" for r, s in enumerate(self.slots) if s.reason)
        return FleetLostError(f"every rollout replica is lost ({why or 'none in service'}); the run stops: resume it "
                              "from its last checkpoint with relayrl train --resume")

    # ------------------------------------------------------------------ every replica at once
    def _each(self, fn: Callable[[RolloutRole], object], which: Sequence[int] | None = None) -> dict[int, object]:
        """fn(replica) on the replicas in service (or those numbered in `which`), concurrently: results by number.
        Every call is waited for; a replica lost on the way is taken out of service (lose()) and its result left
        out; another error is raised after all ended."""
        which = self.serving if which is None else list(which)
        done, failed = settle({r: self._pool.submit(fn, self.slots[r].role) for r in which})
        other = None
        for r, e in failed.items():
            if isinstance(e, RunFault):
                self.lose(r, e)
            else:
                other = other or e
        if other is not None:
            raise other
        return done

    @property
    def weights_version(self) -> int:
        """The weights the replicas in service hold (a verified sync leaves them all at the same version)."""
        versions = [self.slots[r].role.weights_version for r in self.serving]
        if versions:
            self._version = min(versions)
        return self._version

    @property
    def versions(self) -> list[int]:
        """The weights version of each replica in service or joining, in replica-number order."""
        return [self.slots[r].role.weights_version for r in self.numbered(SERVING, JOINING)]

    @property
    def asleep(self) -> int:
        return max((self.slots[r].role.asleep for r in self.serving), default=0)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]):
        """Each prompt routed among the replicas in service (relayrl.rollout.router), every replica running its share
        at once, in rounds of GENERATE_STEPS engine steps (one call per replica per round: relayrl.roles.fleet_stepper,
        which keeps the tokens each request has generated); outputs in the prompts' order. A replica lost on the way
        is taken out of service and its requests resume on the others from the tokens they had (re-prefilled: their
        streams continue, so every sample is the one it would have been)."""
        from relayrl.roles.fleet_stepper import FleetStepper  # it builds on this module

        if isinstance(prompts, (str, bytes)) or (not isinstance(params, SamplingParams)
                                                  and len(list(params)) != len(list(prompts))):
            if not self.serving:
                raise self.exhausted()
            return self.slots[self.serving[0]].role.generate(prompts, params)  # the engine's own one-line error
        prompts = list(prompts)
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        stepper = FleetStepper(self, GENERATE_STEPS, until_done=True, owner=False)
        rids = [stepper.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        outputs, lost, first_loss = {}, self.lost_total, None
        try:
            while stepper.has_unfinished():
                for o in stepper.step():
                    outputs[o.request_id] = o
                if first_loss is None and self.lost_total > lost:
                    first_loss = time.perf_counter()
        finally:
            for p in stepper.placed.values():  # a failed call's work leaves the router's load (a lost one's left)
                if self.slots[p.replica].state not in (LOST, RETIRED):
                    self.router.done(p.replica, p.work)
        if first_loss is not None:
            self.recovery_s += time.perf_counter() - first_loss
        return [outputs[rid] for rid in rids]

    def _ids(self, prompt) -> list[int]:
        """The token ids the router keys a prompt by (relayrl's sources send ids; a string is tokenized as is)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return list(self.tokenizer(str(prompt), add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ weights (the sync reaches each replica itself)
    def load_weights(self, weights) -> int:
        weights = [(n, t) for n, t in weights]
        self._each(lambda role: role.load_weights(weights))
        self.router.forget()
        return self.weights_version

    def run_on_ranks(self, fn: Callable, *args) -> list:
        """fn on every rank of every replica in service: the lowest-numbered replica's ranks first."""
        return [x for _, part in sorted(self._each(lambda role: role.run_on_ranks(fn, *args)).items()) for x in part]

    def begin_weight_update(self, which: Sequence[int] | None = None) -> list[int]:
        """The bracket's start on the replicas in service (or `which`); returns those that answered."""
        return sorted(self._each(RolloutRole.begin_weight_update, which))

    def end_weight_update(self, which: Sequence[int] | None = None) -> int:
        self._each(RolloutRole.end_weight_update, which)
        self.router.forget()  # the engines' caches of the old weights are no use to the new
        return self.weights_version

    def score(self, rows, temperature: float = 1.0):
        """The first replica in service's logprobs (every replica holds the same, verified weights)."""
        while self.serving:
            r = self.serving[0]
            try:
                return self.slots[r].role.score(rows, temperature)
            except RunFault as e:
                self.lose(r, e)
        raise self.exhausted()

    def reset_prefix_cache(self) -> None:
        self._each(RolloutRole.reset_prefix_cache)
        self.router.forget()

    def sleep(self, level: int = 1) -> None:
        self._each(lambda role: role.sleep(level))
        if level:
            self.router.forget()  # a freed KV cache holds no prefix

    def wake(self) -> None:
        self._each(RolloutRole.wake)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, float]:
        """The engines' figures fleet-wide (engine/*: counters summed, the peak replica's blocks, the prefix hit
        rate weighted by each replica's prompt tokens), the fleet's (fleet/*: replicas in service, starting or
        joining, lost and restarted so far, requests routed again and the time from the first loss to the end of
        its generate call) and each replica's in service (fleet/replica<r>/*: requests, tokens, tokens per second
        of its generate calls, its KV blocks' peak share, the engine's prefix hit rate, the router's, requests
        sent for their cached prefix, weights version; streaming, the sequences waiting and running in it after
        its last advance: relayrl.roles.fleet_stepper)."""
        per = self._each(RolloutRole.stats)
        out: dict[str, float] = {"fleet/replicas": float(len(self.serving)),
                                 "fleet/replicas_starting": float(len(self.numbered(STARTING, JOINING))),
                                 "fleet/lost": float(self.lost_total), "fleet/restarts": float(self.restarts_total),
                                 "fleet/rerouted_requests": float(self.rerouted),
                                 "fleet/reprefilled_tokens": float(self.reprefilled),
                                 "fleet/recovery_s": self.recovery_s}
        stats = list(per.values())
        for key in SUMMED:
            if any(key in s for s in stats):
                out[key] = float(sum(s.get(key, 0.0) for s in stats))
        if any(PEAK in s for s in stats):
            top = max(stats, key=lambda s: s.get(PEAK, 0.0))
            out[PEAK] = top[PEAK]
            out["engine/block_utilisation_at_peak"] = top.get("engine/block_utilisation_at_peak", 0.0)
        # each replica's rate weighed by the tokens its engine looked up (every turn of an episode), else by the
        # prompt tokens routed to it
        prompt_tokens = {r: s.get("engine/prefix_lookup_tokens", self.router.counters[r].prompt_tokens)
                         for r, s in per.items()}
        if any("engine/prefix_hit_rate" in s for s in stats):
            total = sum(prompt_tokens.values())
            out["engine/prefix_hit_rate"] = (sum(s.get("engine/prefix_hit_rate", 0.0) * prompt_tokens[r]
                                                 for r, s in per.items()) / total if total else 0.0)
        for key in {k for s in stats for k in s if k.startswith("engine/expert")}:
            out[key] = max(s.get(key, 0.0) for s in stats)
        for key in QUEUE_PEAKS:
            if any(key in s for s in stats):
                out[key] = max(s.get(key, 0.0) for s in stats)
        for r, s in sorted(per.items()):
            c, pre = self.router.counters[r], f"fleet/replica{r}/"
            out |= {pre + "requests": float(c.requests), pre + "tokens": float(self.tokens[r]),
                    pre + "tokens_per_s": self.tokens[r] / self.busy[r] if self.busy[r] else 0.0,
                    pre + "kv_peak": s.get(PEAK, 0.0),
                    pre + "prefix_hit_rate": s.get("engine/prefix_hit_rate", 0.0),
                    pre + "router_hit_rate": c.hit_rate, pre + "by_affinity": float(c.by_affinity),
                    pre + "version": float(self.slots[r].role.weights_version),
                    pre + "running_peak": s.get("engine/peak_running", 0.0),
                    pre + "queue_peak": s.get("engine/peak_waiting", 0.0)}
            out |= {pre + k: v for k, v in self.live.get(r, {}).items()}
        return out

    def reset_stats(self) -> None:
        self._each(RolloutRole.reset_stats)
        self.router.reset_counters()
        self.tokens = [0] * len(self.slots)
        self.busy = [0.0] * len(self.slots)
        self.rerouted, self.reprefilled, self.recovery_s = 0, 0, 0.0

    def close(self) -> None:
        """Close every replica, each on its own (one that fails must not keep the others' processes alive); one
        still building is stopped without waiting for it."""
        first = None
        for slot in self.slots:
            if slot.starting is not None:
                if not slot.starting.done() and slot.group is not None:
                    slot.group.shutdown(raise_errors=False)  # still building: stopped, not waited for
                try:
                    slot.role = slot.starting.result()
                except Exception:
                    slot.role = None  # its start failed (or was stopped): its group is down
                slot.starting = slot.group = None
            if slot.role is None:
                continue
            try:
                slot.role.close()
            except Exception as e:
                first = first or e
        self._pool.shutdown(wait=True)
        self._starts.shutdown(wait=True)
        if first is not None:
            raise first
