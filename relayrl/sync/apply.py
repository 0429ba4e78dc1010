"""This module carries out a SyncPlan in one process; it is the reference the transfer layer is checked
against.

    execute_plan(plan, source_locals, dst_params)     every piece: dst[param][dst box] <- src[name][src box]
    pack(plan, src, dst, locals) -> flat              one buffer per (src, dst) pair, in plan order ...
    unpack(plan, src, dst, flat, params)              ... and its inverse on the receiving side

The transfer between processes (relayrl.sync.transfer) packs and unpacks the same way (relayrl.sync.wire), bucket by
bucket; execute_plan is what its results are checked against.

shard_state_dict builds a trainer rank's local tensors from a full state dict, so the planner is
tested without any process group (a real trainer hands DTensor.to_local() of its FSDP parameters).

It imports torch, relayrl.models and the sync modules only; like all of sync, it must never import the
trainer, the engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

import torch

from relayrl.models.config import ModelShape
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.layout import TrainerLayout, trainer_holdings
from relayrl.sync.plan import SyncPlan, Transfer
from relayrl.sync.wire import pack_pieces, unpack_pieces


def shard_state_dict(full_sd: dict[str, torch.Tensor], cfg: ModelShape, layout: TrainerLayout,
                     rank: int, lora: AdapterShape | None = None) -> dict[str, torch.Tensor]:
    """Trainer `rank`'s local tensors (HF names) cut from the full logical state dict (with the
    adapters' when `lora` is given)."""
    out = {}
    for name, holdings in trainer_holdings(cfg, layout, rank, lora).items():
        (h,) = holdings
        if name not in full_sd:
            raise KeyError(f"the full state dict has no {name!r}")
        local = full_sd[name][h.box.slices()]
        out[name] = local.clone()
    return out


def empty_engine_params(plan: SyncPlan, rank: int, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Fresh destination tensors for engine `rank`, shaped as the plan expects."""
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in plan.param_shapes[rank]}


def _copy(t: Transfer, src: torch.Tensor, dst: torch.Tensor) -> None:
    dst[t.dst_box.slices()].copy_(src[t.src_box.slices()])


@torch.no_grad()
def execute_plan(plan: SyncPlan, source_locals: dict[int, dict[str, torch.Tensor]],
                 make_dst: dict[int, dict[str, torch.Tensor]]) -> int:
    """Copy every piece destined for the engine ranks in `make_dst` (rank -> {param: tensor}) from
    `source_locals` (trainer rank -> {HF name: local tensor}). Returns the elements copied."""
    n = 0
    for dst_rank, params in make_dst.items():
        for t in plan.for_dst(dst_rank):
            if t.src_rank not in source_locals:
                raise KeyError(f"engine rank {dst_rank} needs trainer rank {t.src_rank}'s {t.name}, "
                               f"which source_locals lacks")
            _copy(t, source_locals[t.src_rank][t.name], params[t.dst_param])
            n += t.numel
    return n


@torch.no_grad()
def pack(plan: SyncPlan, src_rank: int, dst_rank: int, local: dict[str, torch.Tensor],
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """The flat buffer trainer `src_rank` sends engine `dst_rank` (cast to `dtype`, e.g. the engine's)."""
    ts = plan.between(src_rank, dst_rank)
    if not ts:
        return torch.empty(0, dtype=dtype or torch.float32)
    return pack_pieces(ts, local, dtype or local[ts[0].name].dtype)


@torch.no_grad()
def unpack(plan: SyncPlan, src_rank: int, dst_rank: int, flat: torch.Tensor,
           params: dict[str, torch.Tensor]) -> None:
    """Write a buffer made by pack(plan, src_rank, dst_rank, ...) into engine `dst_rank`'s params."""
    ts = plan.between(src_rank, dst_rank)
    expected = sum(t.numel for t in ts)
    if flat.numel() != expected:
        raise ValueError(f"buffer from trainer {src_rank} to engine {dst_rank} has {flat.numel()} elements, "
                         f"the plan expects {expected}")
    unpack_pieces(ts, flat, params)
