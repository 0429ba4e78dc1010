"""This module makes the reshard plan: which box of which trainer rank's local tensor goes where in which
engine rank.

    for each engine rank r, each engine parameter P, each piece (logical tensor T, box B, offset o) of P:
        for each distinct trainer box S of T (its holders: the ranks that hold exactly S):
            X = B & S                                    # logical coordinates
            if X: Transfer(src = one holder,  src local = X - S.origin + S.local_offset,
                           dst = r, P,        dst       = X - B.origin + o)

    trainer TP=2 -> engine TP=4, 8 Q heads, 2 KV heads, head_dim d (q_proj rows = heads x d):

      q_proj rows   trainer 0: heads 0-3 | trainer 1: heads 4-7
      engine 0 qkv: [ q heads 0,1 <- t0 local rows 0:2d | k head 0 <- t0 | v head 0 <- t0 ]
      engine 2 qkv: [ q heads 4,5 <- t1 local rows 0:2d | k head 1 <- t1 | v head 1 <- t1 ]
      (engine 1 and 3 hold the same KV head as engine 0 and 2: KV heads are replicated when tp > Hkv)

A fused tensor is only ever the concatenation of logical boxes written into place; the naive
"concatenate q|k|v, then cut the fused rows in tp equal parts" (tests/helpers.py `naive_plan`, kept to show it is
wrong) hands rank 1 the tail of Q and the head of K instead of its own heads.

Replicated sources (norms, rowwise biases, anything under HSDP replicas): several trainer ranks hold
the same box. One is chosen per destination: the destination's own rank number when it is a holder
(a colocated process then copies locally), otherwise holders[dst % len(holders)] — round-robin, so
replicated reads are spread over the holders instead of all hitting trainer rank 0.

With LoRA the plan also moves the adapters (relayrl.sync.adapters): `plan_sync(..., lora=AdapterShape(r))`
sends base + adapters (the first sync), `base=False` the adapters alone (every later one: the base is
frozen and already in place).

It imports torch and the sync modules only; like all of sync, it must never import the trainer, the
engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from relayrl.models.config import MoEShape
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.boxes import Box
from relayrl.sync.layout import (
    EngineLayout,
    ModelShape,
    TrainerLayout,
    engine_holdings,
    engine_param_shapes,
    logical_tensors,
    sync_shape,
    trainer_holdings,
)


@dataclass(kw_only=True, frozen=True)
class Transfer:
    """Copy `shape` elements of logical tensor `name`: trainer `src_rank`'s local tensor at
    `src_offset` -> engine `dst_rank`'s parameter `dst_param` at `dst_offset`. `logical` is the
    same rectangle in the full logical tensor (for reading plans and checking them)."""

    dst_rank: int
    dst_param: str
    dst_offset: tuple[int, ...]
    src_rank: int
    name: str
    src_offset: tuple[int, ...]
    shape: tuple[int, ...]
    logical: Box

    @property
    def src_box(self) -> Box:
        return Box.at(self.src_offset, self.shape)

    @property
    def dst_box(self) -> Box:
        return Box.at(self.dst_offset, self.shape)

    @property
    def numel(self) -> int:
        return self.logical.size


def choose_source(holders: tuple[int, ...], dst_rank: int, home: int = 0) -> int:
    """One trainer rank among `holders` (all hold the same box) for engine rank `dst_rank`: the trainer rank in its
    process when that holds it (colocated: trainer rank home + dst_rank; a fleet's replica k has home k*tp)."""
    own = home + dst_rank
    return own if own in holders else holders[own % len(holders)]


@dataclass(kw_only=True, frozen=True)
class SyncPlan:
    shape: ModelShape
    trainer: TrainerLayout
    engine: EngineLayout
    transfers: tuple[Transfer, ...]  # by engine rank, then parameter, then destination offset
    param_shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # per engine rank
    lora: AdapterShape | None = None  # the adapters moved too
    base: bool = True  # False: the adapters alone

    def trainer_holdings(self, rank: int):
        """What trainer `rank` holds of every tensor this plan reads."""
        return trainer_holdings(self.shape, self.trainer, rank, self.lora, self.base)

    # ---- views ----
    @cached_property
    def _by_dst(self) -> dict[int, tuple[Transfer, ...]]:
        out = defaultdict(list)
        for t in self.transfers:
            out[t.dst_rank].append(t)
        return {r: tuple(out[r]) for r in range(self.engine.world_size)}

    def for_dst(self, rank: int) -> tuple[Transfer, ...]:
        """What engine `rank` receives (all of it: the plan covers each of its parameters exactly)."""
        return self._by_dst[rank]

    @cached_property
    def _pairs(self) -> dict[tuple[int, int], tuple[Transfer, ...]]:
        out = defaultdict(list)
        for t in self.transfers:
            out[(t.src_rank, t.dst_rank)].append(t)
        return {k: tuple(v) for k, v in out.items()}

    def pairs(self) -> dict[tuple[int, int], tuple[Transfer, ...]]:
        """(src, dst) -> its transfers in plan order: the order both ends pack / unpack a flat buffer."""
        return dict(self._pairs)

    def between(self, src_rank: int, dst_rank: int) -> tuple[Transfer, ...]:
        """Trainer `src_rank` -> engine `dst_rank`, in plan order (empty when they exchange nothing)."""
        return self._pairs.get((src_rank, dst_rank), ())

    def sources(self, dst_rank: int) -> set[int]:
        return {t.src_rank for t in self.for_dst(dst_rank)}

    def engine_param_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        return dict(self.param_shapes[rank])

    def bytes_per_dst_rank(self, dtype: torch.dtype) -> dict[int, int]:
        """Bytes each engine rank receives when the engine holds `dtype` (= the size of its shard)."""
        return {r: sum(t.numel for t in ts) * dtype.itemsize for r, ts in self._by_dst.items()}

    def bytes_per_src_rank(self, dtype: torch.dtype) -> dict[int, int]:
        out = dict.fromkeys(range(self.trainer.world_size), 0)
        for t in self.transfers:
            out[t.src_rank] += t.numel * dtype.itemsize
        return out

    # ---- reading ----
    def describe(self, dtype: torch.dtype = torch.bfloat16, layers: int = 1) -> str:
        """A summary table per engine rank, then each engine rank's parameters and their pieces
        (only the first `layers` decoder layers: the others repeat the pattern)."""
        s, tl = self.shape, self.trainer
        tied = ", tied embeddings" if s.tie_word_embeddings else ""
        mib = f"MiB ({str(dtype).removeprefix('torch.')})"
        what = "" if self.lora is None else f", LoRA r={self.lora.rank} {'base + ' if self.base else ''}adapters"
        lines = [
            f"sync plan{what}: trainer tp={tl.tp} dp_shard={tl.dp_shard} dp_replicate={tl.dp_replicate}"
            f"{f' pp={tl.pp}' if tl.pp > 1 else ''}{f' ep={tl.ep}' if tl.ep > 1 else ''} "
            f"({tl.world_size} ranks) -> engine tp={self.engine.tp}",
            f"model: {s.num_hidden_layers} layers, {s.num_attention_heads} Q / {s.num_key_value_heads} KV heads "
            f"x head_dim {s.head_dim}, hidden {s.hidden_size}, intermediate {s.intermediate_size}, "
            f"vocab {s.vocab_size}{tied}",
            *([f"experts: {len(s.moe_layers)} MoE layers x {s.num_experts} experts (top {s.num_experts_per_tok}) "
               f"x width {s.moe_intermediate_size}"
               + (f", shared expert {s.shared_expert_intermediate_size}" if s.shared_expert_intermediate_size else "")
               + f"; engine expert placement {self.engine.expert_placement}"] if isinstance(s, MoEShape) else []),
            "",
            f"{'engine rank':>11}  {'params':>6}  {'elements':>12}  {mib:>14}"
            f"  {'pieces':>6}  from trainer ranks",
        ]
        nbytes = self.bytes_per_dst_rank(dtype)
        for r in range(self.engine.world_size):
            ts = self.for_dst(r)
            lines.append(f"{r:>11}  {len(self.param_shapes[r]):>6}  {sum(t.numel for t in ts):>12}  "
                         f"{nbytes[r] / 2**20:>14.2f}  {len(ts):>6}  {sorted(self.sources(r))}")
        src_bytes = self.bytes_per_src_rank(dtype)
        lines.append("trainer ranks send (MiB): " + ", ".join(f"{r}: {b / 2**20:.2f}" for r, b in src_bytes.items()))
        hidden_layers = [f"layers.{i}." for i in range(layers, s.num_hidden_layers)]
        for r in range(self.engine.world_size):
            lines += ["", f"engine rank {r}"]
            shapes = dict(self.param_shapes[r])
            by_param = defaultdict(list)
            for t in self.for_dst(r):
                by_param[t.dst_param].append(t)
            for param, ts in by_param.items():
                if any(param.startswith(p) for p in hidden_layers):
                    continue
                lines.append(f"  {param} {list(shapes[param])}")
                for t in ts:
                    lines.append(f"    {t.dst_box!s:<18} <- trainer {t.src_rank:<3} {t.name} local {t.src_box}"
                                 f"  (logical {t.logical})")
            if hidden_layers:
                lines.append(f"  (layers {layers}..{s.num_hidden_layers - 1}: the same pattern)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- planning
@lru_cache(maxsize=32)
def _plan(shape: ModelShape, tl: TrainerLayout, el: EngineLayout, lora: AdapterShape | None, base: bool,
          home: int = 0) -> SyncPlan:
    logical = logical_tensors(shape, lora, base)
    # name -> {(box, local offset): holders}; distinct boxes of one tensor must tile it
    index: dict[str, dict[tuple[Box, tuple[int, ...]], list[int]]] = defaultdict(dict)
    for rank in range(tl.world_size):
        for name, holdings in trainer_holdings(shape, tl, rank, lora, base).items():
            for h in holdings:
                if not h.box.empty:
                    index[name].setdefault((h.box, h.local_offset), []).append(rank)
    for name, shp in logical.items():
        if sum(box.size for box, _ in index[name]) != Box.full(shp).size:
            raise RuntimeError(f"trainer boxes of {name} do not tile it exactly: {list(index[name])}")

    transfers, param_shapes = [], []
    for dst in range(el.world_size):
        shapes = engine_param_shapes(shape, el, dst, lora, base)
        param_shapes.append(tuple(shapes.items()))
        for param, pieces in engine_holdings(shape, el, dst, lora, base).items():
            covered, start = 0, len(transfers)
            for piece in pieces:
                for (sbox, local_offset), holders in index[piece.name].items():
                    x = piece.box & sbox
                    if x is None:
                        continue
                    transfers.append(Transfer(
                        dst_rank=dst, dst_param=param,
                        dst_offset=x.relative_to(piece.box).shift(*piece.dst_offset).offset,
                        src_rank=choose_source(tuple(holders), dst, home), name=piece.name,
                        src_offset=x.relative_to(sbox).shift(*local_offset).offset,
                        shape=x.shape, logical=x))
                    covered += x.size
            transfers[start:] = sorted(transfers[start:], key=lambda t: t.dst_offset)
            if covered != Box.full(shapes[param]).size:
                raise RuntimeError(f"plan covers {covered} elements of engine rank {dst}'s {param} "
                                   f"{shapes[param]}: a layout bug")
    return SyncPlan(shape=shape, trainer=tl, engine=el, transfers=tuple(transfers), param_shapes=tuple(param_shapes),
                    lora=lora, base=base)


def plan_sync(cfg: ModelShape, trainer_layout: TrainerLayout, engine_layout: EngineLayout,
              lora: AdapterShape | None = None, base: bool = True, home: int = 0) -> SyncPlan:
    """The reshard plan from a trainer layout to one engine replica's layout (cached); with `lora`, the
    adapters too (`base=False`: the adapters alone). home: the trainer rank whose process holds engine rank 0
    (colocated; replicated pieces are read from the engine rank's own process where it holds them)."""
    return _plan(sync_shape(cfg), trainer_layout, engine_layout, lora, base, home)
