"""This module fans one weight sync out to every replica of a rollout fleet (relayrl.roles.fleet): each replica gets
its shards by the same shard-to-shard plan as one engine, over a sync group of its own, and is verified on its own.

    replica r   a PlannedWeightSync (relayrl.roles.weight_sync) of channel r: trainer ranks + replica r's engine
                ranks in one gloo group, met at a store of its own; the trainer ranks keep one group per replica

    sync():     every replica's begin_weight_update                              (at once)
                the trainer ranks post their sends to every replica               (a thread per replica per rank)
                every replica's ranks receive and unpack                          (at once, a driver thread each)
                the trainer ranks wait for all their sends
                every replica's end_weight_update: each carries the new version   (the fleet checks they agree)
                verify(): each replica's canary (against one trainer forward of the rows) and, after the first
                sync, every piece's checksum

What a trainer rank sends is its shard once per replica (a broadcast tree would send less; not built yet); what a
replica receives is its shard exactly (the plan's bytes per engine rank, summed over its ranks): both are reported,
per replica and per trainer rank. Every transfer has a deadline: the sync group's timeout (sync.timeout_s) on every
message, and the worker groups' call deadlines (parallel.call_timeout_s) on every call. A failure part way marks
every replica's group broken (as for one engine) and names a dead rank when one is the cause.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from relayrl.roles import sync_steps as steps
from relayrl.roles.fleet import RolloutFleet, wait_all
from relayrl.roles.weight_sync import PlannedWeightSync
from relayrl.trainer.policy import Policy


class FleetWeightSync:
    """The planned, verified sync of every replica of a fleet (relayrl.sync.protocol.WeightSync)."""

    def __init__(self, policy: Policy, fleet: RolloutFleet, **planned):
        """planned: PlannedWeightSync's keyword arguments (the same for every replica; placement disaggregated)."""
        self.policy, self.fleet = policy, fleet
        self.replicas: list[PlannedWeightSync] = []
        try:
            for r, role in enumerate(fleet.replicas):
                self.replicas.append(self.replica_sync(r, role, planned))
        except BaseException:
            self.close()
            raise
        self.last_table: dict[str, tuple[float, float]] = {}
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="relayrl-fleet-sync")

    def replica_sync(self, r: int, role, planned: dict) -> PlannedWeightSync:
        """Replica r's sync: its engine ranks in processes of their own (a colocated fleet's differ:
        relayrl.roles.fleet_colocated)."""
        return PlannedWeightSync(self.policy, role, colocated=False, channel=r, **planned)

    def replica_bytes(self, spec) -> int:
        """What the plan moves into one replica: its whole shard (every engine rank's), in the engine's dtype."""
        return sum(spec.plan.bytes_per_dst_rank(spec.dtype).values())

    def transfer(self) -> dict[str, float]:
        t0 = time.perf_counter()
        syncs = self.replicas
        specs = [s.next_spec() for s in syncs]
        self.fleet.begin_weight_update()
        try:
            for s, spec in zip(syncs, specs, strict=True):
                s.start_sends(spec)
            received = wait_all([self._pool.submit(s.receive, spec) for s, spec in zip(syncs, specs, strict=True)])
            sent = [s.finish_sends() for s in syncs]
            for s in syncs:
                s.after_receive()
        except BaseException as e:
            for s in syncs:
                s.broken = True
            for s in syncs:  # the first that finds a dead rank raises its fault
                s.failed(e)
            raise
        self.fleet.end_weight_update()
        versions = self.fleet.versions
        if len(set(versions)) != 1:
            raise RuntimeError(f"after a weight sync the fleet's replicas hold weights versions {versions}: they "
                               "must agree (a replica missed a sync); restart the run from its last checkpoint")
        for s in syncs:
            s.syncs += 1
        total = steps.total([x for part in received + sent for x in part])
        out = syncs[0].figures(specs[0], total, t0)  # bytes_between_processes: every replica's together
        per_trainer_rank = [sum(part[t].bytes_sent for part in sent) for t in range(len(sent[0]))]
        out["sync/trainer_rank_bytes_sent_max"] = float(max(per_trainer_rank))
        out["sync/bytes_per_replica"] = float(self.replica_bytes(specs[0]))
        for r, part in enumerate(received):
            out[f"fleet/replica{r}/sync_bytes"] = float(sum(x.bytes_received for x in part))
        return out

    def sync(self, label: str | None = None) -> dict[str, float]:
        """transfer(), wake() replicas put to sleep since the last sync, then verify() each."""
        out = self.transfer()
        woke = bool(self.fleet.asleep)
        if woke:
            self.fleet.wake()
        t0 = time.perf_counter()
        what = "sync + wake" if woke else "sync"
        after = f"{what} {label}" if label else f"{what} {self.replicas[0].syncs}"
        first = self.replicas[0]
        trainer = first.policy.compute_logprobs(first.canary_batch())  # once: the same rows for every replica
        gaps = [s.verify(f"{after}, replica {r}", trainer) for r, s in enumerate(self.replicas)]
        self.last_table = {f"replica {r}, {k}": v for r, s in enumerate(self.replicas) for k, v in s.last_table.items()}
        out["sync/canary_gap"] = max(gaps)
        for r, gap in enumerate(gaps):
            out[f"fleet/replica{r}/canary_gap"] = gap
        out["time/sync_verify"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        for s in self.replicas:
            s.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
