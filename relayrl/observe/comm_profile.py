"""The trainer's collectives, measured: how many seconds of an update its all-gathers, reduce-scatters and
all-reduces ran, from torch.profiler's records.

    with CommProfile(enabled) as comm:        the profiler records the block's ops (CPU activities; on CUDA the
        stats = actor.update(batch)           kernels too; no shapes, no stacks: cheap, every
    stats |= comm.metrics()                   run.profile_every steps)

What counts as a collective (torch 2.13, found by experiment with FSDP2 and DDP on 2 gloo ranks):

    gloo:all_gather, gloo:all_reduce, gloo:broadcast, gloo:reduce_scatter, ...   the gloo work itself, on its
        own thread, start to completion (FSDP2's reduce-scatter runs as gloo:all_reduce on gloo)
    nccl* kernels (CUDA activity)                                                 the NCCL collective's kernel

Not counted: the dispatcher's c10d::allreduce_ / c10d::_allgather_base_ (they enqueue the work and return),
FSDP::all_gather / FSDP::post_backward_reduce (FSDP's spans: the copies in and out plus the wait), and the
CPU-side nccl:* records (the launch). The seconds are the union of the collectives' intervals, so two that
overlap count once and the total never exceeds the block's wall time.

    time/update_comm   seconds during which a collective ran inside the update (this rank)
    comm/update_share  time/update_comm / the update's wall time on this rank

It imports torch and the standard library only; it must never import another relayrl layer: observe is a
leaf, which the controller and the CLI import.
"""

from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

COMM_TIME = "time/update_comm"  # a part of time/update (a time/<stage>_<part> key, like time/sync_transfer)
COMM_SHARE = "comm/update_share"


def is_collective(name: str, on_device: bool) -> bool:
    """A profiler event that is a collective's execution: gloo's work, or an NCCL kernel on the device."""
    return name.startswith("nccl") if on_device else name.startswith("gloo:")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals (microseconds in), in seconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


class CommProfile:
    """A context manager: with `enabled`, profiles its block and sets `seconds` (collectives) and `wall`."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.seconds: float | None = None
        self.wall: float | None = None
        self._prof = None

    def __enter__(self) -> CommProfile:
        if self.enabled:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=acts, record_shapes=False, with_stack=False, profile_memory=False)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall = time.perf_counter() - self._t0
        self._prof.__exit__(*exc)
        if exc[0] is None:
            events = self._prof.events()
            self.seconds = union_seconds([(e.time_range.start, e.time_range.end) for e in events
                                          if is_collective(e.name, e.device_type == DeviceType.CUDA)])
        self._prof = None

    def metrics(self) -> dict[str, float]:
        """{time/update_comm, comm/update_share} when profiled, else {}."""
        if self.seconds is None:
            return {}
        return {COMM_TIME: self.seconds, COMM_SHARE: self.seconds / self.wall if self.wall else 0.0}
