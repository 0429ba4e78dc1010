"""This module computes per-piece checksums, which tell whether every weight of the engine is where the
plan put it, with the trainer's value.

A piece's checksum is sum(x * w) in float64, with w a fixed function of the LOGICAL coordinates, so
the trainer (from its local shard, rounded as the engine holds it) and the engine (from its fused
parameter) compute the same number exactly when the engine holds the right values in the right
place: a transposed head, a swapped q/k block, a shifted row all change it.

It imports torch and the sync modules only; like all of sync, it must never import the trainer, the
engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

import torch

from relayrl.sync.boxes import Box
from relayrl.sync.plan import SyncPlan, Transfer
from relayrl.sync.wire import fp8_round_trip, fp8_scales


def _coord_weights(box: Box) -> torch.Tensor:
    """A fixed weight per LOGICAL position of `box`, in [1, 2): the same on both ends of a piece."""
    rows = torch.arange(box.r0, box.r1, dtype=torch.float64)
    if box.c0 is None:
        return 1.0 + torch.remainder(rows * 7919.0, 1021.0) / 1021.0
    cols = torch.arange(box.c0, box.c1, dtype=torch.float64)
    return 1.0 + torch.remainder(rows[:, None] * 7919.0 + cols[None, :] * 104729.0, 1021.0) / 1021.0


def _checksum(values: torch.Tensor, logical: Box) -> float:
    return float((values.detach().cpu().to(torch.float64) * _coord_weights(logical)).sum())


@torch.no_grad()
def source_checksums(plan: SyncPlan, trainer_rank: int, local: dict[str, torch.Tensor],
                     dtype: torch.dtype, fp8: bool = False) -> dict[int, float]:
    """Plan index -> checksum of each piece trainer `trainer_rank` sources, rounded as the engine
    holds it (through fp8 when that is the wire, then to `dtype`, the engine's)."""
    out = {}
    for i, t in enumerate(plan.transfers):
        if t.src_rank != trainer_rank:
            continue
        x = local[t.name][t.src_box.slices()]
        if fp8:
            x = fp8_round_trip(x, fp8_scales((t,), local)[0])
        out[i] = _checksum(x.to(dtype), t.logical)
    return out


@torch.no_grad()
def dest_checksums(plan: SyncPlan, engine_rank: int, params: dict[str, torch.Tensor]) -> dict[int, float]:
    """Plan index -> checksum of what engine `engine_rank` holds where each piece should be."""
    return {i: _checksum(params[t.dst_param][t.dst_box.slices()], t.logical)
            for i, t in enumerate(plan.transfers) if t.dst_rank == engine_rank}


def first_mismatch(plan: SyncPlan, src: dict[int, float], dst: dict[int, float], rtol: float = 1e-9) -> Transfer | None:
    """The first piece (in plan order: engine rank, then parameter) whose two checksums differ."""
    for i, t in enumerate(plan.transfers):
        a, b = src.get(i), dst.get(i)
        if a is None or b is None:
            raise KeyError(f"checksum of plan piece {i} ({t.name} -> engine {t.dst_rank} {t.dst_param}) is missing")
        if not abs(a - b) <= rtol * max(1.0, abs(a)):  # NaN / inf (an unwritten piece) differs too
            return t
    return None


def describe_piece(t: Transfer) -> str:
    return (f"engine rank {t.dst_rank} {t.dst_param} {t.dst_box} (= {t.name} {t.logical}, "
            f"from trainer rank {t.src_rank})")
