"""The plan: every training layout of the GPUs, its memory, communication and step time; the rollout
engine's TP degrees; colocated or disaggregated.

Training layouts: every factorisation gpus = pp x dp_replicate x dp_shard x cp x tp with tp inside a node
and dividing the model (heads, KV heads, intermediate and vocab sizes: the trainer's TP plan), sp on and
off, with pp > 1 every pipeline schedule that can run the step's micro-batches over the model's layers
(Layout.schedule_error: torch's rules, e.g. dualpipev needs m >= 2 pp, the two-stage schedules 2 pp layers),
dp_mode ddp / zero1 / zero2 / fsdp, HSDP (fsdp with dp_replicate > 1), and for MoE models every EP degree
dividing the shard group and the experts (relayrl.planner.moe). A layout fits when its
largest rank's total <= gpu_mem; those are ranked by MFU (tokens per second per GPU), the rest listed by
how far they are over.

The rollout engine's TP degrees and colocated or disaggregated: relayrl.planner.rollout.

It imports the planner's modules, relayrl.models.config, relayrl.sync.presets and relayrl.errors only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape
from relayrl.planner.comm import Collective, Network, step_collectives
from relayrl.planner.compute import StepTime, step_time
from relayrl.planner.layout import PP_SCHEDULES, Layout
from relayrl.planner.memory import TrainMemory, adapter_shape, rank_layers, stage_summary, train_memory
from relayrl.planner.moe import MOE_PRESETS, mlp_widths, plan_shape
from relayrl.planner.rollout import GIB, Engine, FleetOption, RolloutOption, fleet_option, placement, rollout_options
from relayrl.planner.workload import Workload
from relayrl.sync.presets import PRESETS

__all__ = ["GIB", "Plan", "TrainOption", "make_plan"]


@dataclass
class TrainOption:
    layout: str
    degrees: dict
    memory: TrainMemory
    fits: bool
    over_bytes: int
    collectives: list[Collective]
    time: StepTime


@dataclass
class Plan:
    model: str
    gpus: int
    gpu_mem_bytes: int
    assumptions: list[str]
    train: list[TrainOption]
    rollout: list[RolloutOption]
    placement: str
    placement_reason: str
    engine_tp: int | None = None  # the engine's TP degree the placement chose
    fleet: FleetOption | None = None  # --replicas: the rollout fleet asked for
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_ok(shape: ModelShape, tp: int) -> bool:
    return all(x % tp == 0 for x in (shape.num_attention_heads, shape.num_key_value_heads, shape.vocab_size,
                                     *mlp_widths(shape)))


def ep_degrees(shape: ModelShape, shard_group: int) -> list[int]:
    """EP degrees > 1 of an MoE model over a shard group: dividing it and the number of experts."""
    if not isinstance(shape, MoEShape):
        return []
    return [d for d in _divisors(shard_group) if d > 1 and shape.num_experts % d == 0]


def preset_shape(name: str) -> ModelShape:
    """A dense preset (relayrl.sync.presets) or an MoE one (relayrl.planner.moe.MOE_PRESETS)."""
    if name in MOE_PRESETS:
        return MOE_PRESETS[name]
    if name in PRESETS:
        return PRESETS[name]
    raise ConfigError(f"unknown model preset {name!r} (known: {', '.join([*PRESETS, *MOE_PRESETS])}); "
                      "or pass --model DIR")


def schedules(shape: ModelShape, pp: int, m: int) -> list[str]:
    """The pipeline schedules that can run m micro-batches on pp ranks over the model's layers (all one with pp 1)."""
    if pp == 1:
        return ["1f1b"]
    return [name for name in PP_SCHEDULES
            if Layout(pp=pp, pp_schedule=name).schedule_error(m, shape.num_hidden_layers) is None]


def layouts(shape: ModelShape, gpus: int, gpus_per_node: int, seq: int, m: int = 8) -> list[Layout]:
    """Every layout of the module docstring; m: micro-batches per step (which pipeline schedules can run)."""
    out = []
    for pp in _divisors(gpus):
        for sched in schedules(shape, pp, m):
            out += _layouts_of_pipeline(shape, gpus, gpus_per_node, seq, pp, sched)
    return out


def _layouts_of_pipeline(shape: ModelShape, gpus: int, gpus_per_node: int, seq: int, pp: int,
                         sched: str) -> list[Layout]:
    out: list[Layout] = []
    if pp > shape.num_hidden_layers:
        return out
    for tp in _divisors(gpus // pp):
        if tp > gpus_per_node or not tp_ok(shape, tp):
            continue
        for cp in _divisors(gpus // (pp * tp)):
            if seq % cp or cp > 1 and seq // cp < 128:
                continue
            dp = gpus // (pp * tp * cp)
            sps = (False, True) if tp > 1 else (False,)
            for sp in sps:
                common = dict(tp=tp, sp=sp, pp=pp, cp=cp, pp_schedule=sched)
                out.append(Layout(dp_replicate=dp, dp_shard=1, dp_mode="ddp", **common))
                for mode in ("zero1", "zero2", "fsdp"):
                    if dp * cp > 1:  # a shard group to shard over
                        for ep in (1, *ep_degrees(shape, dp * cp)):
                            out.append(Layout(dp_shard=dp, dp_mode=mode, ep=ep, **common))
                for r in _divisors(dp):
                    if 1 < r < dp:
                        for ep in (1, *ep_degrees(shape, dp // r * cp)):
                            out.append(Layout(dp_replicate=r, dp_shard=dp // r, dp_mode="fsdp", ep=ep, **common))
    return out


def evaluate(shape: ModelShape, layout: Layout, w: Workload, gpu_mem: int, net: Network,
             peak_tflops: float, efficiency: float) -> TrainOption:
    mem = train_memory(shape, layout, w)
    stage = layout.coords(mem.rank)["stage"] if mem.rank is not None else 0
    elems, _, _, experts = stage_summary(shape, layout, w, stage)
    n_layers = len(rank_layers(shape.num_hidden_layers, layout, stage))
    colls = step_collectives(shape, layout, w, net, elems, n_layers, experts)
    exposed = sum(c.seconds for c in colls if not c.overlapped)
    overlapped = sum(c.seconds for c in colls if c.overlapped)
    t = step_time(shape, layout, w, peak_tflops, exposed, overlapped, efficiency)
    degrees = {k: getattr(layout, k) for k in ("dp_replicate", "dp_shard", "tp", "sp", "pp", "cp", "ep", "dp_mode",
                                               "pp_schedule")}
    return TrainOption(layout.describe(), degrees, mem, mem.total <= gpu_mem, max(0, mem.total - gpu_mem), colls, t)


def make_plan(shape: ModelShape, name: str, w: Workload, *, gpus: int, gpu_mem_gib: float, nodes: int = 1,
              intra_bw: float = 450.0, inter_bw: float = 50.0, peak_tflops: float | None = None,
              efficiency: float = 0.5, gpu_util: float = 0.9, max_num_seqs: int = 256, block_size: int = 16,
              rollout_seqs: int = 64, lora_sync: str = "separate", hbm_gbs: float = 3350.0,
              replicas: int | None = None, engine_tp: int = 1) -> Plan:
    from relayrl.planner.compute import PEAK_TFLOPS

    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise ConfigError(f"--gpus ({gpus}) must be >= 1 and a multiple of --nodes ({nodes})")
    if gpu_mem_gib <= 0:
        raise ConfigError(f"--gpu-mem must be > 0 GiB, got {gpu_mem_gib}")
    shape = plan_shape(shape)  # a loaded ModelConfig is unhashable; the cached per-shape tables need a shape
    if isinstance(shape, MoEShape) and w.lora_rank:
        raise ConfigError("LoRA on an MoE model is not planned (per-expert adapters): plan it without --lora-rank")
    per_node = gpus // nodes
    net = Network(per_node, intra_bw, inter_bw)
    peak = peak_tflops if peak_tflops is not None else PEAK_TFLOPS[w.dtype]
    mem = int(gpu_mem_gib * GIB)
    opts = [evaluate(shape, lay, w, mem, net, peak, efficiency)
            for lay in layouts(shape, gpus, per_node, w.seq, w.micro_batches(1))]
    # throughput, not step time, ranks them: layouts differ in tokens per step (CP and PP shrink dp)
    fit = sorted((o for o in opts if o.fits), key=lambda o: (-o.time.mfu, o.memory.total))
    over = sorted((o for o in opts if not o.fits), key=lambda o: o.over_bytes)
    eng = Engine(w.dtype, w.seq, gpu_util, max_num_seqs, block_size, adapter_shape(shape, w), lora_sync,
                 peak_tflops=peak, hbm_gbs=hbm_gbs, intra_bw=intra_bw, efficiency=efficiency)
    roll = rollout_options(shape, gpus, per_node, mem, eng)
    fleet = None if replicas is None else fleet_option(shape, replicas, engine_tp, gpus, per_node, mem, eng)
    where = placement(fit[0].memory if fit else None, shape, gpus, per_node, mem, eng, rollout_seqs, roll)
    peak_note = "given" if peak_tflops is not None else f"an H100 SXM's dense {w.dtype} peak (--peak-tflops to change)"
    assumptions = [
        f"state: {w.describe_state()}; torch AdamW's step: 4 B per trained tensor",
        f"activations: {w.dtype} ({w.act_bytes} B), recompute={w.recompute}, attention={w.attention}, "
        f"seq {w.seq} x micro-batch {w.micro_batch}; Korthikanti et al. 2022 adapted to RMSNorm/SwiGLU/GQA "
        "(relayrl.planner.activations)",
        f"{w.micro_batches(1)} micro-batches per optimizer step on every layout (--micro-batches); "
        "pipeline bubble per schedule at equal forward, input- and weight-gradient times (gpipe / 1f1b "
        "(p-1)/(m+p-1), interleaved_1f1b (p-1)/(2m+p-1), interleaved_zb and zbv (p-1)/(6m+p-1), dualpipev "
        "(p-1)/(3m+p-1): relayrl.planner.compute.bubble)",
        f"network: {net.describe()}; rank order tp, cp, dp_shard, dp_replicate, pp",
        f"compute: {peak:g} TFLOP/s peak per GPU ({peak_note}) x kernel efficiency {efficiency:g}; "
        "data-parallel communication overlaps compute, TP/CP/PP communication does not",
        f"rollout: engine in {w.dtype}, KV from gpu_mem x {gpu_util:g} minus weights, block_size {block_size}, "
        f"max_num_seqs {max_num_seqs}; decode speed a roofline: max(weights + KV read at {hbm_gbs:g} GB/s HBM "
        f"(--hbm-bw), FLOPs at the peak), both x {efficiency:g}, + TP all-reduces; no launch latency (a bound)",
        "transient buffers are summed (a conservative peak); allocator fragmentation and CUDA context not counted",
    ]
    if isinstance(shape, MoEShape):
        assumptions.append(f"MoE: {shape.num_experts} experts of {shape.moe_intermediate_size}, top-"
                           f"{shape.num_experts_per_tok}" + (f", a shared expert of {shape.shared_width}"
                                                            if shape.shared_width else "")
                           + "; balanced, dropless routing; expert TP = TP; EP from the shard group's innermost "
                           "ranks, experts FSDP-sharded over the rest (relayrl.planner.moe)")
    if w.lora_rank:
        assumptions.append(f"LoRA rank {w.lora_rank} on {', '.join(w.lora_targets)}; frozen base in "
                           f"{w.base_dtype or w.dtype}; engine sync.lora={lora_sync} (" + (
                               "a second copy of the targeted base weights on the engine)" if lora_sync == "merge"
                               else "the adapters kept apart: stacked A, per-part B)"))
    if fleet is not None:
        assumptions.append(f"rollout fleet: {replicas} replicas x engine tp {engine_tp} = {fleet.processes} engine "
                           "ranks, each a process on a GPU of its own; tokens/s over all replicas")
    return Plan(name, gpus, mem, assumptions, fit + over, roll, where.where, where.reason, where.engine_tp, fleet=fleet)
