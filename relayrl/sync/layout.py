"""This module says who holds what: the trainer's and the engine's layouts as data, in boxes of the
LOGICAL (Hugging Face) tensors.

Trainer rank (mesh (pp, dp_replicate, dp_shard, tp), tp fastest — relayrl.parallel.dims.ParallelDims):

    rank = ((stage_rank * dp_replicate + replica) * dp_shard + shard) * tp + t

    0. PP (pp > 1): pp rank q holds only its stages' tensors (relayrl.parallel.pipeline_stages for which stages,
       relayrl.models.stage for which layers: embed_tokens on the first stage, norm and lm_head on the last; a
       tied model's lm_head copy on the last stage is not listed, its embed_tokens is the one source).

    1. TP (relayrl.parallel.tensor_parallel.TP_PLAN / WEIGHT_SHARD_DIM): a weight whose style shards
       dim d is split in tp equal blocks along d (colwise, vocab_*: rows; rowwise: columns); a bias
       follows its weight's output rows when the weight shards dim 0 (ColwiseParallel), and is
       replicated otherwise (RowwiseParallel); norms are replicated.
    2. FSDP2 (fully_shard): the TP-LOCAL tensor is cut along dim 0 exactly like torch.chunk — chunks
       of ceil(n / dp_shard) rows, so the last non-empty one may be shorter and trailing ones empty
       (torch's _chunk_with_empty). Shard s holds local rows [min(s*c, n), min((s+1)*c, n)).
       HSDP replicas (dp_replicate) hold identical shards.
    3. EP (ep > 1, tp 1): a routed expert's tensors are held only by the dp_shard ranks s with s % ep its ep rank,
       FSDP-cut over the dp_shard / ep of them (chunk s // ep) — relayrl.sync.experts.

    A trainer rank's local tensor (DTensor.to_local() of the FSDP parameter) IS its one box.

Engine rank r of tp (relayrl.engine.model, mirrored here as data — sync never imports the engine):

    qkv_proj  = [ q_proj rows of its Q heads | k_proj rows of its KV heads | v_proj rows of them ]
    gate_up   = [ gate_proj rows r*I/tp ... | up_proj rows r*I/tp ... ]
    o_proj    = q_proj's Q-head columns of o_proj;  down_proj = columns r*I/tp ...
    biases of o_proj / down_proj, embeddings, lm_head, norms: whole (replicated)

    KV heads: tp <= Hkv: rank r holds [r*Hkv/tp, (r+1)*Hkv/tp); tp > Hkv: the one head r*Hkv // tp
    its Q heads use (the same KV head sits on tp/Hkv ranks).

MoE models: routers and experts are logical tensors too, laid out by relayrl.sync.experts (the trainer holds them
like any replicated-over-TP tensor; the engine stacks each layer's experts, placed by TP or EP); every function
below keys its cache by `sync_shape(cfg)`, which keeps what an MoE config says of them.

LoRA adapters (`lora`, an AdapterShape) are logical tensors too, laid out by relayrl.sync.adapters; every
function below takes `lora` (adapters added) and `base` (False: the adapters alone, what a sync sends
once the engine holds the frozen base).

It imports relayrl.models (shapes), relayrl.parallel, relayrl.errors and the sync modules only; like all
of sync, it must never import the trainer, the engine or the controller: the controller hands it plain
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from functools import lru_cache

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape
from relayrl.models.fusion import FUSED_INTO
from relayrl.models.stage import stage_layers
from relayrl.parallel.pipeline_stages import check_schedule, schedule_stages
from relayrl.parallel.tensor_parallel import WEIGHT_SHARD_DIM, check_tp_divisibility, tp_plan
from relayrl.sync.adapters import AdapterShape, adapter_shard_dim, adapter_tensors, engine_adapter_pieces, is_adapter
from relayrl.sync.boxes import Box
from relayrl.sync.experts import (
    PLACEMENTS,
    check_engine_experts,
    engine_moe_pieces,
    expert_index,
    is_moe_layer,
    moe_tensors,
    sync_shape,
)

# logical (HF) module -> (engine module, which part of the fused tensor, in order)
ENGINE_FUSION = FUSED_INTO


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's parallel degrees. dp_replicate > 1 (HSDP) gives more holders of the same box; pp > 1 splits
    the tensors over pipeline ranks (pp outermost), each holding its stages' layers under pp_schedule's placement."""

    tp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    sequence_parallel: bool = False  # changes activations only; weight placements are the same
    pp: int = 1
    pp_schedule: str = "1f1b"
    ep: int = 1  # expert parallel, borrowed from dp_shard (relayrl.parallel.dims): experts split over ep ranks

    def __post_init__(self) -> None:
        for name in ("tp", "dp_shard", "dp_replicate", "pp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"trainer layout {name} must be an integer >= 1, got {v!r}")
        check_schedule(self.pp_schedule)
        if self.dp_shard % self.ep:
            raise ConfigError(f"trainer layout ep={self.ep} must divide dp_shard={self.dp_shard} (ep borrows it)")
        if self.ep > 1 and self.tp > 1:
            raise ConfigError(f"trainer layout ep={self.ep} with tp={self.tp}: experts are not tensor-parallel "
                              "under ep (relayrl.parallel.dims); set tp=1 or ep=1")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, shard, tp rank) of a global trainer rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"trainer rank {rank} out of range for world size {self.world_size}")
        return rank // (self.dp_shard * self.tp) % self.dp_replicate, rank // self.tp % self.dp_shard, rank % self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp_replicate * self.dp_shard * self.tp)


def _stage_holds(name: str, layers: set[int], first: bool, last: bool) -> bool:
    """Whether a pipeline rank holding `layers` (and the first / last stage or not) holds logical tensor `name`
    (relayrl.models.stage: embed_tokens on the first stage, norm and lm_head on the last)."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layers
    if name.startswith("model.embed_tokens."):
        return first
    return last


@dataclass(frozen=True)
class EngineLayout:
    """One engine replica's tensor-parallel degree (replicas of the engine each get the same plan), and where an
    MoE model's experts sit over its ranks (the engine's expert_placement: "tp" or "ep", relayrl.sync.experts)."""

    tp: int = 1
    expert_placement: str = "tp"

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"engine layout tp must be an integer >= 1, got {self.tp!r}")
        if self.expert_placement not in PLACEMENTS:
            raise ConfigError(f"engine layout expert_placement must be one of {', '.join(PLACEMENTS)}, "
                              f"got {self.expert_placement!r}")

    @property
    def world_size(self) -> int:
        return self.tp


@dataclass(frozen=True)
class Holding:
    """A trainer rank's piece of one logical tensor: `box` in logical coordinates, stored in the
    rank's local tensor of `local_shape` starting at `local_offset`."""

    box: Box
    local_offset: tuple[int, ...]
    local_shape: tuple[int, ...]


@dataclass(frozen=True)
class EnginePiece:
    """One component of an engine parameter: `box` of logical tensor `name`, written at `dst_offset`."""

    name: str
    box: Box
    dst_offset: tuple[int, ...]


# ---------------------------------------------------------------------------- logical tensors
@lru_cache(maxsize=64)
def _logical(shape: ModelShape) -> tuple[tuple[str, tuple[int, ...]], ...]:
    s = shape
    h, hd, inter = s.hidden_size, s.head_dim, s.intermediate_size
    q, kv = s.num_attention_heads * hd, s.num_key_value_heads * hd
    out = [("model.embed_tokens.weight", (s.vocab_size, h))]
    for i in range(s.num_hidden_layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,)))
        for mod, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((p + f"self_attn.{mod}.weight", (rows, h)))
            if s.qkv_bias:
                out.append((p + f"self_attn.{mod}.bias", (rows,)))
        out.append((p + "self_attn.o_proj.weight", (h, q)))
        if s.o_bias:
            out.append((p + "self_attn.o_proj.bias", (h,)))
        if s.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out.append((p + "post_attention_layernorm.weight", (h,)))
        if is_moe_layer(s, i):  # router and experts in the MLP's place
            out += moe_tensors(s, i)
            continue
        for mod, shp in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            out.append((p + f"mlp.{mod}.weight", shp))
            if s.mlp_bias:
                out.append((p + f"mlp.{mod}.bias", shp[:1]))
    out.append(("model.norm.weight", (h,)))
    if not s.tie_word_embeddings:  # tied: lm_head.weight IS embed_tokens.weight, not a tensor of its own
        out.append(("lm_head.weight", (s.vocab_size, h)))
    return tuple(out)


@lru_cache(maxsize=64)
def _tensors(shape: ModelShape, lora: AdapterShape | None, base: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
    if not base and lora is None:
        raise ValueError("a sync without the base weights sends adapters: it needs a LoRA shape")
    if lora is not None and isinstance(shape, MoEShape):
        raise ConfigError("LoRA adapters on an MoE model are not planned yet: sync the full weights")
    return (_logical(shape) if base else ()) + (tuple(adapter_tensors(shape, lora)) if lora else ())


def logical_tensors(cfg: ModelShape, lora: AdapterShape | None = None, base: bool = True) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor of the checkpoint (what a sync must deliver), with the
    adapters' when `lora` is given (only theirs when `base` is False)."""
    return dict(_tensors(sync_shape(cfg), lora, base))


# ---------------------------------------------------------------------------- trainer
def trainer_shard_dim(name: str, sequence_parallel: bool = False) -> int | None:
    """Which dim of logical tensor `name` the trainer's TP plan shards (None: replicated over TP)."""
    module, kind = name.rsplit(".", 1)
    if is_adapter(name):
        return adapter_shard_dim(name, trainer_shard_dim(module + ".weight", sequence_parallel))
    styles = [style for pattern, style in tp_plan(sequence_parallel).items() if fnmatch(module, pattern)]
    if not styles:
        return None
    dim = WEIGHT_SHARD_DIM[styles[0]]
    if kind == "bias":  # ColwiseParallel shards the bias with the output rows; RowwiseParallel replicates it
        return 0 if dim == 0 else None
    return dim


def _tp_box(full: Box, dim: int | None, tp: int, t: int, name: str) -> Box:
    if dim is None:
        return full
    n = full.shape[dim]
    if n % tp:
        raise ConfigError(f"trainer tensor parallel degree {tp} does not divide dim {dim} ({n}) of {name}")
    b = n // tp
    return full.with_rows(t * b, (t + 1) * b) if dim == 0 else full.with_cols(t * b, (t + 1) * b)


def _fsdp_box(tp_box: Box, dp_shard: int, s: int) -> Box:
    """torch.chunk along dim 0 of the TP-local block: ceil-sized chunks, trailing ones short or empty."""
    n = tp_box.r1 - tp_box.r0
    c = -(-n // dp_shard)
    return tp_box.with_rows(tp_box.r0 + min(s * c, n), tp_box.r0 + min((s + 1) * c, n))


@lru_cache(maxsize=1024)
def _trainer(shape: ModelShape, layout: TrainerLayout, rank: int, lora: AdapterShape | None,
             base: bool) -> tuple[tuple[str, Holding], ...]:
    check_tp_divisibility(shape, layout.tp)
    _, s, t = layout.coords(rank)
    stages, num_stages = schedule_stages(layout.pp_schedule, layout.pp_rank(rank), layout.pp)
    if num_stages > shape.num_hidden_layers:
        raise ConfigError(f"{num_stages} pipeline stages for {shape.num_hidden_layers} decoder layers")
    layers = {i for st in stages for i in stage_layers(shape.num_hidden_layers, num_stages, st)}
    first, last = 0 in stages, num_stages - 1 in stages
    ep = layout.ep
    if ep > 1 and (not isinstance(shape, MoEShape) or shape.num_experts % ep):
        raise ConfigError(f"trainer layout ep={ep} needs an MoE model whose num_experts it divides")
    out = []
    for name, shp in _tensors(shape, lora, base):
        if layout.pp > 1 and not _stage_holds(name, layers, first, last):
            continue
        full = Box.full(shp)
        j = expert_index(name) if ep > 1 else None
        if j is not None:  # a routed expert under EP: on its ep rank's ranks only, FSDP-cut over those
            if j // (shape.num_experts // ep) != s % ep:
                continue
            box = _fsdp_box(full, layout.dp_shard // ep, s // ep)
        else:
            box = _fsdp_box(_tp_box(full, trainer_shard_dim(name, layout.sequence_parallel), layout.tp, t, name),
                            layout.dp_shard, s)
        out.append((name, Holding(box, (0,) * len(shp), box.shape)))
    return tuple(out)


def trainer_holdings(cfg: ModelShape, layout: TrainerLayout, rank: int, lora: AdapterShape | None = None,
                     base: bool = True) -> dict[str, list[Holding]]:
    """HF name -> what trainer `rank` holds of it (one box, possibly empty: FSDP's trailing chunks); a routed
    expert another ep rank holds is absent."""
    return {name: [h] for name, h in _trainer(sync_shape(cfg), layout, rank, lora, base)}


# ---------------------------------------------------------------------------- engine
def engine_heads(num_heads: int, num_kv_heads: int, tp: int, rank: int) -> tuple[range, range]:
    """(Q heads, KV heads) of engine TP rank `rank` — relayrl.engine.parallel_state.head_layout."""
    if num_heads % tp:
        raise ConfigError(f"engine tensor parallel degree {tp} must divide the number of attention heads ({num_heads})")
    if not (num_kv_heads % tp == 0 or tp % num_kv_heads == 0):
        raise ConfigError(f"engine tensor parallel degree {tp} and the number of KV heads ({num_kv_heads}) "
                          "must divide one another")
    q_per = num_heads // tp
    q = range(rank * q_per, (rank + 1) * q_per)
    if tp <= num_kv_heads:
        kv_per = num_kv_heads // tp
        return q, range(rank * kv_per, (rank + 1) * kv_per)
    kv = rank * num_kv_heads // tp
    return q, range(kv, kv + 1)


def engine_param_name(hf_name: str) -> str:
    """'model.layers.0.self_attn.k_proj.weight' -> 'layers.0.self_attn.qkv_proj.weight'."""
    parts = hf_name.removeprefix("model.").split(".")
    if len(parts) >= 2 and parts[-2] in ENGINE_FUSION:
        parts[-2] = ENGINE_FUSION[parts[-2]][0]
    return ".".join(parts)


@lru_cache(maxsize=256)
def _engine(shape: ModelShape, layout: EngineLayout, rank: int, lora: AdapterShape | None,
            base: bool) -> tuple[tuple[str, tuple[EnginePiece, ...]], ...]:
    tp = layout.tp
    if not 0 <= rank < tp:
        raise ValueError(f"engine rank {rank} out of range for tensor parallel degree {tp}")
    dense = not isinstance(shape, MoEShape) or not shape.every_layer_moe  # some layer has a dense MLP
    if dense and shape.intermediate_size % tp:
        # the engine's gate_up (floor(I/tp) rows) and down_proj (columns r*I//tp...) would disagree
        raise ConfigError(f"engine tensor parallel degree {tp} must divide intermediate_size "
                          f"({shape.intermediate_size})")
    check_engine_experts(shape, tp, layout.expert_placement)
    # an MoE layer's router and experts: their pieces on this rank (none for an expert EP puts elsewhere)
    moe: dict[str, list[tuple[str, Box, tuple[int, ...]]]] = {}
    for i in range(shape.num_hidden_layers):
        if is_moe_layer(shape, i):
            moe.update({name: [] for name, _ in moe_tensors(shape, i)})
            for param, name, box, dst in engine_moe_pieces(shape, tp, layout.expert_placement, rank, i):
                moe[name].append((param, box, dst))
    hd = shape.head_dim
    q_heads, kv_heads = engine_heads(shape.num_attention_heads, shape.num_key_value_heads, tp, rank)
    nq, nkv = len(q_heads) * hd, len(kv_heads) * hd
    local = shape.intermediate_size // tp
    fused_rows = {"q_proj": (q_heads.start * hd, q_heads.stop * hd, 0),
                  "k_proj": (kv_heads.start * hd, kv_heads.stop * hd, nq),
                  "v_proj": (kv_heads.start * hd, kv_heads.stop * hd, nq + nkv),
                  "gate_proj": (rank * local, (rank + 1) * local, 0),
                  "up_proj": (rank * local, (rank + 1) * local, local)}
    split_cols = {"o_proj": (q_heads.start * hd, q_heads.stop * hd),
                  "down_proj": (rank * local, (rank + 1) * local)}
    params: dict[str, list[EnginePiece]] = {}
    for name, shp in _logical(shape) if base else ():
        if name in moe:
            for param, box, dst in moe[name]:
                params.setdefault(param, []).append(EnginePiece(name, box, dst))
            continue
        module, kind = name.rsplit(".", 1)
        mod = module.rsplit(".", 1)[-1]
        box = Box.full(shp)
        dst = (0,) * len(shp)
        if mod in fused_rows:
            r0, r1, at = fused_rows[mod]
            box, dst = box.with_rows(r0, r1), (at,) + dst[1:]
        elif mod in split_cols and kind == "weight":  # their biases are added after the all-reduce: whole
            box = box.with_cols(*split_cols[mod])
        params.setdefault(engine_param_name(name), []).append(EnginePiece(name, box, dst))
    if lora is not None:
        for param, name, box, dst in engine_adapter_pieces(shape, lora, fused_rows, split_cols):
            params.setdefault(param, []).append(EnginePiece(name, box, dst))
    return tuple((k, tuple(v)) for k, v in params.items())


def engine_holdings(cfg: ModelShape, layout: EngineLayout, rank: int, lora: AdapterShape | None = None,
                    base: bool = True) -> dict[str, list[EnginePiece]]:
    """Engine parameter name -> the logical boxes it is made of, with their destination offsets.

    Tied embeddings: lm_head.weight is absent (the engine's lm_head shares embed_tokens.weight)."""
    return {k: list(v) for k, v in _engine(sync_shape(cfg), layout, rank, lora, base)}


def engine_param_shapes(cfg: ModelShape, layout: EngineLayout, rank: int, lora: AdapterShape | None = None,
                        base: bool = True) -> dict[str, tuple[int, ...]]:
    """Engine parameter name -> its shape on `rank` (the bounding box of its pieces)."""
    out = {}
    for name, pieces in engine_holdings(cfg, layout, rank, lora, base).items():
        ndim = len(pieces[0].dst_offset)
        out[name] = tuple(max(p.dst_offset[i] + p.box.shape[i] for p in pieces) for i in range(ndim))
    return out
