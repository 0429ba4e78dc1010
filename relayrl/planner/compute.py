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
    pipeline  = compute / (1 - bubble),   bubble = (p - 1) / (m + p - 1)
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
    p = layout.pp
    return (p - 1) / (m + p - 1) if p > 1 else 0.0


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
