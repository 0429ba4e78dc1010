"""Compute time and MFU of one optimizer step.

Model FLOPs per trained token (PaLM-style, as benchmarks/bench_trainer.py counts them):

    6 N + 12 L q s           N = matmul weights (decoder linears + lm_head; a tied embedding once,
                             an untied one is a lookup, not a matmul), q = heads x head_dim, s = seq
    LoRA                     4 N_base + 6 N_adapters + 12 L q s (the frozen base needs input gradients
                             only: no weight-gradient matmul)

    MoE                      6 N_active + 6 L h E: attention, k experts and the shared expert (the dense count
                             with an MLP k I + I_s wide), plus the routers (relayrl.planner.moe)

Hardware FLOPs add recomputation: full +2 N + 4 L q s (a second forward), selective +4 L q s (the
attention core's forward). MFU counts model FLOPs only; the step's tokens are dp x m x b x s.

    compute   = hardware FLOPs / (world x peak x kernel_efficiency)
    pipeline  = compute / (1 - bubble),   bubble: the schedule's idle share of the step (`bubble`, below)
    step      = max(pipeline + TP / CP / PP communication, data-parallel communication)
                (data-parallel collectives overlap the compute; the others sit on its critical path)
    MFU       = model FLOPs / (step x world x peak)

Peak: an H100 SXM's dense 989 TFLOP/s for bf16 and 67 for fp32 (non-tensor-core) unless given.

The counts are relayrl.models.flops' (matmul_params, train_flops, lora_train_flops), the same the benchmarks
and the run's MFU use. It imports the planner's modules and relayrl.models (config, flops) only.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.models.config import ModelShape, MoEShape
from relayrl.models.flops import (
    adapter_params,
    attention_flops_per_key,
    forward_flops,
    lora_train_flops,
    matmul_params,
    train_flops,
)
from relayrl.planner.layout import Layout
from relayrl.planner.moe import router_params
from relayrl.planner.workload import Workload

__all__ = ["KERNEL_EFFICIENCY", "PEAK_TFLOPS", "StepTime", "adapter_params", "bubble", "flops_per_token",
           "matmul_params", "step_time"]

PEAK_TFLOPS = {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}  # H100 SXM dense
KERNEL_EFFICIENCY = 0.5  # the fraction of peak a training step's kernels reach (typically 0.4-0.6)


def flops_per_token(shape: ModelShape, w: Workload) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token: relayrl.models.flops' train / LoRA counts (every token
    attends to the row's seq keys), plus the recomputed forward work."""
    router = router_params(shape)  # forward 2x, training 6x per token, like any other matmul
    if isinstance(shape, MoEShape):  # the active experts' FLOPs: a dense MLP k I + I_s wide, plus the routers
        shape = shape.active_shape()
    if w.lora_rank:
        model = lora_train_flops(shape, 1, w.seq, rank=w.lora_rank, targets=tuple(w.lora_targets))
    else:
        model = train_flops(shape, 1, w.seq) + 6 * router
    attn_fwd = attention_flops_per_key(shape) * w.seq  # 4 L H d s: one forward of the attention core
    extra = {"none": 0, "selective": attn_fwd, "full": forward_flops(shape, 1, w.seq) + 2 * router}[w.recompute]
    return float(model), float(model + extra)


def bubble(layout: Layout, m: int) -> float:
    """The share of a step a pipeline rank idles: bubble time / (bubble time + the rank's compute), for p ranks
    and m micro-batches, with a stage's forward F, input-gradient backward B and weight-gradient backward W of
    equal time (a full backward B + W = 2 F: the published analyses' assumption) and free communication:

        gpipe, 1f1b        (p - 1) / (m + p - 1)           the classic fill and drain (Huang et al. 2019;
                                                           Narayanan et al. 2021 for 1F1B: same bubble)
        interleaved_1f1b   (p - 1) / (v m + p - 1)          Narayanan et al. 2021: v = 2 stages per rank cut
                                                           the fill and drain to 1/v
        interleaved_zb     (p - 1) / (3 v m + p - 1)        ZB-H1 (Qi et al. 2023): bubble (p - 1)(F + B - W)
                                                           = (p - 1) F, on v = 2 chunks of half a stage each
                                                           (torch's ScheduleInterleavedZeroBubble is ZB1P)
        zbv                (p - 1) / (3 v m + p - 1)        ZB-V (Qi et al. 2023, section 6): every gap is
                                                           filled by deferred W passes except the V's fill,
                                                           (p - 1) chunk forwards on the last rank. The paper's
                                                           "zero bubble" also hides that fill, by overlapping
                                                           the next step (its optimizer post-validation);
                                                           torch steps the optimizer after the schedule, so it
                                                           stays
        dualpipev          (p - 1) / (3 m + p - 1)          DeepSeek-V3 (DualPipe, table 2): bubble
                                                           (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages and
                                                           chunk times F = B_in = W = 1, B = 2 (full backward),
                                                           F&B = F + B = 3 (overlapping a forward with a backward
                                                           hides communication, not compute): 2 (p - 1) against
                                                           a rank's 6 m

    These are the idle shares of torch's own action orders (torch.distributed.pipelining's pipeline_order)
    simulated at those unit times, checked in tests/planner/test_plan_pipeline.py for m >= p (interleaved) and
    m >= 2p (zbv). Below those torch's orders cannot fill their fill and drain, and the planner uses the
    1F1B figure, an upper bound of every simulated case (zbv at m = p: 0.20 simulated, 0.43 planned, p = 4).
    Measured idle on a CPU (benchmarks/RESULTS.md 'Pipeline parallelism') is higher: each schedule action and
    each hop has a fixed cost, and the split-backward schedules run twice as many actions."""
    p = layout.pp
    if p == 1:
        return 0.0
    layout.check_schedule(m)
    name, v = layout.pp_schedule, layout.stages_per_rank
    classic = (p - 1) / (m + p - 1)
    if name in ("gpipe", "1f1b"):
        return classic
    if name == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1) if m >= p else classic
    if name == "interleaved_zb":
        return (p - 1) / (3 * v * m + p - 1) if m >= p else classic
    if name == "zbv":
        return (p - 1) / (3 * v * m + p - 1) if m >= 2 * p else classic
    return (p - 1) / (3 * m + p - 1)  # dualpipev (m >= 2p: check_schedule)


@dataclass
class StepTime:
    tokens: int
    model_flops: float
    hardware_flops: float
    compute_s: float
    bubble: float
    exposed_comm_s: float
    overlapped_comm_s: float
    step_s: float
    mfu: float


def step_time(shape: ModelShape, layout: Layout, w: Workload, peak_tflops: float, exposed_s: float,
              overlapped_s: float, efficiency: float = KERNEL_EFFICIENCY) -> StepTime:
    m = w.micro_batches(layout.pp)
    tokens = layout.dp * m * w.micro_batch * w.seq
    model, hw = flops_per_token(shape, w)
    peak = peak_tflops * 1e12
    compute = tokens * hw / (layout.world_size * peak * efficiency)
    bub = bubble(layout, m)
    step = max(compute / (1 - bub) + exposed_s, overlapped_s)
    return StepTime(tokens=tokens, model_flops=tokens * model, hardware_flops=tokens * hw, compute_s=compute,
                    bubble=bub, exposed_comm_s=exposed_s, overlapped_comm_s=overlapped_s, step_s=step,
                    mfu=tokens * model / (step * layout.world_size * peak))
