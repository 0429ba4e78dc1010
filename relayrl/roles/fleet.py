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

Its replicas' states (serving, starting, joining, draining, lost, retired) and the moves between them (a loss, a
restart, a resize, growth into a cluster's room) are relayrl.roles.fleet_replicas's ReplicaStates, which RolloutFleet
is built on. A replica lost in a call: the requests it held are routed again to the replicas in service and resume
there from the tokens it had reported (generate runs in rounds of GENERATE_STEPS engine steps,
relayrl.roles.fleet_stepper: re-prefilled, each sample's seeded stream advanced past them), so every sample is the one
it would have been, none lost or duplicated (counted: fleet/rerouted_requests, fleet/reprefilled_tokens).

No replica in service when a request must run: FleetLostError (a RunFault): one line naming each loss; the train job
saves a resumable checkpoint of the last finished step and exits non-zero (relayrl.jobs.train).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

from relayrl.engine.sampling_params import SamplingParams
from relayrl.errors import RunFault
from relayrl.roles.fleet_replicas import DRAINING, JOINING, LOST, RETIRED, SERVING, STARTING, ReplicaStates
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.rollout.router import Router
from relayrl.single_controller.liveness import GroupOptions

# the engine's figures, fleet-wide: counters add up; a peak is the highest replica's (with its utilisation)
SUMMED = ("engine/preemptions", "engine/reprefills", "engine/prefill_tokens", "engine/forked_samples",
          "engine/prefix_lookup_tokens")
PEAK = "engine/peak_blocks_used"
QUEUE_PEAKS = ("engine/peak_running", "engine/peak_waiting")  # fleet-wide: the busiest replica's

GENERATE_STEPS = 16  # engine steps a replica runs per call of the fleet's generate (its progress reported between)


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


class RolloutFleet(ReplicaStates):
    """N rollout roles behind a router: a RolloutEngine (relayrl.engine.protocols); their states: ReplicaStates."""

    def __init__(self, replicas: list[RolloutRole], router: Router, **states):
        """replicas behind `router`; states: how replicas are restarted, added and placed (ReplicaStates)."""
        super().__init__(replicas, router, **states)
        self.pad_id = replicas[0].pad_id
        self.tokens = [0] * len(replicas)  # tokens each generated since the last reset_stats
        self.busy = [0.0] * len(replicas)  # seconds each spent in generate calls since then
        self.rerouted = 0  # requests routed again since the last reset_stats (their replica was lost)
        self.reprefilled = 0  # the tokens those had generated, resumed from (re-prefilled) on another replica
        self.recovery_s = 0.0  # from the first loss noticed in a generate call to its end, since the last reset
        self.live: dict[int, dict[str, float]] = {}  # a stream's stepper's last view of each replica: queue, running
        self._version = min(r.weights_version for r in replicas)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(replicas)), thread_name_prefix="relayrl-fleet")

    def _added(self, r: int) -> None:
        self.tokens.append(0)
        self.busy.append(0.0)

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

            room = partial(ray_room, ResourcePool([1], device=device, cpus_per_process=cpus_per_replica,
                                                  gpus_per_process=tp))  # what start_process reserves

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
    # ------------------------------------------------------------------ the replicas' states (ReplicaStates)
    def status(self) -> dict:
        """Each state's replicas, by number, and the losses and restarts so far (relayrl fleet prints it)."""
        out: dict = {state: self.numbered(state) for state in (SERVING, STARTING, JOINING, DRAINING, LOST, RETIRED)}
        out |= {"size": self.size, "lost_total": self.lost_total, "restarts_total": self.restarts_total,
                "version": self.weights_version, "replicas_max": self.replicas_max,
                "waiting": [r for r, s in enumerate(self.slots) if s.state == LOST and s.waiting],
                "reasons": {str(r): s.reason for r, s in enumerate(self.slots) if s.reason}}
        return out
    def set_partial(self, value: str | None) -> None:
        """What every engine does with requests in flight across a weight update (a stream sets it): the replicas
        in service now, and each that joins later."""
        self._each(lambda role: role.set_partial(value))
        self.partial = value
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
