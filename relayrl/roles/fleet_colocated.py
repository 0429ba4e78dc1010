"""This module places a rollout fleet on the trainer's own ranks (parallel.placement colocated, rollout.replicas N):
replica k's engine ranks live in trainer ranks k*tp .. k*tp+tp-1, and its weights come from the sharded trainer by
the same plan as one colocated engine's.

    trainer ranks (W, local processes)   0        1        2        3          (W = 4, rollout.tp = 2: 2 replicas)
    engine role beside each (RunnerWorker replicas=N, relayrl.engine.tp_workers)
                                         k0 r0    k0 r1    k1 r0    k1 r1      TP groups {0,1} and {2,3}
    driver                               replica 0: LLMEngine (its scheduler) ── WorkerRanks.of(first=0) ──> 0, 1
                                         replica 1: LLMEngine                 ── WorkerRanks.of(first=2) ──> 2, 3
                                         RolloutFleet over both (the router; relayrl.roles.fleet)

    sync:   every replica's begin_weight_update
            replica by replica: policy.run_on_ranks(trainer_colocated, spec_k, channel k) — on every trainer rank,
                the plan from the trainer's layout to replica k's engine layout with Members.engine_offset k*tp:
                the pieces a replica's rank finds in the trainer rank beside it are copied in place (replicated
                pieces are read there first: plan_sync home), the rest arrive over replica k's sync group (all W
                trainer ranks, a store of its own)
            every replica's end_weight_update, each verified (canary, checksums) as in relayrl.roles.fleet_sync

A trainer rank sends each replica what its engine ranks hold that the trainer rank beside them does not: at most
its shard once per replica. The replicas generate at once (a driver thread each; their calls reach disjoint ranks of
the trainer's group). They are the trainer's processes: a lost one is a lost trainer rank (the run stops), so a
colocated fleet has no replica of its own to restart or drain.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from relayrl.engine import LLMEngine
from relayrl.engine.tp_workers import colocated_ranks
from relayrl.roles import sync_steps as steps
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_sync import FleetWeightSync
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.roles.weight_sync import PlannedWeightSync
from relayrl.rollout.router import Router
from relayrl.single_controller.worker_group import GroupHandle


def colocated_fleet(engine_role: GroupHandle, replicas: int, tp: int, build: Callable[..., LLMEngine], tokenizer,
                    block_size: int) -> RolloutFleet:
    """`replicas` engines on the trainer's ranks: replica k's `build(runner_group=...)` over ranks k*tp..k*tp+tp-1 of
    the engine role placed in the trainer's processes (relayrl.jobs.build.colocated_engine), in the driver."""
    roles: list[RolloutRole] = []
    try:
        for k in range(replicas):
            roles.append(RolloutRole.inline(partial(build, runner_group=colocated_ranks(engine_role, tp, replica=k)),
                                            tokenizer))
    except BaseException:
        for role in roles:
            role.close()
        raise
    return RolloutFleet(roles, Router(replicas, block_size), losable=False)  # a lost rank is the trainer's


class ColocatedFleetWeightSync(FleetWeightSync):
    """The planned, verified sync of every replica of a colocated fleet (relayrl.sync.protocol.WeightSync)."""

    def replica_sync(self, r: int) -> PlannedWeightSync:
        return PlannedWeightSync(self.policy, self.fleet.replicas[r], colocated=True, channel=r,
                                 engine_offset=r * self.planned["engine_tp"], **self.planned)

    def transfer(self) -> dict[str, float]:
        t0 = time.perf_counter()
        which = sorted(self.replicas)  # a colocated fleet's replicas never leave it (they are the trainer's ranks)
        syncs = [self.replicas[r] for r in which]
        specs = [s.next_spec() for s in syncs]
        self.fleet.begin_weight_update(which)
        parts = []  # per replica: every trainer rank's SyncStats
        try:
            for s, spec in zip(syncs, specs, strict=True):  # the trainer ranks play one replica's sync at a time
                parts.append(self.policy.run_on_ranks(steps.trainer_colocated, spec, s.channel))
                s.after_receive()
        except BaseException as e:
            for s in syncs:
                s.broken = True
            for s in syncs:
                s.failed(e)
            raise
        self.fleet.end_weight_update(which)
        versions = self.fleet.versions
        if len(set(versions)) != 1:
            raise RuntimeError(f"after a weight sync the fleet's replicas hold weights versions {versions}: they "
                               "must agree (a replica missed a sync); restart the run from its last checkpoint")
        for s in syncs:
            s.syncs += 1
        self.syncs += 1
        self._synced = (which, [])
        out = self._figures(syncs, specs[0], [x for part in parts for x in part],
                            [sum(part[t].bytes_sent for part in parts) for t in range(len(parts[0]))], t0)
        for r, part in zip(which, parts, strict=True):  # what replica r's ranks took in: received, and copied in place
            out[f"fleet/replica{r}/sync_bytes"] = float(sum(x.bytes_received + x.bytes_copied for x in part))
            out[f"fleet/replica{r}/sync_bytes_copied"] = float(sum(x.bytes_copied for x in part))
        return out
