"""This module says who holds what of the LoRA adapters, as boxes of their LOGICAL tensors, so the
reshard planner moves adapters exactly as it moves base weights.

Logical tensors, for each target module X (q, k, v, o, gate, up, down projections by default):

    X.lora_A [r, in]        X.lora_B [out, r]        the update is  W + scaling * B @ A

Trainer (relayrl.models.lora's contract), per TP rank, before FSDP's dim-0 chunks:

    colwise X (q, k, v, gate, up)   lora_B: the rows W's shard holds (dim 0)    lora_A: whole (replicated)
    rowwise X (o, down)             lora_A: the columns W's shard holds (dim 1) lora_B: whole (replicated)

Engine rank, per fused module (the same rows the base weight's pieces take, so no adapter is ever
assembled and then sliced):

    qkv_proj.lora_A [P*r, in]       part j's A in rows [j*r, (j+1)*r): whole, on every rank
    qkv_proj.lora_B [rows, r]       part j's B rows of THIS rank's heads (its Q heads; the KV heads its Q
                                    heads use, replicated where the engine replicates KV heads), stacked
                                    in part order — the qkv_proj.weight row layout, targeted parts only
    o_proj.lora_A   [r, cols]       A's columns of this rank's Q heads (down_proj: its columns of I)
    o_proj.lora_B   [out, r]        whole: each rank adds s * (x_local A_local^T) B^T to its partial
                                    sum, and the all-reduce sums x A^T over the ranks (linearity)

P counts the module's targeted parts (q, k, v targeted: P = 3). The engine side is relayrl.engine.lora.

It imports relayrl.models (shapes, the fusion map), relayrl.errors and the sync modules only; like all of
sync, it must never import the trainer, the engine or the controller: the controller hands it plain
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape
from relayrl.models.fusion import FUSED_PARTS
from relayrl.models.lora_config import LORA_TARGETS
from relayrl.sync.boxes import Box

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
DEFAULT_TARGETS = LORA_TARGETS  # the trainer's (relayrl.models.lora_config): q, k, v, o, gate, up, down
ROWWISE = ("o_proj", "down_proj")  # the engine splits their input columns; the rest are fused by rows


@dataclass(frozen=True)
class AdapterShape:
    """What decides the adapters' tensors: the rank r and the target modules (logical names)."""

    rank: int
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"LoRA rank must be an integer >= 1, got {self.rank!r}")
        unknown = sorted(set(self.targets) - set(DEFAULT_TARGETS))
        if unknown:
            raise ConfigError(f"LoRA target {unknown[0]!r} has no place in the engine's fused layout "
                              f"(targets: {', '.join(DEFAULT_TARGETS)})")
        if not self.targets:
            raise ConfigError("LoRA needs at least one target module")
        # one canonical order: plans are cached by this object
        object.__setattr__(self, "targets", tuple(t for t in DEFAULT_TARGETS if t in self.targets))


def _module(i: int, mod: str) -> str:
    return f"model.layers.{i}.{'self_attn' if mod in ATTN else 'mlp'}.{mod}"


def _in_out(shape: ModelShape, mod: str) -> tuple[int, int]:
    h, inter = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}[mod]


def adapter_tensors(shape: ModelShape, lora: AdapterShape) -> list[tuple[str, tuple[int, ...]]]:
    """HF-style name -> shape of every adapter tensor, layer by layer, in target order."""
    out = []
    for i in range(shape.num_hidden_layers):
        for mod in lora.targets:
            fan_in, fan_out = _in_out(shape, mod)
            name = _module(i, mod)
            out += [(name + ".lora_A", (lora.rank, fan_in)), (name + ".lora_B", (fan_out, lora.rank))]
    return out


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def adapter_shard_dim(name: str, weight_dim: int | None) -> int | None:
    """The trainer's TP shard dim of an adapter, from its module's weight's (`weight_dim`): B follows
    a colwise weight's rows, A a rowwise weight's columns; the other one is replicated."""
    if name.endswith(".lora_B"):
        return 0 if weight_dim == 0 else None
    return 1 if weight_dim == 1 else None


def fused_parts(lora: AdapterShape, fused: str) -> tuple[str, ...]:
    """The targeted parts of an engine fused module, in fusion order (its A's row blocks)."""
    return tuple(p for p in FUSED_PARTS[fused] if p in lora.targets)


def engine_adapter_pieces(shape: ModelShape, lora: AdapterShape, fused_rows: dict[str, tuple[int, int, int]],
                          split_cols: dict[str, tuple[int, int]]):
    """(engine param, logical name, box, dst offset) of every adapter piece of one engine rank, from the
    rank's base layout: `fused_rows[part] = (r0, r1, at)` (the part's logical rows, where they land in
    the fused weight) and `split_cols[mod] = (c0, c1)` (its input columns)."""
    r = lora.rank
    for i in range(shape.num_hidden_layers):
        for fused in FUSED_PARTS:
            parts = fused_parts(lora, fused)
            dst = f"layers.{i}.{'self_attn' if fused == 'qkv_proj' else 'mlp'}.{fused}"
            b_at = 0
            for j, part in enumerate(parts):
                name = _module(i, part)
                fan_in, _ = _in_out(shape, part)
                r0, r1, _ = fused_rows[part]
                yield dst + ".lora_A", name + ".lora_A", Box(0, r, 0, fan_in), (j * r, 0)
                yield dst + ".lora_B", name + ".lora_B", Box(r0, r1, 0, r), (b_at, 0)
                b_at += r1 - r0
        for mod in ROWWISE:
            if mod not in lora.targets:
                continue
            name = _module(i, mod)
            dst = name.removeprefix("model.")
            _, fan_out = _in_out(shape, mod)
            yield dst + ".lora_A", name + ".lora_A", Box(0, r, *split_cols[mod]), (0, 0)
            yield dst + ".lora_B", name + ".lora_B", Box(0, fan_out, 0, r), (0, 0)
