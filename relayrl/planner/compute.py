"""Compute time and MFU of one optimizer step.

Model FLOPs per trained token (PaLM-style, as benchmarks/bench_trainer.py counts them):

    6 N + 12 L q s           N = matmul weights (decoder linears + lm_head; a tied embedding once,
                             an untied one is a lookup, not a matmul), q = heads x head_dim, s = seq
    LoRA                     4 N_base + 6 N_adapters + 12 L q s (the frozen base needs input gradients
                             only: no weight-gradient matmul)

Hardware FLOPs add recomputation: full +2 N + 4 L q s (a second forward), selective +4 L q s (the
attention core's forward). MFU counts model FLOPs only; the step's tokens are dp x m x b x s.

    compute   = hardware FLOPs / (world x peak x kernel_efficiency)
    pipeline  = compute / (1 - bubble),   bubble = (p - 1) / (m + p - 1)
    step      = max(pipeline + TP / CP / PP communication, data-parallel communication)
                (data-parallel collectives overlap the compute; the others sit on its critical path)
    MFU       = model FLOPs / (step x world x peak)

Peak: an H100 SXM's dense 989 TFLOP/s for bf16 and 67 for fp32 (non-tensor-core) unless given.

It imports the planner's modules and relayrl.models.config only.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.models.config import ModelShape
from relayrl.planner.layout import Layout
from relayrl.planner.workload import Workload

PEAK_TFLOPS = {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0}  # H100 SXM dense
KERNEL_EFFICIENCY = 0.5  # the fraction of peak a training step's kernels reach (typically 0.4-0.6)


def matmul_params(shape: ModelShape) -> int:
    """N: weights of every matmul (biases and norms left out; the tied embedding counted once)."""
    s = shape
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    per_layer = s.hidden_size * (2 * q + 2 * kv) + 3 * s.hidden_size * s.intermediate_size
    return s.num_hidden_layers * per_layer + s.vocab_size * s.hidden_size


def adapter_params(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    s = shape
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    h, inter = s.hidden_size, s.intermediate_size
    io = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
          "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return s.num_hidden_layers * sum(rank * sum(io[t]) for t in targets)


def flops_per_token(shape: ModelShape, w: Workload) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token."""
    n = matmul_params(shape)
    attn = 12 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim * w.seq
    if w.lora_rank:
        model = 4 * n + 6 * adapter_params(shape, w.lora_rank, tuple(w.lora_targets)) + attn
    else:
        model = 6 * n + attn
    extra = {"none": 0.0, "selective": attn / 3, "full": 2 * n + attn / 3}[w.recompute]
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
