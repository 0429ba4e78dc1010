"""This module says where a rank stands in the engine's tensor parallelism: which rank of how many, and the
group to reduce over.

`check_tp` refuses a degree the model cannot be split by (a `TensorParallelError`, a user error);
the engine calls it before starting any worker process.

Which heads a rank holds (`head_layout`):

    Q heads:  rank r holds Q heads [r*Hq/tp, (r+1)*Hq/tp)
    KV heads: tp <= Hkv: rank r holds KV heads [r*Hkv/tp, (r+1)*Hkv/tp)
              tp >  Hkv: rank r holds the one KV head its Q heads use, r*Hkv // tp
                         (replicated on tp/Hkv ranks)

so each rank's Q heads always find their own KV heads locally (GQA group = Hq/Hkv Q heads per KV head).

It imports torch and relayrl.errors only; like the whole engine, it must never import the trainer, sync,
the controller or the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from relayrl.errors import TensorParallelError


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


def check_tp(num_heads: int, num_kv_heads: int, tp: int, intermediate_size: int | None = None) -> None:
    """Refuse a tensor-parallel degree the model cannot be split by, naming the size that does not divide."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TensorParallelError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if num_heads % tp:
        raise TensorParallelError(f"tensor_parallel_size {tp} does not divide the number of attention heads "
                                  f"({num_heads}); choose a divisor of {num_heads}")
    if not (num_kv_heads % tp == 0 or tp % num_kv_heads == 0):
        raise TensorParallelError(f"tensor_parallel_size {tp} and the number of KV heads ({num_kv_heads}) must "
                                  f"divide one another; choose a divisor or a multiple of {num_kv_heads}")
    if intermediate_size is not None and intermediate_size % tp:
        raise TensorParallelError(f"tensor_parallel_size {tp} does not divide intermediate_size "
                                  f"({intermediate_size}); choose a divisor of {intermediate_size}")


def head_layout(num_heads: int, num_kv_heads: int, tp: TPInfo) -> tuple[range, range]:
    """(Q heads, KV heads) held by this rank, as ranges of logical head indices."""
    check_tp(num_heads, num_kv_heads, tp.size)
    q_per = num_heads // tp.size
    q = range(tp.rank * q_per, (tp.rank + 1) * q_per)
    if tp.size <= num_kv_heads:
        kv_per = num_kv_heads // tp.size
        return q, range(tp.rank * kv_per, (tp.rank + 1) * kv_per)
    kv = tp.rank * num_kv_heads // tp.size
    return q, range(kv, kv + 1)
