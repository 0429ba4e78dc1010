"""What is trained: sequence length, micro-batch, precision, recomputation, LoRA; and the bytes each
parameter's state takes under that precision.

    bytes per trained parameter              param  grad  master  Adam m  Adam v   total
    float32                                    4     4      -       4       4      16
    bfloat16, mixed_precision (the textbook)   2     2      4       4       4      16
    bfloat16, optim_dtype=float32, no master   2     2      -       4       4      12
    bfloat16 (torch AdamW on bf16 params)      2     2      -       2       2       8

plus torch AdamW's `step`: a 0-d float32 tensor per parameter tensor (4 B each, not per element).

relayrl's trainer with `trainer.bf16: true` autocasts the forward and keeps fp32 weights, grads and
Adam state (the float32 row's 16 B, with bf16 activations); FSDP2's MixedPrecisionPolicy likewise keeps
the fp32 shard as the master. Both total 16 B per parameter, as the textbook row does; only the split
between "params" and "optim" differs.

A LoRA run trains only the adapters (r x (in + out) per target) with the full state above; the frozen
base holds its weights only, in base_dtype (no gradient, no optimizer state).

It imports relayrl.errors and relayrl.sync.adapters (the default LoRA targets) only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relayrl.errors import ConfigError
from relayrl.sync.adapters import DEFAULT_TARGETS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per element of each piece of a trained parameter's state."""

    param: int
    grad: int
    master: int
    adam_m: int
    adam_v: int

    @property
    def optim(self) -> int:
        return self.master + self.adam_m + self.adam_v

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim


@dataclass(frozen=True)
class Workload:
    seq: int
    micro_batch: int
    dtype: str = "bfloat16"  # params, grads and activations (the compute dtype)
    mixed_precision: bool = True  # with bfloat16: an fp32 master copy and fp32 Adam m, v
    recompute: str = "none"
    lora_rank: int = 0
    lora_alpha: float = 16.0  # scaling only: no effect on memory or time
    lora_targets: tuple[str, ...] = field(default=DEFAULT_TARGETS)
    base_dtype: str | None = None  # the frozen base's dtype under LoRA (default: dtype)
    num_micro_batches: int | None = None  # per optimizer step (gradient accumulation / PP); None: 8
    optim_dtype: str | None = None  # Adam m, v dtype (default: fp32 with mixed precision, else dtype)
    master_copy: bool | None = None  # keep an fp32 master copy (default: mixed precision with a 16-bit dtype)
    attention: str = "sdpa"  # sdpa / flash: no s x s scores kept; eager: the softmax output is kept

    def __post_init__(self) -> None:
        for name in ("seq", "micro_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"workload {name} must be an integer >= 1, got {v!r}")
        for name in ("dtype", "base_dtype", "optim_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPE_BYTES:
                raise ConfigError(f"workload {name} must be one of {', '.join(DTYPE_BYTES)}, got {v!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"workload recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"workload attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"workload lora_rank must be an integer >= 0, got {self.lora_rank!r}")
        if self.num_micro_batches is not None and self.num_micro_batches < 1:
            raise ConfigError(f"workload num_micro_batches must be >= 1, got {self.num_micro_batches!r}")

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def micro_batches(self, pp: int) -> int:
        """Micro-batches per optimizer step: given, or 8 for every layout (the same tokens per step per
        data-parallel rank, so layouts compare at equal work; pp only shapes the bubble)."""
        return self.num_micro_batches if self.num_micro_batches is not None else 8

    def state_bytes(self) -> StateBytes:
        """Per element of a trained tensor (the table in the module docstring)."""
        p = DTYPE_BYTES[self.dtype]
        sixteen_bit = p == 2
        mixed = self.mixed_precision and sixteen_bit
        master = self.master_copy if self.master_copy is not None else mixed
        opt = DTYPE_BYTES[self.optim_dtype] if self.optim_dtype else (4 if mixed else p)
        return StateBytes(param=p, grad=p, master=4 if master and sixteen_bit else 0, adam_m=opt, adam_v=opt)

    @property
    def frozen_bytes(self) -> int:
        """Bytes per element of the frozen base under LoRA."""
        return DTYPE_BYTES[self.base_dtype or self.dtype]

    def describe_state(self) -> str:
        sb = self.state_bytes()
        parts = [f"param {sb.param}", f"grad {sb.grad}"] + ([f"fp32 master {sb.master}"] if sb.master else []) + [
            f"Adam m {sb.adam_m}", f"Adam v {sb.adam_v}"]
        return f"{sb.total} B per trained parameter ({' + '.join(parts)})"
