"""A training layout as data: the parallel degrees and how data parallelism holds the state.

    world = pp x dp_replicate x dp_shard x cp x tp        rank order: tp fastest, then cp, dp_shard,
                                                          dp_replicate, pp (slowest)

    rank = (((stage * dp_replicate + replica) * dp_shard + shard) * cp + c) * tp + t

With cp = pp = 1 this is relayrl.parallel.dims.ParallelDims' order, (replica * dp_shard + shard) * tp + t,
so a planned rank is the trainer's rank. A TP group is contiguous ranks (one node's GPUs first); the
ZeRO / FSDP shard group is dp_shard x cp (torchtitan folds CP into the FSDP mesh: CP ranks hold the same
parameters, so they shard them too), at stride tp; dp_replicate replicas hold identical shards (HSDP).
EP (MoE models only) is the shard group's ep innermost ranks (stride tp): each holds num_experts / ep experts,
and the shard group / ep ranks holding the same experts shard them (relayrl.planner.moe).

dp_mode says what the dp_shard group shards (ZeRO stages; DeepSpeed's names):

    ddp     nothing: every data-parallel rank holds all of params, grads and optimizer state
    zero1   the optimizer state (Adam m, v and the fp32 master copy)
    zero2   the optimizer state and the gradients
    fsdp    everything: params too (ZeRO-3; FSDP2's fully_shard; HSDP with dp_replicate > 1)

Pipeline schedules (pp_schedule; relayrl.parallel.pipeline runs them with torch.distributed.pipelining):

    schedule            stages per rank   placement on pp rank r       torch's rule on m micro-batches
    gpipe               1                 r                            -
    1f1b                1                 r                            m >= p
    interleaved_1f1b    2                 loop: r, r + p               m % max(1, m // p) == 0
    interleaved_zb      2                 loop: r, r + p               m % max(1, m // p) == 0
    zbv                 2                 v: r, 2p - 1 - r             -
    dualpipev           2                 v: r, 2p - 1 - r             m >= 2p (the number of stages)

and every one of the p x stages-per-rank stages needs a decoder layer. The table is
relayrl.parallel.pipeline_stages.SCHEDULE_STAGES (which the planner may not import: it plans without the
parallel layer), checked equal to it in tests/planner/test_plan_pipeline.py. Under a V placement rank 0 holds the first
stage (the embedding) and the last (the final norm and lm_head). With pp = 1 the schedule plays no part.

It imports relayrl.errors only.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import ConfigError

DP_MODES = ("ddp", "zero1", "zero2", "fsdp")
# name -> (stages per rank, placement): relayrl.parallel.pipeline_stages.SCHEDULE_STAGES
SCHEDULE_STAGES = {
    "gpipe": (1, "loop"),
    "1f1b": (1, "loop"),
    "interleaved_1f1b": (2, "loop"),
    "interleaved_zb": (2, "loop"),
    "zbv": (2, "v"),
    "dualpipev": (2, "v"),
}
PP_SCHEDULES = tuple(SCHEDULE_STAGES)
CP_MODES = ("ring", "ulysses")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: bool = False  # sequence parallel: norms and residuals sharded on the sequence between TP regions
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: only MoE models have experts; dense shapes need ep = 1
    dp_mode: str = "fsdp"
    pp_schedule: str = "1f1b"
    cp_mode: str = "ring"

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"layout {name} must be an integer >= 1, got {v!r}")
        if self.dp_mode not in DP_MODES:
            raise ConfigError(f"layout dp_mode must be one of {', '.join(DP_MODES)}, got {self.dp_mode!r}")
        if self.dp_mode == "ddp" and self.dp_shard > 1:
            raise ConfigError(f"dp_mode='ddp' replicates the model, but dp_shard={self.dp_shard}: use dp_replicate "
                              "for DDP, or a ZeRO mode (zero1, zero2, fsdp) to shard")
        if self.sp and self.tp == 1:
            raise ConfigError("sequence parallel (sp) needs tp > 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"layout pp_schedule must be one of {', '.join(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        if self.cp_mode not in CP_MODES:
            raise ConfigError(f"layout cp_mode must be one of {', '.join(CP_MODES)}, got {self.cp_mode!r}")
        if self.ep > 1 and (self.dp_mode == "ddp" or (self.dp_shard * self.cp) % self.ep):
            raise ConfigError(f"ep={self.ep} takes its ranks from the shard group (dp_shard x cp = "
                              f"{self.dp_shard * self.cp}, dp_mode {self.dp_mode}): it needs a sharding dp_mode "
                              "(zero1, zero2, fsdp) and ep dividing dp_shard x cp")

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pp rank holds (1 without a pipeline)."""
        return SCHEDULE_STAGES[self.pp_schedule][0] if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_stages(self, pp_rank: int) -> tuple[int, ...]:
        """The stage indices pp rank `pp_rank` holds, in the order its schedule runs them (the table above)."""
        p, v = self.pp, self.stages_per_rank
        if not 0 <= pp_rank < p:
            raise ConfigError(f"pp rank {pp_rank} out of range for pp={p}")
        if v == 1:
            return (pp_rank,)
        if SCHEDULE_STAGES[self.pp_schedule][1] == "v":
            return pp_rank, 2 * p - 1 - pp_rank
        return tuple(pp_rank + s * p for s in range(v))

    def schedule_error(self, m: int, num_layers: int | None = None) -> str | None:
        """Why this pipeline cannot run m micro-batches over num_layers decoder layers (torch's rules, the table
        above), or None when it can."""
        p, name = self.pp, self.pp_schedule
        if p == 1:
            return None
        if num_layers is not None and self.num_stages > num_layers:
            return (f"pp={p} with {name} makes {self.num_stages} stages ({self.stages_per_rank} per rank), more than "
                    f"the model's {num_layers} decoder layers")
        if name == "1f1b" and m < p:
            return f"1f1b needs micro-batches >= pp: {m} < {p} (torch's Schedule1F1B)"
        if name == "dualpipev" and m < 2 * p:
            return f"dualpipev needs micro-batches >= stages (2 x pp = {2 * p}), got {m} (torch's ScheduleDualPipeV)"
        if name in ("interleaved_1f1b", "interleaved_zb") and m % max(1, m // p):
            torch_name = "Interleaved1F1B" if name == "interleaved_1f1b" else "InterleavedZeroBubble"
            return (f"{name} needs micro-batches a multiple of its rounds max(1, m // pp) = {max(1, m // p)}, "
                    f"got m={m} (torch's Schedule{torch_name})")
        return None

    def check_schedule(self, m: int, num_layers: int | None = None) -> None:
        err = self.schedule_error(m, num_layers)
        if err:
            raise ConfigError(f"layout {self.describe()}: {err}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batch shards are trained at once (CP ranks share one)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """How many ranks one ZeRO / FSDP shard group has (dp_shard x cp); 1 under DDP."""
        return 1 if self.dp_mode == "ddp" else self.dp_shard * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """stage, replica, shard, c, t of a global rank (the order in the module docstring)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} out of range for a layout of {self.world_size} ranks")
        t, rest = rank % self.tp, rank // self.tp
        c, rest = rest % self.cp, rest // self.cp
        shard, rest = rest % self.dp_shard, rest // self.dp_shard
        replica, stage = rest % self.dp_replicate, rest // self.dp_replicate
        return dict(stage=stage, replica=replica, shard=shard, c=c, t=t)

    def rank_of(self, *, stage: int = 0, replica: int = 0, shard: int = 0, c: int = 0, t: int = 0) -> int:
        return (((stage * self.dp_replicate + replica) * self.dp_shard + shard) * self.cp + c) * self.tp + t

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours along `dim` (tp 1, cp tp, dp_shard tp*cp, ...)."""
        order = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
        s = 1
        for d in order[: order.index(dim)]:
            s *= getattr(self, d)
        return s

    def describe(self) -> str:
        """A short name: 'fsdp:8', 'ddp:4 x tp2+sp', 'hsdp:2x4 x pp2(1f1b)', 'zero1:8 x rep2'."""
        if self.dp_mode == "fsdp" and self.dp_replicate > 1 and self.dp_shard > 1:
            dp = f"hsdp:{self.dp_replicate}x{self.dp_shard}"
        elif self.dp_mode == "ddp":
            dp = f"ddp:{self.dp_replicate}"
        else:
            dp = f"{self.dp_mode}:{self.dp_shard}" + (f" x rep{self.dp_replicate}" if self.dp_replicate > 1 else "")
        parts = [dp]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp else ""))
        if self.cp > 1:
            parts.append(f"cp{self.cp}({self.cp_mode})")
        if self.pp > 1:
            parts.append(f"pp{self.pp}({self.pp_schedule})")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return " x ".join(parts)
