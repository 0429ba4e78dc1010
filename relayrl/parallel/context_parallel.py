"""Context parallelism: a batch's sequence is sharded over the cp ranks, and attention sees all of it.

    full batch [B, T] ──shard (layout)──> rank r: [B, T/cp] tokens, their position ids (RoPE stays right)
    every module but attention is per token, so it runs on the shard as is; attention is swapped from
    outside (Attention.attention_fn, relayrl.models.transformer) for one that attends over the whole sequence:

    ulysses  all-to-all q, k, v from [B, H, T/cp] (sequence-sharded) to [B, H/cp, T] (head-sharded), attention
             on the whole sequence for H/cp heads, all-to-all back. Needs H divisible by cp; KV heads are split
             when cp divides them and replicated cp/KV times when KV divides cp (else refused).
    ring     K, V blocks passed around the ring with an online-softmax merge (relayrl.parallel.ring_attention);
             no head constraint.

Layouts (the slots of the sequence rank r holds, in order):

    contiguous  chunk r of cp equal chunks                 (ulysses' default: its work is per head, balanced)
    zigzag      chunks r and 2cp-1-r of 2cp equal chunks   (ring's default: under a causal mask the early
                                                            chunks attend to little, so each rank takes one
                                                            early and one late chunk and every rank
                                                            computes the same number of blocks)

    T = 8, cp = 2, zigzag:  rank 0 holds slots 0 1 | 6 7,  rank 1 holds slots 2 3 | 4 5

The mask is the model's (relayrl.models.transformer.build_attention_mask), computed from the full batch's
metadata for any block of slots: key j is visible to query i iff j <= i, key j is a real token, j is inside the
sliding window, and (packed rows) in the query's segment or its parent's — and always j == i.

    cp = apply_context_parallel(model, group, mode="ring")   # after TP, before FSDP (whose shard group then
    logits = cp(input_ids, attention_mask)                   #   spans dp_shard x cp, as in torchtitan)
    labels = cp.shard(next_token_ids)                        # any per-token tensor: shard it alike
    full = cp.gather(logits)                                 # differentiable; only when the full one is needed

A loss over the local tokens, divided by the GLOBAL token count, sums over the cp ranks to the full loss, so the
parameter gradients summed over the cp group equal one process's.

The batch's metadata stays set on `cp` until the next call, because activation checkpointing re-runs attention
in the backward: run each micro-batch's backward before the next one's forward.

It imports torch, relayrl.errors and the parallel modules only; it finds attention modules by their
`attention_fn`, `n_heads` and `n_kv` attributes and never imports relayrl.models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from relayrl.errors import ConfigError
from relayrl.parallel.collectives import gather_from_group
from relayrl.parallel.ring_attention import Span, ring_attention

CP_MODES = ("ring", "ulysses")  # relayrl.planner.layout.CP_MODES
LAYOUTS = ("zigzag", "contiguous")
DEFAULT_LAYOUT = {"ring": "zigzag", "ulysses": "contiguous"}


# ---------------------------------------------------------------------------- layouts
def shard_spans(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> list[Span]:
    """The [start, stop) slot ranges of the full sequence that `rank` holds, in its local order."""
    parts = 2 * cp if layout == "zigzag" else cp
    if layout not in LAYOUTS:
        raise ConfigError(f"context-parallel layout must be one of {LAYOUTS}, got {layout!r}")
    if seq_len % parts:
        raise ValueError(f"context parallelism ({layout}, cp={cp}) splits the sequence into {parts} equal chunks, "
                         f"but it has {seq_len} tokens: pad the batch to a multiple of {parts}")
    c = seq_len // parts
    chunks = (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)
    return [(i * c, (i + 1) * c) for i in chunks]


def shard_slots(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> Tensor:
    """The slots `rank` holds, as one index tensor."""
    return torch.cat([torch.arange(a, b) for a, b in shard_spans(seq_len, cp, rank, layout)])


def shard_sequence(x: Tensor, cp: int, rank: int, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """`rank`'s shard of x along `dim` (the sequence)."""
    return torch.cat([x.narrow(dim, a, b - a) for a, b in shard_spans(x.shape[dim], cp, rank, layout)], dim)


def unshard_sequence(parts: list[Tensor], layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The full sequence from every rank's shard (parts[r] from rank r), in slot order."""
    cp = len(parts)
    order = torch.cat([shard_slots(parts[0].shape[dim] * cp, cp, r, layout) for r in range(cp)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order).to(parts[0].device))


# ---------------------------------------------------------------------------- the batch's mask
@dataclass
class _Batch:
    """The full batch's per-token metadata [B, T], kept on every cp rank to build any block's mask."""

    valid: Tensor  # bool: a real token
    position_ids: Tensor
    segment_ids: Tensor | None
    parent_ids: Tensor | None
    sliding_window: int | None

    @property
    def plain_causal(self) -> bool:
        """The mask is just j <= i (no padding, window or segments)."""
        return self.sliding_window is None and self.segment_ids is None and bool(self.valid.all())

    def mask(self, qs: Span, ks: Span) -> Tensor | None:
        """Bool [B, 1, q, k] for query slots qs and key slots ks; None when every key is visible."""
        if self.plain_causal and ks[1] - 1 <= qs[0]:
            return None
        dev = self.valid.device
        q, k = torch.arange(*qs, device=dev), torch.arange(*ks, device=dev)
        allowed = (k[None, :] <= q[:, None])[None] & self.valid[:, None, k]
        if self.sliding_window is not None:
            if self.segment_ids is not None:
                pos = self.position_ids
                allowed = allowed & (pos[:, None, k] > pos[:, q, None] - self.sliding_window)
            else:
                allowed = allowed & (k[None, :] > q[:, None] - self.sliding_window)[None]
        if self.segment_ids is not None:
            seg = self.segment_ids
            same = seg[:, q, None] == seg[:, None, k]
            if self.parent_ids is not None:
                same = same | (self.parent_ids[:, q, None] == seg[:, None, k])
            allowed = allowed & same
        allowed = allowed | (k[None, :] == q[:, None])[None]
        return allowed[:, None]


# ---------------------------------------------------------------------------- ulysses
class _AllToAll(torch.autograd.Function):
    """x [B, h, t, D] → [B, h/cp, cp t, D] (seq_to_heads) or back; the backward is the other direction."""

    @staticmethod
    def forward(ctx, x, group, seq_to_heads):
        ctx.group, ctx.seq_to_heads = group, seq_to_heads
        return _all_to_all(x, group, seq_to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, not ctx.seq_to_heads), None, None


def _all_to_all(x: Tensor, group, seq_to_heads: bool) -> Tensor:
    n = dist.get_world_size(group)
    B, h, t, D = x.shape
    if seq_to_heads:  # send head chunk i to rank i; what arrives from rank i is its tokens of my heads
        send = x.unflatten(1, (n, h // n)).movedim(1, 0).contiguous()
    else:  # send token chunk i (rank i's tokens) back to rank i; what arrives are my tokens of its heads
        send = x.unflatten(2, (n, t // n)).movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    if seq_to_heads:  # [n, B, h/n, t, D] → [B, h/n, n t, D]
        return recv.movedim(0, 2).flatten(2, 3)
    return recv.movedim(0, 1).flatten(1, 2)  # [n, B, h, t/n, D] → [B, n h, t/n, D]


def check_ulysses_heads(n_heads: int, n_kv: int, cp: int, where: str = "the model") -> None:
    """Refuse, in one line, head counts Ulysses cannot split over cp ranks."""
    if n_heads % cp:
        raise ConfigError(f"Ulysses context parallelism splits attention heads over cp={cp} ranks, but {where} has "
                          f"{n_heads} query heads (not divisible by {cp}): use a cp that divides {n_heads}, "
                          "or cp_mode='ring'")
    if n_kv % cp and cp % n_kv:
        raise ConfigError(f"Ulysses context parallelism needs the key/value heads ({n_kv} in {where}) divisible by "
                          f"cp={cp} or dividing it (then each is replicated cp/{n_kv} times): use such a cp, "
                          "or cp_mode='ring'")


# ---------------------------------------------------------------------------- the module
class ContextParallel:
    """The cp state of one model: its group, mode and layout, and the current batch (see the module docstring)."""

    def __init__(self, model: nn.Module, group, mode: str = "ring", layout: str | None = None):
        if mode not in CP_MODES:
            raise ConfigError(f"cp_mode must be one of {', '.join(CP_MODES)}, got {mode!r}")
        self.model, self.group, self.mode = model, group, mode
        self.layout = layout or DEFAULT_LAYOUT[mode]
        if self.layout not in LAYOUTS:
            raise ConfigError(f"context-parallel layout must be one of {LAYOUTS}, got {self.layout!r}")
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.attention = [(n, m) for n, m in model.named_modules() if hasattr(m, "attention_fn")]
        if not self.attention:
            raise ConfigError("context parallelism found no attention module (one with an attention_fn) to replace")
        if mode == "ulysses":
            for name, m in self.attention:
                check_ulysses_heads(m.n_heads, m.n_kv, self.cp, name)
        self._batch: _Batch | None = None
        self._spans: list[list[Span]] = []
        for _, m in self.attention:
            m.attention_fn = self._attend

    def remove(self) -> None:
        """Give the attention modules back their own (single-process) attention."""
        for _, m in self.attention:
            del m.attention_fn

    # ---- data
    @property
    def seq_multiple(self) -> int:
        """A sequence length this layout splits evenly must be a multiple of this (2 cp chunks for zigzag)."""
        return 2 * self.cp if self.layout == "zigzag" else self.cp

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's shard of a per-token tensor (labels, loss masks, advantages per token, ...)."""
        return shard_sequence(x, self.cp, self.rank, self.layout, dim)

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """The full sequence from every rank's shard, in slot order; the backward keeps this rank's part."""
        full = gather_from_group(x, dim, self.group)
        order = torch.cat([shard_slots(full.shape[dim], self.cp, r, self.layout) for r in range(self.cp)])
        return full.index_select(dim, torch.argsort(order).to(x.device))

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                 segment_ids: Tensor | None = None, parent_ids: Tensor | None = None, **kwargs) -> Tensor:
        """The model's output for this rank's shard of the full batch `input_ids` [B, T]: [B, T/cp, ...].

        The masks' metadata (attention_mask, position_ids, segment_ids, parent_ids) is given whole; any other
        per-token input in kwargs (an MoE Routing's replayed selections) must already be this rank's shard."""
        if kwargs.get("kv_cache") is not None:
            raise ConfigError("context parallelism is for training forwards over whole sequences, not a KV cache")
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=input_ids.device)
        if position_ids is None:  # the model's default, on the full sequence
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        self._spans = [shard_spans(T, self.cp, r, self.layout) for r in range(self.cp)]
        config = getattr(self.model, "config", None)
        self._batch = _Batch(attention_mask.bool(), position_ids, segment_ids, parent_ids,
                             getattr(config, "sliding_window", None))
        return self.model(self.shard(input_ids), position_ids=self.shard(position_ids), **kwargs)

    # ---- attention (Attention.attention_fn's signature; the local mask the model built is not used)
    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask, enable_gqa: bool) -> Tensor:
        if self._batch is None:
            raise RuntimeError("a context-parallel model is called through its ContextParallel, not directly")
        if self.mode == "ring":
            return ring_attention(q, k, v, self._spans, self._batch.mask, self.group)
        return self._ulysses(q, k, v)

    def _ulysses(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, kv = self.cp, k.shape[1]
        if kv % n:  # fewer KV heads than ranks: each rank gets a copy of its query heads' KV head
            k, v = k.repeat_interleave(n // kv, dim=1), v.repeat_interleave(n // kv, dim=1)
        q, k, v = (_AllToAll.apply(x, self.group, True) for x in (q, k, v))  # [B, h/cp, T, D] in rank order
        T = q.shape[2]
        order = torch.cat([torch.arange(a, b) for spans in self._spans for a, b in spans]).to(q.device)
        natural = self.layout == "contiguous"
        if not natural:
            q, k, v = (x.index_select(2, torch.argsort(order)) for x in (q, k, v))
        batch = self._batch
        mask = None if batch.plain_causal else batch.mask((0, T), (0, T))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=q.shape[1] != k.shape[1])
        if not natural:
            out = out.index_select(2, order)
        return _AllToAll.apply(out, self.group, False)


def apply_context_parallel(model: nn.Module, group, mode: str = "ring", layout: str | None = None) -> ContextParallel:
    """Make `model` context-parallel over `group` (a process group); call the returned object to run it."""
    return ContextParallel(model, group, mode, layout)
