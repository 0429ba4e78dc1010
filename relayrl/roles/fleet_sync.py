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

The fleet's membership changes between syncs (relayrl.roles.fleet): at each sync the fleet is maintained first
(restarts begun, built replicas joining, drained ones closed); a replica that left has its sync group closed, and one
joining gets a group of its own (the same channel number as the replica it replaces: the trainer ranks close the old
one first), its first transfer the whole base even when the others get LoRA adapters alone, its weights version set
to the fleet's, every piece's checksum compared, and it serves from then on. A replica found lost before the sends
begin (begin_weight_update) is left out of this sync; one lost during the transfer too: its group is abandoned (the
trainer ranks drop their send to it without waiting: a send to a stopped peer ends at sync.timeout_s in its own daemon
thread) while the other replicas' transfers, each over a group of its own, complete. Any other failure part way (the
trainer's side) marks every replica's group broken and stops the run, as for one engine.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from relayrl.errors import RunFault
from relayrl.roles import sync_steps as steps
from relayrl.roles.fleet import RolloutFleet, adopt_version, settle
from relayrl.roles.fleet_replicas import JOINING, SERVING, FleetLostError
from relayrl.roles.weight_sync import PlannedWeightSync
from relayrl.trainer.policy import Policy


class FleetWeightSync:
    """The planned, verified sync of every replica of a fleet (relayrl.sync.protocol.WeightSync)."""

    def __init__(self, policy: Policy, fleet: RolloutFleet, **planned):
        """planned: PlannedWeightSync's keyword arguments (the same for every replica; placement disaggregated)."""
        self.policy, self.fleet, self.planned = policy, fleet, planned
        self.replicas: dict[int, PlannedWeightSync] = {}  # by replica number
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relayrl-fleet-sync")
        try:
            for r in fleet.serving:
                self.replicas[r] = self.replica_sync(r)
        except BaseException:
            self.close()
            raise
        self.last_table: dict[str, tuple[float, float]] = {}
        self.syncs = 0

    def replica_sync(self, r: int) -> PlannedWeightSync:
        """Replica r's sync: its engine ranks in processes of their own (a colocated fleet's differ:
        relayrl.roles.fleet_colocated)."""
        return PlannedWeightSync(self.policy, self.fleet.replicas[r], colocated=False, channel=r, **self.planned)

    def replica_bytes(self, spec) -> int:
        """What the plan moves into one replica: its whole shard (every engine rank's), in the engine's dtype."""
        return sum(spec.plan.bytes_per_dst_rank(spec.dtype).values())

    def _figures(self, syncs: list, spec, stats: list, sent_per_trainer_rank: list[int], t0: float
                 ) -> dict[str, float]:
        """A fanned-out sync's figures: one replica's (by its plan `spec`) over every replica's `stats` together
        (bytes_between_processes: all of them), the most any trainer rank sent, and what one replica takes in."""
        out = syncs[0].figures(spec, steps.total(stats), t0)
        out["sync/trainer_rank_bytes_sent_max"] = float(max(sent_per_trainer_rank))
        out["sync/bytes_per_replica"] = float(self.replica_bytes(spec))
        return out

    def _members(self) -> tuple[list[int], list[int]]:
        """The fleet maintained; each replica's sync group matched to it: (replicas in service, replicas joining)."""
        joining = self.fleet.maintain()
        keep = set(self.fleet.serving) | set(joining)
        for r in [r for r in self.replicas if r not in keep]:
            self.replicas.pop(r).close()  # lost, drained or retired: its group goes (the trainer ranks' side too)
        for r in joining:
            old = self.replicas.pop(r, None)
            if old is not None:
                old.close()  # the replica it replaces
            try:
                self.replicas[r] = self.replica_sync(r)
            except RunFault as e:  # it died before its first sync: lost again
                self.fleet.lose(r, e)
        return [r for r in self.fleet.serving if r in self.replicas], [r for r in joining if r in self.replicas]

    def transfer(self) -> dict[str, float]:
        t0 = time.perf_counter()
        serving, joining = self._members()
        version = self.fleet.weights_version + 1  # what this sync makes every replica hold
        which = self.fleet.begin_weight_update(serving + joining)  # those lost here are left out
        if not which:
            raise self.fleet.exhausted()
        specs = {r: self.replicas[r].next_spec() for r in which}
        try:
            for r in which:
                self.replicas[r].start_sends(specs[r])
            received, failed = settle({r: self._pool.submit(self.replicas[r].receive, specs[r]) for r in which})
            other = next((e for e in failed.values() if not isinstance(e, RunFault)), None)
            if other is not None:
                raise other
            for r in failed:  # a replica lost mid-transfer: the others' transfers go on (a group each)
                self.fleet.lose(r, failed[r])
                self.replicas.pop(r).abandon()
            which = [r for r in which if r in received]
            if not which:
                raise self.fleet.exhausted()
            sent = {r: self.replicas[r].finish_sends() for r in which}
            for r in which:
                self.replicas[r].after_receive()
        except FleetLostError:
            raise
        except BaseException as e:
            syncs = list(self.replicas.values())
            for s in syncs:
                s.broken = True
            for s in syncs:  # the first that finds a dead rank raises its fault
                s.failed(e)
            raise
        self.fleet.end_weight_update(which)
        which = [r for r in which if self.fleet.slots[r].state in (SERVING, JOINING)]  # lost on the way: out
        syncs = [self.replicas[r] for r in which]
        if not which:
            raise self.fleet.exhausted()
        for r in [r for r in which if r in joining]:
            try:
                self.fleet.replicas[r]._engine(adopt_version, version)
            except RunFault as e:
                self.fleet.lose(r, e)
        which = [r for r in which if self.fleet.slots[r].state in (SERVING, JOINING)]
        syncs = [self.replicas[r] for r in which]
        if not which:
            raise self.fleet.exhausted()
        versions = {r: self.fleet.replicas[r].weights_version for r in which}
        if set(versions.values()) != {version}:
            raise RuntimeError(f"after a weight sync the fleet's replicas hold weights versions {versions} (by "
                               f"replica), not {version}: a replica missed a sync; restart the run from its last "
                               "checkpoint")
        for s in syncs:
            s.syncs += 1
        self.syncs += 1
        self._synced = (which, [r for r in joining if r in which])
        out = self._figures(syncs, specs[which[0]], [x for r in which for x in received[r] + sent[r]],
                            [sum(sent[r][t].bytes_sent for r in which) for t in range(len(sent[which[0]]))], t0)
        out["fleet/joined"] = float(len([r for r in joining if r in which]))
        for r in which:
            out[f"fleet/replica{r}/sync_bytes"] = float(sum(x.bytes_received for x in received[r]))
        return out

    def sync(self, label: str | None = None) -> dict[str, float]:
        """transfer(), wake() replicas put to sleep since the last sync, then verify() each; replicas that joined
        serve once verified."""
        out = self.transfer()
        which, joining = self._synced
        woke = bool(self.fleet.asleep)
        if woke:
            self.fleet.wake()
        t0 = time.perf_counter()
        what = "sync + wake" if woke else "sync"
        after = f"{what} {label}" if label else f"{what} {self.syncs}"
        first = self.replicas[which[0]]
        trainer = first.policy.compute_logprobs(first.canary_batch())  # once: the same rows for every replica
        gaps = {}
        for r in which:
            try:
                gaps[r] = self.replicas[r].verify(f"{after}, replica {r}", trainer)
            except RunFault as e:  # lost before its canary answered: out of service (its group goes next sync)
                self.fleet.lose(r, e)
        if not gaps:
            raise self.fleet.exhausted()
        which = list(gaps)
        for r in joining:
            if r in gaps:
                self.fleet.joined(r)
        self.last_table = {f"replica {r}, {k}": v for r in which for k, v in self.replicas[r].last_table.items()}
        out["sync/canary_gap"] = max(gaps.values())
        for r, gap in gaps.items():
            out[f"fleet/replica{r}/canary_gap"] = gap
        out["time/sync_verify"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        for s in self.replicas.values():
            s.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
