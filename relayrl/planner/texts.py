"""The reading's 70B memory figures (../shared/reading/distributed-rl-training.txt, "Distributing Memory
Across GPUs"), recomputed with the planner's own arithmetic, each with the assumptions that reproduce it
and a verdict: "follows", "follows under assumptions" or "does not follow".

    Psi = 70e9 parameters (the text's nominal 70B; decimal GB and TB as the text writes them)
    16 B/param = bf16 weights 2 + grads 2 + fp32 master 4 + Adam m 4 + v 4   (relayrl.planner.workload)
    12 B/param = the same without the fp32 master copy

The text's table says 16 B/param, but its "~940 GB" and "~118 GB" rows only follow from 12 B/param
(840 GB) plus the table's ~100 GB of activations; the checkpointing and LoRA rows need more GPUs
than the 8 that make "~118 GB" follow. Activations under checkpointing scale the text's ~100 GB by the
planner's full-recompute / no-recompute ratio for llama-3-70b at one 4096-token sequence.

`relayrl plan --texts` prints this table; tests/planner/test_plan_texts.py checks every number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relayrl.planner.activations import activation_terms, korthikanti_layer_bytes
from relayrl.planner.compute import adapter_params
from relayrl.planner.layout import Layout
from relayrl.planner.memory import train_memory
from relayrl.planner.workload import Workload
from relayrl.sync.presets import preset

PSI = 70e9
GB = 1e9
TEXT_ACTIVATIONS = 100 * GB  # the table's "~100 GB"


@dataclass(frozen=True)
class Figure:
    what: str
    text: str  # as the text writes it
    computed: float  # in `unit`
    unit: str
    assumptions: str
    verdict: str  # "follows" | "follows under assumptions" | "does not follow"


def bytes_per_param(master: bool) -> int:
    w = Workload(seq=1, micro_batch=1, dtype="bfloat16", mixed_precision=True, master_copy=master)
    return w.state_bytes().total


def checkpoint_ratio() -> float:
    """Full-recompute activations / no-recompute activations, llama-3-70b, b=1, s=4096, bf16, one rank."""
    shape = preset("llama-3-70b")

    def act(recompute: str) -> int:
        w = Workload(seq=4096, micro_batch=1, recompute=recompute)
        return sum(b for _, b, _ in activation_terms(shape, Layout(), w, 0))

    return act("full") / act("none")


def korthikanti_70b() -> float:
    """The paper's 16-bit GPT formula at 70B's width, one 4096-token sequence, flash attention (the scores' term
    dropped, as selective recompute drops it), 80 layers, plus the fp32 log-softmax over llama-3's 128256 words."""
    layers = 80 * korthikanti_layer_bytes(4096, 1, 8192, 64, recompute="selective")
    return layers + 4 * 4096 * 128256


def one_sequence_activations() -> float:
    """Activations of one 4096-token sequence of llama-3-70b (bf16, sdpa), bytes."""
    w = Workload(seq=4096, micro_batch=1)
    return sum(b for _, b, _ in activation_terms(preset("llama-3-70b"), Layout(), w, 0))


def zero_saving(level: int, n: int, k: int = 12) -> float:
    """Per-GPU state of no sharding / ZeRO-level (the ZeRO paper's 2+2+K bytes per parameter)."""
    full = 4 + k
    held = {1: 4 + k / n, 2: 2 + (2 + k) / n, 3: full / n}[level]
    return full / held


def planner_zero_saving(level: int, n: int) -> float:
    """The same ratio from train_memory on llama-3-70b's real tensors (per-tensor chunks, step counters)."""
    shape = preset("llama-3-70b")
    w = Workload(seq=1, micro_batch=1)
    base = train_memory(shape, Layout(dp_replicate=n, dp_mode="ddp"), w, rank=0).state
    mode = {1: "zero1", 2: "zero2", 3: "fsdp"}[level]
    return base / train_memory(shape, Layout(dp_shard=n, dp_mode=mode), w, rank=0).state


def lora_state_bytes(rank: int = 16) -> float:
    """Trained adapter state of llama-3-70b at LoRA rank r on q, k, v, o, gate, up, down (16 B each)."""
    w = Workload(seq=1, micro_batch=1, lora_rank=rank)
    return adapter_params(preset("llama-3-70b"), rank, tuple(w.lora_targets)) * w.state_bytes().total


def min_gpus(total: float, target: float) -> int:
    return math.ceil(total / target)


def figures() -> list[Figure]:
    b16, b12 = bytes_per_param(True), bytes_per_param(False)
    ratio = checkpoint_ratio()
    ckpt_act = TEXT_ACTIVATIONS * ratio
    w = Workload(seq=1, micro_batch=1).state_bytes()
    lora = lora_state_bytes()
    lora_total = 2 * PSI + lora + ckpt_act  # frozen bf16 base + adapters' state + checkpointed activations
    z3c_12 = b12 * PSI + ckpt_act
    return [
        Figure("training state, 70B at 16 B/param", "~1.12 TB", b16 * PSI / 1e12, "TB",
               f"{w.param}+{w.grad}+{w.master}+{w.adam_m}+{w.adam_v} B per parameter x 70e9", "follows"),
        Figure("table: weights / grads / master / m / v", "140 / 140 / 280 / 280 / 280 GB",
               w.param * PSI / GB, "GB (weights; the others 140, 280, 280, 280)",
               "2, 2, 4, 4, 4 B x 70e9", "follows"),
        Figure("total with activations", "~1.22 TB", (b16 * PSI + TEXT_ACTIVATIONS) / 1e12, "TB",
               "1.12 TB + the table's ~100 GB of activations", "follows"),
        Figure("activations", "~100 GB", one_sequence_activations() / GB, "GB",
               "one 4096-token sequence of llama-3-70b in bf16 with flash/sdpa attention, no recompute (the text "
               f"gives no batch or length); Korthikanti et al.'s GPT formula at h 8192, 80 layers, no scores kept "
               f"(34 s b h per layer) gives {korthikanti_70b() / GB:.1f} GB with the fp32 log-softmax: ~100 GB "
               "follows from it, while relayrl's Llama keeps more (SwiGLU of I = 28672, the norms' outputs, sdpa's "
               "mask)", "follows under assumptions"),
        Figure("ZeRO-1 per-GPU saving", "~4x", zero_saving(1, 8), "x at N=8",
               f"(2+2+12)/(2+2+12/N): 4x only as N grows ({zero_saving(1, 64):.2f}x at N=64); the 70B rows imply "
               "N=8", "follows under assumptions"),
        Figure("ZeRO-2 per-GPU saving", "~8x", zero_saving(2, 8), "x at N=8",
               f"16/(2+14/N): 8x only as N grows ({zero_saving(2, 64):.2f}x at N=64)", "follows under assumptions"),
        Figure("ZeRO-3 per-GPU saving", "N x", zero_saving(3, 8), "x at N=8", "16/(16/N) = N", "follows"),
        Figure("no sharding", "~940 GB", (b12 * PSI + TEXT_ACTIVATIONS) / GB, "GB",
               f"12 B/param (no fp32 master) 840 GB + ~100 GB activations; the table's 16 B/param gives "
               f"{(b16 * PSI + TEXT_ACTIVATIONS) / GB:.0f} GB", "follows under assumptions"),
        Figure("ZeRO-3", "~118 GB", (b12 * PSI + TEXT_ACTIVATIONS) / 8 / GB, "GB per GPU",
               f"(840 + 100) / 8 GPUs: 12 B/param, activations split over the 8 data-parallel ranks; 16 B/param "
               f"gives {(b16 * PSI + TEXT_ACTIVATIONS) / 8 / GB:.1f}", "follows under assumptions"),
        Figure("ZeRO-3 + checkpointing", "~30 GB", z3c_12 / 32 / GB, "GB per GPU at N=32",
               f"full recompute keeps {ratio:.3f} of the activations ({ckpt_act / GB:.1f} GB); on the 8 GPUs of the "
               f"~118 GB row it is {z3c_12 / 8 / GB:.1f} GB; <= 30 GB needs N >= {min_gpus(z3c_12, 30 * GB)} "
               f"(12 B/param) or N >= {min_gpus(b16 * PSI + ckpt_act, 30 * GB)} (16 B/param)",
               "follows under assumptions"),
        Figure("ZeRO-3 + checkpointing + LoRA", "~8 GB", lora_total / 8 / GB, "GB per GPU at N=8",
               f"frozen bf16 base 140 GB + rank-16 adapters' state {lora / GB:.1f} GB + checkpointed activations, "
               f"over N GPUs: {lora_total / 32 / GB:.1f} GB at the N=32 that makes the ~30 GB row follow; ~8 GB "
               f"needs N = {min_gpus(lora_total, 8 * GB)}: no single N makes the last three rows follow together",
               "does not follow"),
    ]


def render() -> str:
    lines = ["the reading's 70B figures (distributed-rl-training.txt), recomputed:", ""]
    for f in figures():
        lines.append(f"  {f.what}: text {f.text}; computed {f.computed:.2f} {f.unit} — {f.verdict}")
        lines.append(f"      {f.assumptions}")
    return "\n".join(lines)
