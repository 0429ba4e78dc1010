"""This module lays out an MoE model's routers and experts for the reshard plan: their logical tensors (the published
checkpoint names) and the engine's stacked expert parameters as boxes of them.

Logical tensors of MoE layer i (block = `mlp`, Mixtral's `block_sparse_moe`; Mixtral's projections w1 / w3 / w2):

    model.layers.i.block.gate.weight                        [E, h]       the router
    model.layers.i.block.experts.{j}.{gate,up}_proj.weight  [I, h]       j = 0 .. E-1
    model.layers.i.block.experts.{j}.down_proj.weight       [h, I]
    model.layers.i.mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate.weight [1, h]   (Qwen2-MoE)

The trainer holds them as it holds any other tensor (relayrl.sync.layout): its TP plan names no MoE module, so they
are whole on every TP rank, and FSDP cuts each along dim 0. With expert parallelism (TrainerLayout.ep > 1,
relayrl.parallel.expert_parallel; tp 1) the dp_shard ranks s split into (efsdp, ep), ep innermost: rank s holds
experts [(s % ep) E/ep, (s % ep + 1) E/ep) only, each FSDP-cut along dim 0 over the dp_shard / ep ranks holding the
same experts (chunk s // ep); routers and the shared expert stay FSDP-sharded over the whole dp_shard group.

Engine rank r of tp (relayrl.engine.moe, mirrored here as data: sync never imports the engine), w = I / tp under the
"tp" placement (each expert's rows r w ... of gate / up, columns of down) and w = I under "ep" (experts
[r E/tp, (r+1) E/tp) whole). The stacked parameters are planned as their 2-D views (the boxes are 2-D; the engine's
ModelRunner.params hands the sync the same views):

    layers.i.block.experts.gate_up_proj  [E_local * 2w, h]   local expert e: gate box at row e 2w, up box at e 2w + w
    layers.i.block.experts.down_proj     [E_local * h, w]    local expert e: down box (its columns) at row e h
    layers.i.block.gate.weight, mlp.shared_expert_gate.weight   whole
    layers.i.mlp.shared_expert.gate_up_proj.weight / down_proj.weight   TP-sharded like a dense MLP of width I_s

A model shape with experts (`sync_shape`) is an MoESyncShape: the MoEShape plus whether the checkpoint uses
Mixtral's names, the one thing an MoEShape alone does not say.

It imports relayrl.models (shapes), relayrl.errors and the sync boxes only; like all of sync, it must never import
the trainer, the engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape
from relayrl.models.moe import EXPERT_PLACEMENTS, expert_split_problem
from relayrl.sync.boxes import Box

PLACEMENTS = EXPERT_PLACEMENTS


@dataclass(kw_only=True, unsafe_hash=True)
class MoESyncShape(MoEShape):
    """An MoEShape and its checkpoint's naming (hashable: plans are cached by it)."""

    mixtral: bool = False  # block_sparse_moe.experts.{j}.w1 / w3 / w2 instead of mlp.experts.{j}.*_proj


def sync_shape(cfg: ModelShape) -> ModelShape:
    """What the plan is keyed by: an MoESyncShape for a model with experts (an MoEConfig, an MoEShape: Qwen names
    unless it says mixtral), the ModelShape otherwise."""
    if not isinstance(cfg, MoEShape):
        return ModelShape.of(cfg)
    if isinstance(cfg, MoESyncShape):
        return cfg
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(MoEShape)}
    return MoESyncShape(**fields, mixtral=getattr(cfg, "model_type", None) == "mixtral")


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """j of a routed expert's tensor 'model.layers.i.mlp.experts.{j}.up_proj.weight'; None for any other."""
    m = _EXPERT.search(name)
    return None if m is None else int(m.group(1))


def is_moe_layer(shape: ModelShape, layer: int) -> bool:
    return isinstance(shape, MoEShape) and shape.is_moe_layer(layer)


def _names(shape: MoESyncShape) -> tuple[str, tuple[str, str, str]]:
    """(block, (gate, up, down) projection names) of the family's checkpoints."""
    if shape.mixtral:
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


def moe_tensors(shape: MoESyncShape, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """The logical tensors of MoE layer `layer`, in checkpoint order."""
    h, inter, s = shape.hidden_size, shape.moe_intermediate_size, shape.shared_expert_intermediate_size
    block, (gate, up, down) = _names(shape)
    p = f"model.layers.{layer}.{block}."
    out = [(p + "gate.weight", (shape.num_experts, h))]
    for j in range(shape.num_experts):
        out += [(p + f"experts.{j}.{gate}.weight", (inter, h)), (p + f"experts.{j}.{up}.weight", (inter, h)),
                (p + f"experts.{j}.{down}.weight", (h, inter))]
    if s:
        out += [(p + "shared_expert.gate_proj.weight", (s, h)), (p + "shared_expert.up_proj.weight", (s, h)),
                (p + "shared_expert.down_proj.weight", (h, s)), (p + "shared_expert_gate.weight", (1, h))]
    return out


def check_engine_experts(shape: ModelShape, tp: int, placement: str) -> None:
    """Refuse an engine layout the experts cannot be split by (relayrl.engine.moe.check_expert_placement)."""
    if placement not in PLACEMENTS:
        raise ConfigError(f"engine layout expert_placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if (what := expert_split_problem(shape, tp, placement)) is not None:
        raise ConfigError(f"engine tensor parallel degree {tp} does not divide {what}")


def engine_moe_pieces(shape: MoESyncShape, tp: int, placement: str, rank: int,
                      layer: int) -> list[tuple[str, str, Box, tuple[int, ...]]]:
    """(engine parameter, logical tensor, box of it, destination offset) of every piece of MoE layer `layer` on
    engine rank `rank` (module docstring)."""
    h, inter, E = shape.hidden_size, shape.moe_intermediate_size, shape.num_experts
    block, (gate, up, down) = _names(shape)
    src, dst = f"model.layers.{layer}.{block}.", f"layers.{layer}.{block}."
    if placement == "ep":
        per = E // tp
        experts, rows = range(rank * per, (rank + 1) * per), (0, inter)
    else:
        experts, rows = range(E), (rank * inter // tp, (rank + 1) * inter // tp)
    w = rows[1] - rows[0]
    out = [(dst + "gate.weight", src + "gate.weight", Box.full((E, h)), (0, 0))]
    for e, j in enumerate(experts):
        x = f"{src}experts.{j}."
        out += [(dst + "experts.gate_up_proj", x + f"{gate}.weight", Box(*rows, 0, h), (e * 2 * w, 0)),
                (dst + "experts.gate_up_proj", x + f"{up}.weight", Box(*rows, 0, h), (e * 2 * w + w, 0)),
                (dst + "experts.down_proj", x + f"{down}.weight", Box(0, h, *rows), (e * h, 0))]
    s = shape.shared_expert_intermediate_size
    if s:
        r0, r1 = rank * s // tp, (rank + 1) * s // tp
        se, de = src + "shared_expert.", dst + "shared_expert."
        out += [(de + "gate_up_proj.weight", se + "gate_proj.weight", Box(r0, r1, 0, h), (0, 0)),
                (de + "gate_up_proj.weight", se + "up_proj.weight", Box(r0, r1, 0, h), (r1 - r0, 0)),
                (de + "down_proj.weight", se + "down_proj.weight", Box(0, h, r0, r1), (0, 0)),
                (dst + "shared_expert_gate.weight", src + "shared_expert_gate.weight", Box.full((1, h)), (0, 0))]
    return out
