"""Per-rank training memory: parameters, gradients and optimizer state counted tensor by tensor,
activations and transient buffers from relayrl.planner.activations.

Which tensors a rank holds (pp rank q, TP rank t): the model's logical tensors
(relayrl.sync.layout.logical_tensors, tied embeddings counted once) of the decoder layers of every stage q
holds (layout.rank_stages: one, or two under the interleaved and V schedules, each stage's layers
relayrl.models.stage's even split of the layers over pp x stages-per-rank stages), the embedding with stage
0, the final norm and lm_head with the last (a tied embedding is then held on both: the last stage keeps its
own copy for the lm_head, so a V schedule's rank 0, which holds both, holds it twice), each as its TP-local block
(relayrl.sync.layout.trainer_holdings: the trainer's TP plan; norms, o_proj / down_proj biases
replicated). Then, per tensor of TP-local shape [d0, ...] (rest = the other dims' product), over the
shard group of n = dp_shard x cp ranks, shard index k:

    chunk(k) = rows [min(k c, d0), min((k+1) c, d0)) x rest,   c = ceil(d0 / n)   (torch.chunk)
    padded   = c x rest                                          (the same on every shard rank)

    dp_mode   params           grads            optimizer (master + m + v)        + AdamW step
    ddp       d0*rest * P      d0*rest * G      d0*rest * O                        4 B per tensor
    zero1     d0*rest * P      d0*rest * G      chunk * O
    zero2     d0*rest * P      chunk * G        chunk * O
    fsdp      padded * P       padded * G       chunk * O

Why fsdp's params and grads are `padded`: measured on torch 2.13 (FSDP2, gloo, 2 and 3 ranks, and
2x2 HSDP / FSDP x TP): each sharded parameter's local storage is a padded chunk of c rows, even on a
rank whose chunk is shorter or empty, and the gradients of one fully_shard group live in one
reduce-scatter buffer of the group's padded size; AdamW's exp_avg / exp_avg_sq are exact-size
(zeros_like of the local shard; none for an empty chunk) and every parameter gets its own 0-d float32
`step`. Under DDP (relayrl's replicate, gradient_as_bucket_view) the gradients are views into the
buckets: d0*rest each in total. These are the storage bytes benchmarks/bench_trainer.py's
`_held_bytes` counts, so for relayrl's float32 layouts (single, DDP, FSDP, HSDP, TP, TP x FSDP)
params / grads / optim are exact.

An MoE model (relayrl.planner.moe) holds, per layer, the router and its EP rank's num_experts / ep experts in
the dense MLP's place; under ep > 1 an expert tensor is chunked over the n / ep ranks holding the same experts
(index k // ep), every other tensor over all n.

A frozen tensor (the LoRA base) holds params only, in the base dtype, sharded as the mode shards
params. ZeRO-1/2 are counted per tensor like FSDP's chunks (DeepSpeed's flat partition differs by
under one row per tensor).

It imports the planner's modules, relayrl.models.config and relayrl.sync (layouts, adapters) only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape
from relayrl.planner.layout import Layout
from relayrl.planner.moe import is_expert_tensor, moe_layer_tensors, plan_shape
from relayrl.planner.workload import Workload
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.layout import TrainerLayout, trainer_holdings

STEP_BYTES = 4  # torch AdamW's per-parameter `step`: torch.tensor(0.0, dtype=float32)


@dataclass
class TrainMemory:
    """Bytes per rank. `terms`: (name, bytes, explanation) — every number the totals add up."""

    rank: int | None
    params: int
    grads: int
    optim: int
    activations: int
    transient: int
    total: int = 0
    terms: list[tuple[str, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.total = self.params + self.grads + self.optim + self.activations + self.transient

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optim


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Decoder layers of pipeline stage `stage`: even split, the first (num_layers % pp) stages one more."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def adapter_shape(shape: ModelShape, workload: Workload) -> AdapterShape | None:
    return AdapterShape(workload.lora_rank, tuple(workload.lora_targets)) if workload.lora_rank else None


@lru_cache(maxsize=256)
def tp_local_tensors(shape: ModelShape, tp: int, t: int,
                     lora: AdapterShape | None) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, TP-local shape) of every logical tensor (adapters included) on TP rank t."""
    held = trainer_holdings(shape, TrainerLayout(tp=tp), t, lora)
    return tuple((name, hs[0].box.shape) for name, hs in held.items())


def _layer_index(name: str) -> int | None:
    if name.startswith("model.layers."):
        return int(name.split(".")[2])
    return None


def rank_layers(num_layers: int, layout: Layout, pp_rank: int) -> list[int]:
    """Decoder layers pp rank `pp_rank` holds: those of every stage it holds (layout.rank_stages), in that order."""
    return [i for st in layout.rank_stages(pp_rank) for i in stage_layers(num_layers, layout.num_stages, st)]


def _pipe(layout: Layout) -> tuple[int, str]:
    """(pp, schedule) as the cached tables key them: the schedule only matters when there is a pipeline."""
    return layout.pp, layout.pp_schedule if layout.pp > 1 else "1f1b"


def stage_tensors(shape: ModelShape, layout: Layout, workload: Workload, stage: int, t: int):
    """(name, TP-local shape, trained) of what pp rank `stage` (layout.coords' 'stage'), TP rank t holds: the
    tensors of every pipeline stage it holds."""
    return _stage_tensors(shape, layout.tp, _pipe(layout), layout.ep, adapter_shape(shape, workload), stage, t)


@lru_cache(maxsize=1024)
def _stage_tensors(shape: ModelShape, tp: int, pipe: tuple[int, str], ep: int, lora: AdapterShape | None,
                   stage: int, t: int):
    pp, schedule = pipe
    lay = Layout(pp=pp, pp_schedule=schedule)
    if lay.num_stages > shape.num_hidden_layers:
        raise ConfigError(f"pp={pp} with {schedule} makes {lay.num_stages} pipeline stages, more than the model's "
                          f"{shape.num_hidden_layers} layers")
    moe = isinstance(shape, MoEShape)
    if ep > 1 and not moe:
        raise ConfigError(f"ep={ep}: this model is dense (no experts to shard); use ep=1")
    if moe and lora is not None:
        raise ConfigError("LoRA on an MoE model is not planned (per-expert adapters): plan it without --lora-rank")
    stages = lay.rank_stages(stage)
    layers = set(rank_layers(shape.num_hidden_layers, lay, stage))
    first, last = 0 in stages, lay.num_stages - 1 in stages
    out = []
    # an MoE model's attention, norms and embeddings are the dense model's; its (unused) dense MLP width need
    # not divide by tp, so the dense tensors come from the shape with the experts' width
    dense = dataclasses.replace(ModelShape.of(shape), intermediate_size=shape.moe_intermediate_size) if moe else shape
    for name, shp in tp_local_tensors(dense, tp, t, lora):
        i = _layer_index(name)
        if moe and i is not None and ".mlp." in name:
            continue  # the dense MLP's place is taken by the router and experts below
        if i is not None:
            copies = int(i in layers)
        elif name == "model.embed_tokens.weight":  # the first stage's, and the last stage's lm_head copy if tied
            copies = int(first) + int(last and shape.tie_word_embeddings and lay.num_stages > 1)
        else:  # model.norm.weight, lm_head.weight
            copies = int(last)
        trained = lora is None or ".lora_" in name
        out += [(name, shp, trained)] * copies
    if moe:  # EP rank 0's experts: every EP rank holds as many, of the same shapes
        out += [(name, shp, True) for i in sorted(layers) for name, shp in moe_layer_tensors(shape, i, tp, ep, 0)]
    return tuple(out)


def stage_groups(shape: ModelShape, layout: Layout, workload: Workload, stage: int, t: int):
    """stage_tensors grouped: ((TP-local shape, trained), count) — what the per-rank arithmetic needs,
    without walking every layer's tensors again for each layout."""
    return _stage_groups(shape, layout.tp, _pipe(layout), layout.ep, adapter_shape(shape, workload), stage, t)


@lru_cache(maxsize=1024)
def _stage_groups(shape, tp, pipe, ep, lora, stage, t):
    """((shape, trained, expert), count): expert tensors are sharded over the expert FSDP group only."""
    counts: dict[tuple[tuple[int, ...], bool, bool], int] = {}
    for name, shp, trained in _stage_tensors(shape, tp, pipe, ep, lora, stage, t):
        key = (shp, trained, ep > 1 and is_expert_tensor(name))
        counts[key] = counts.get(key, 0) + 1
    return tuple(counts.items())


def stage_summary(shape: ModelShape, layout: Layout, workload: Workload, stage: int):
    """[all, trained] TP-local elements of: the whole stage, its largest decoder layer, the non-layer
    tensors (embedding, norm, lm_head), and the stage's experts (under ep > 1; sharded over the expert FSDP
    group, not the whole shard group) — for FSDP's gathers and the collectives' sizes."""
    return _stage_summary(shape, layout.tp, _pipe(layout), layout.ep, adapter_shape(shape, workload), stage)


@lru_cache(maxsize=1024)
def _stage_summary(shape, tp, pipe, ep, lora, stage):
    whole, root, experts = [0, 0], [0, 0], [0, 0]
    per_layer: dict[int, list[int]] = {}
    for name, shp, trained in _stage_tensors(shape, tp, pipe, ep, lora, stage, 0):
        n = _numel(shp)
        i = _layer_index(name)
        accs = [whole, root if i is None else per_layer.setdefault(i, [0, 0])]
        if ep > 1 and is_expert_tensor(name):
            accs.append(experts)
        for acc in accs:
            acc[0] += n
            acc[1] += n if trained else 0
    big = max(per_layer.values(), default=[0, 0], key=lambda x: x[0])
    return tuple(whole), tuple(big), tuple(root), tuple(experts)


def _numel(shp: tuple[int, ...]) -> int:
    n = 1
    for d in shp:
        n *= d
    return n


def state_memory(shape: ModelShape, layout: Layout, workload: Workload, rank: int) -> list[tuple[str, int, str]]:
    """The params / grads / optim terms of one rank (table in the module docstring)."""
    co = layout.coords(rank)
    n_all = layout.shard_group
    k_all = co["shard"] * layout.cp + co["c"] if n_all > 1 else 0
    sb = workload.state_bytes()
    mode = layout.dp_mode
    acc = dict(p_train=0, p_frozen=0, g=0, master=0, m=0, v=0, steps=0, n_train=0, n_frozen=0)
    for (shp, trained, expert), count in stage_groups(shape, layout, workload, co["stage"], co["t"]):
        # experts: the group's ep innermost ranks hold different experts; the n / ep that hold the same shard them
        n, k = (n_all // layout.ep, k_all // layout.ep) if expert else (n_all, k_all)
        d0, rest = shp[0], _numel(shp[1:])
        full = d0 * rest * count
        c = _cdiv(d0, n)
        chunk = (min((k + 1) * c, d0) - min(k * c, d0)) * rest * count
        padded = c * rest * count
        held_param = padded if mode == "fsdp" else full
        if not trained:
            acc["p_frozen"] += held_param * workload.frozen_bytes
            acc["n_frozen"] += full
            continue
        acc["n_train"] += full
        acc["p_train"] += held_param * sb.param
        acc["g"] += {"ddp": full, "zero1": full, "zero2": chunk, "fsdp": padded}[mode] * sb.grad
        opt_elems = full if mode == "ddp" else chunk
        acc["master"] += opt_elems * sb.master
        acc["m"] += opt_elems * sb.adam_m
        acc["v"] += opt_elems * sb.adam_v
        acc["steps"] += STEP_BYTES * count
    n = n_all
    how = {"ddp": "whole on every rank",
           "zero1": f"params and grads whole, optimizer state in 1/{n} chunks",
           "zero2": f"params whole, grads and optimizer state in 1/{n} chunks",
           "fsdp": f"params and grads in padded 1/{n} chunks (FSDP2 storage), optimizer state exact chunks"}[mode]
    if layout.ep > 1:
        how += (f"; experts: {shape.num_experts // layout.ep} of {shape.num_experts} per EP rank (ep {layout.ep}), "
                f"sharded the same way over the {n // layout.ep} ranks that hold the same experts")
    terms = [("params (trained)", acc["p_train"],
              f"{acc['n_train']:,} TP-local elements on this stage x {sb.param} B, {how}")]
    if acc["n_frozen"]:
        terms.append(("params (frozen base)", acc["p_frozen"],
                      f"{acc['n_frozen']:,} elements x {workload.frozen_bytes} B, no grads, no optimizer state"))
    terms.append(("grads", acc["g"], f"{sb.grad} B per trained element"))
    if sb.master:
        terms.append(("optim: fp32 master copy", acc["master"], f"{sb.master} B per trained element held"))
    terms += [("optim: Adam m", acc["m"], f"{sb.adam_m} B per trained element held"),
              ("optim: Adam v", acc["v"], f"{sb.adam_v} B per trained element held"),
              ("optim: AdamW step", acc["steps"], f"a 0-d float32 tensor per trained tensor ({STEP_BYTES} B each)")]
    return terms


def train_memory(shape: ModelShape, layout: Layout, workload: Workload, rank: int | None = None) -> TrainMemory:
    """Bytes held by `rank` (None: the rank with the largest total — shard 0 of some pipeline stage)."""
    from relayrl.planner.activations import activation_terms, transient_terms

    shape = plan_shape(shape)
    layout.check_schedule(workload.micro_batches(layout.pp), shape.num_hidden_layers)
    if rank is None:
        candidates = [layout.rank_of(stage=s) for s in range(layout.pp)]
        return max((train_memory(shape, layout, workload, r) for r in candidates), key=lambda m: m.total)
    terms = state_memory(shape, layout, workload, rank)
    stage = layout.coords(rank)["stage"]
    act = activation_terms(shape, layout, workload, stage)
    trans = transient_terms(shape, layout, workload, stage)

    def total(prefix: str) -> int:
        return sum(b for name, b, _ in terms if name.startswith(prefix))

    return TrainMemory(rank=rank, params=total("params"), grads=total("grads"), optim=total("optim"),
                       activations=sum(b for _, b, _ in act), transient=sum(b for _, b, _ in trans),
                       terms=terms + [("act: " + n, b, e) for n, b, e in act] +
                       [("transient: " + n, b, e) for n, b, e in trans])
