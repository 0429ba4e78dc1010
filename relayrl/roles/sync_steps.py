"""This module holds what each member of a weight sync runs on its own rank, trainer side and engine side,
side by side.

The driver's PlannedWeightSync (relayrl.roles.weight_sync) sends these functions to where the
ranks are, with the same one call on both roles:

    policy.run_on_ranks(trainer_*, ...)   fn(trainer_rank, ...) on every trainer rank (relayrl.trainer.policy)
    engine.run_on_ranks(engine_*, ...)    fn(model_runner, ...) on every engine rank

so the actor's ranks (ActorWorker, in worker processes or inline in the driver's) and the engine's ranks,
wherever they live, run the same code. A rank's state between syncs (its sync group, a send in flight) is kept
on the rank itself: in `trainer_rank.sync_state` and in `runner.sync_state`. The functions are module-level so
that they pickle by name to worker processes.

    colocated        trainer_colocated   every trainer rank plays both roles for its engine rank r:
                                         own pieces copied in place, the rest sent and received
    disaggregated    trainer_start_send  the trainer ranks post their sends in a thread, return
                     engine_receive      the engine ranks receive and unpack
                     trainer_finish_send the trainer ranks wait for their sends

This module imports relayrl.sync (the mechanics) and the trainer's shard view; it must never import the
engine (it reaches the engine's ranks only through the functions it hands to run_on_ranks) or relayrl.cli.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

from relayrl.parallel.rendezvous import StoreAddress
from relayrl.sync.checksums import dest_checksums, source_checksums
from relayrl.sync.transfer import (
    BackgroundSend,
    Members,
    SyncComm,
    SyncSpec,
    SyncStats,
    check_locals,
    finish_receives,
    post_receives,
    sync_step,
    trainer_locals,
)
from relayrl.trainer.policy import TrainerRank

_COMM, _SEND = "comm", "send"  # keys of trainer_rank.sync_state and runner.sync_state


def _key(base: str, channel: int) -> str:
    """A trainer rank's state for the sync to engine replica `channel` (a rollout fleet syncs each replica over
    a group of its own: relayrl.roles.fleet_sync); channel 0 keeps the one engine's keys."""
    return base if channel == 0 else f"{base}/{channel}"


# ---------------------------------------------------------------------------- trainer ranks
def trainer_connect(rank: TrainerRank, store: StoreAddress, members: Members, timeout_s: float,
                    channel: int = 0) -> None:
    if members.world_size > 1:
        rank.sync_state[_key(_COMM, channel)] = SyncComm(store, members.of_trainer(rank.rank), members.world_size,
                                                         timeout_s)


def trainer_close(rank: TrainerRank, channel: int = 0) -> None:
    comm = rank.sync_state.pop(_key(_COMM, channel), None)
    if comm is not None:
        comm.close()


def trainer_abandon(rank: TrainerRank, channel: int) -> None:
    """The engine replica of `channel` was lost mid-transfer: this rank drops its send and its group to it without
    waiting (a send to a stopped peer ends at its own deadline, sync.timeout_s, in its daemon thread; a dead peer's
    at once). The channel's next group is a new one (relayrl.roles.fleet_sync)."""
    rank.sync_state.pop(_key(_SEND, channel), None)
    rank.sync_state.pop(_key(_COMM, channel), None)


def trainer_colocated(rank: TrainerRank, spec: SyncSpec, channel: int = 0) -> SyncStats:
    """Both roles of this process: engine rank r lives in trainer rank r's process (when r < engine tp; replica k of
    a colocated fleet, synced over channel k: in trainer rank k*tp + r's, spec.members.engine_offset)."""
    runner = rank.engine_runner
    engine_rank = spec.members.hosted_engine_rank(rank.rank) if runner is not None else None
    return sync_step(spec, comm=rank.sync_state.get(_key(_COMM, channel)), trainer_rank=rank.rank,
                     engine_rank=engine_rank, local=trainer_locals(rank.model),
                     params=runner.params() if engine_rank is not None else None)


def trainer_start_send(rank: TrainerRank, spec: SyncSpec, channel: int = 0) -> None:
    if rank.sync_state.get(_key(_SEND, channel)) is not None:
        raise RuntimeError("a weight sync's sends are still pending (the last sync failed part way): "
                           "restart the run from its last checkpoint")
    local = trainer_locals(rank.model)
    check_locals(spec.plan, rank.rank, local)
    rank.sync_state[_key(_SEND, channel)] = BackgroundSend(spec, rank.rank, local,
                                                           rank.sync_state.get(_key(_COMM, channel)))


def trainer_finish_send(rank: TrainerRank, channel: int = 0) -> SyncStats:
    send = rank.sync_state.pop(_key(_SEND, channel), None)
    return send.join() if send is not None else SyncStats()


def trainer_checksums(rank: TrainerRank, spec: SyncSpec) -> dict[int, float]:
    return source_checksums(spec.plan, rank.rank, trainer_locals(rank.model), spec.dtype, spec.fp8)


def trainer_weights_finite(rank: TrainerRank) -> tuple[str | None, float]:
    """(the first parameter holding a NaN or inf on this rank, or None; the largest finite |weight| here): why a
    failed canary may be the trainer's own weights and not the transfer."""
    bad, peak = None, 0.0
    with torch.no_grad():
        for name, p in rank.model.named_parameters():
            t = p.detach().to_local() if isinstance(p, DTensor) else p.detach()
            finite = torch.isfinite(t)
            if bad is None and not bool(finite.all()):
                bad = name
            if bool(finite.any()):
                peak = max(peak, float(t[finite].abs().max()))
    return bad, peak


# ---------------------------------------------------------------------------- engine ranks
def engine_connect(runner, store: StoreAddress, members: Members, timeout_s: float) -> None:
    runner.sync_state[_COMM] = SyncComm(store, members.of_engine(runner.tp.rank), members.world_size, timeout_s)


def engine_close(runner) -> None:
    comm = runner.sync_state.pop(_COMM, None)
    if comm is not None:
        comm.close()


def engine_receive(runner, spec: SyncSpec) -> SyncStats:
    t0 = time.perf_counter()
    params = runner.params()
    stats = finish_receives(post_receives(spec, runner.tp.rank, params, runner.sync_state[_COMM]), params)
    stats.seconds = time.perf_counter() - t0
    return stats


def engine_checksums(runner, spec: SyncSpec) -> dict[int, float]:
    return dest_checksums(spec.plan, runner.tp.rank, runner.params())


def engine_enable_lora(runner, rank: int, scaling: float, targets: tuple[str, ...], mode: str) -> None:
    runner.enable_lora(rank, scaling, targets, mode)


def engine_merge_lora(runner) -> None:
    runner.merge_lora()


def alive(_rank) -> None:
    """Nothing: a call that only a live rank answers (a failed sync asks each side whether a rank died)."""


def total(parts: list[SyncStats]) -> SyncStats:
    out = SyncStats()
    for p in parts:
        out = out.add(p)
    return out


def merged(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        if d:
            out.update(d)
    return out
