"""How a worker-group method call is split over the workers and how their results are gathered.

The mode is declared once, at the worker method; the driver just calls `group.method(...)`:

    class ActorWorker(Worker):
        @dispatch(Dispatch.DP_SPLIT)
        def compute_logprobs(self, batch: TrainBatch) -> DataBatch: ...

    ONE_TO_ALL  every worker gets the same arguments      → [result of rank 0, ..., rank N-1]
    DP_SPLIT    each Rows argument (a DataBatch, or a      → concat of the representatives' results
                caller's typed batch) is cut into dp_size    (Rows of one type), in dp-rank order (other
                chunks; a worker gets the chunk of its dp    results: a list, one per dp rank; all None:
                rank, non-batch args unchanged               None)
    RANK_ZERO   every worker gets the same arguments       → rank 0's result
                (SPMD collectives need all ranks)

Each method also declares the kind of its deadline (relayrl.single_controller.liveness): "compute"
by default (model work: generate, update, logprobs, checkpoints), "control" for quick bookkeeping
calls, "build" for construction. The group's options turn a kind into seconds.

The data-parallel convention (each worker reports it through `Worker.dp_info()`):

    dp_rank      which data shard this worker consumes; workers that share a dp_rank (tensor- or
                 pipeline-parallel peers) receive the same chunk
    dp_size      the number of shards, the same on every worker of the role
    representative  exactly one worker per dp_rank whose result stands for that shard
                 (TP rank 0; with pipeline parallelism, TP rank 0 of the last stage)

    world 4 = dp 2 x tp 2 (tp fastest):  rank 0 (dp 0, rep) rank 1 (dp 0)  rank 2 (dp 1, rep) rank 3 (dp 1)
    batch of 6 rows → rows 0-2 to ranks 0 and 1, rows 3-5 to ranks 2 and 3; result = rep 0 ++ rep 2

It imports the standard library and the Rows protocol only; like all of single_controller, it knows nothing of
RL and must never import the RL layers (controller, trainer, engine, rewards, sync, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from relayrl.single_controller.batch import Rows

_ATTR = "__relayrl_dispatch__"
_DEADLINE_ATTR = "__relayrl_deadline__"
DEADLINE_KINDS = ("build", "compute", "control")


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"
    DP_SPLIT = "dp_split"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DPInfo:
    """A worker's place in its role's data-parallel layout (see the module doc)."""

    dp_rank: int
    dp_size: int
    is_representative: bool = True


def dispatch(mode: Dispatch | str, deadline: str = "compute") -> Callable[[Callable], Callable]:
    """Declare how a worker method is called from its group, and the kind of its deadline
    (build | compute | control). The method itself is unchanged."""
    try:
        mode = Dispatch(mode)
    except ValueError:
        raise ValueError(f"unknown dispatch mode {mode!r}; use one of {[m.value for m in Dispatch]}") from None
    if deadline not in DEADLINE_KINDS:
        raise ValueError(f"unknown deadline kind {deadline!r}; use one of {DEADLINE_KINDS}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTR, mode)
        setattr(fn, _DEADLINE_ATTR, deadline)
        return fn

    return mark


def dispatch_mode(fn: Any) -> Dispatch | None:
    """The mode a method was declared with, or None for a plain method."""
    return getattr(fn, _ATTR, None)


def deadline_kind(fn: Any) -> str:
    """The deadline kind a method was declared with ("compute" for plain methods)."""
    return getattr(fn, _DEADLINE_ATTR, "compute")


def check_layout(infos: Sequence[DPInfo], where: str = "worker group") -> None:
    """Every worker agrees on dp_size, every dp rank has workers and exactly one representative."""
    sizes = {i.dp_size for i in infos}
    if len(sizes) != 1:
        raise ValueError(f"{where}: workers report different dp_size values {sorted(sizes)}")
    (size,) = sizes
    reps = [0] * size
    seen = [0] * size
    for rank, info in enumerate(infos):
        if not 0 <= info.dp_rank < size:
            raise ValueError(f"{where}: rank {rank} reports dp_rank {info.dp_rank} outside [0, {size})")
        seen[info.dp_rank] += 1
        reps[info.dp_rank] += int(info.is_representative)
    bad = [d for d in range(size) if seen[d] == 0 or reps[d] != 1]
    if bad:
        raise ValueError(f"{where}: dp ranks {bad} need at least one worker and exactly one representative; "
                         f"layout by rank: {[(i.dp_rank, i.is_representative) for i in infos]}")


Call = tuple[tuple, dict]  # the (args, kwargs) one worker receives


def split_inputs(mode: Dispatch, infos: Sequence[DPInfo], args: tuple, kwargs: dict) -> list[Call]:
    """The (args, kwargs) for each worker, by rank."""
    if mode is not Dispatch.DP_SPLIT:
        return [(args, kwargs)] * len(infos)
    dp_size = infos[0].dp_size
    chunked_args = [_chunks(a, dp_size) for a in args]
    chunked_kwargs = {k: _chunks(v, dp_size) for k, v in kwargs.items()}
    # one (args, kwargs) object per dp rank, shared by its workers (backends send a shared one once)
    per_dp = [(tuple(c[d] for c in chunked_args), {k: c[d] for k, c in chunked_kwargs.items()})
              for d in range(dp_size)]
    return [per_dp[i.dp_rank] for i in infos]


def _chunks(value: Any, n: int) -> Sequence[Any]:
    return value.chunk(n) if isinstance(value, Rows) else [value] * n


def collect_outputs(mode: Dispatch, infos: Sequence[DPInfo], results: Sequence[Any]) -> Any:
    """Gather the workers' results (by rank) into what the driver gets back."""
    if mode is Dispatch.ONE_TO_ALL:
        return list(results)
    if mode is Dispatch.RANK_ZERO:
        return results[0]
    by_dp = [r for r, i in sorted(zip(results, infos, strict=True), key=lambda p: p[1].dp_rank) if i.is_representative]
    if all(isinstance(r, Rows) for r in by_dp) and len({type(r) for r in by_dp}) == 1:
        return type(by_dp[0]).concat(by_dp)
    if all(r is None for r in by_dp):
        return None
    return by_dp
