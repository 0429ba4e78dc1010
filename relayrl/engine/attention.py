"""This module computes paged attention over a block-structured KV cache (portable torch: CPU and GPU
alike).

    cache per layer: k, v  [num_blocks * block_size, kv_heads, head_dim]   slot = block * block_size + offset

One step's batch is flattened: N new tokens of B sequences (prefill: each sequence's uncached
tokens; decode: one token each). For every layer:

    1. write the new tokens' k, v at their slots (all sequences first — so a sequence may read a
       prefix block another sequence of the same batch is writing: prefix caching within a batch)
    2. per attention group: gather each sequence's keys by its block table, [Bg, Lg, kv_heads, head_dim]
    3. attention of each sequence's queries over its own keys (causal by absolute position,
       sliding window when the model has one), then scatter back to the N tokens

Attention groups. A group pads its sequences' queries to its longest query count Qg and its keys to
its longest context Lg, so one group over a prefill batch of mixed lengths computes B x Qmax x Lmax
scores for sum(q_b x c_b) real ones (one 50-token prompt among 255 tail-only prefills of 10 makes
every sequence pay for 50). A prefill batch is therefore split by length (`group=True`):

    sort sequences by (query count, context) descending; a sequence joins the open group if then
        q_i * c_i >= GROUP_FILL * Qg * Lg    for every member i   (real scores fill >= half of each row)
    else it opens the next group

so every sequence's padded rectangle is at most 1 / GROUP_FILL times its real q x c; with contexts alike,
the group count grows with log2 of the spread of query counts, not with B. Decode (one query each) stays one group: its
padding is keys only, and a decode step is too short to pay for more kernels. `group=False` is the
previous, padded form: one group in batch order (kept for comparison and the benchmark's baseline).

It imports torch only; like the whole engine, it must never import the trainer, sync, the controller or
the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

GROUP_FILL = 0.5  # a sequence stays in a group while its real scores fill at least this share of its padded row


@dataclass(kw_only=True)
class AttnGroup:
    """Sequences whose attention runs as one padded rectangle."""

    q_index: torch.Tensor  # [Bg, Qg] index into N of each sequence's queries (padding: 0)
    q_valid: torch.Tensor  # [Bg, Qg] bool
    gather_slots: torch.Tensor  # [Bg, Lg] cache slot of each key position (padding: 0)
    attn_mask: torch.Tensor  # [Bg, 1, Qg, Lg] bool, True = may attend
    out_index: torch.Tensor | None  # [n_g] index into N of the group's real queries (None: all N, in order)


@dataclass(kw_only=True)
class PagedBatch:
    decode: bool  # one query per sequence: no query padding to gather or drop
    positions: torch.Tensor  # [N] absolute position of each new token
    slot_mapping: torch.Tensor  # [N] cache slot each new token's k/v is written to
    groups: list[AttnGroup]  # attention groups, together covering every sequence once
    last_index: torch.Tensor  # [B] index into N of each sequence's last token (its logits are sampled)
    # copy-on-write, done before anything is written (relayrl.engine.block_manager): the cache slots of
    # blocks being unshared, and the fresh blocks' slots they are copied to; None when there are none
    copy_from: torch.Tensor | None = None
    copy_to: torch.Tensor | None = None

    def to(self, device) -> PagedBatch:
        def move(x):
            return x.to(device) if torch.is_tensor(x) else x

        groups = [AttnGroup(**{f.name: move(getattr(g, f.name)) for f in fields(g)}) for g in self.groups]
        return replace(self, groups=groups, **{f.name: move(getattr(self, f.name)) for f in fields(self)
                                               if f.name != "groups"})


def group_rows(q_lens: list[int], context_lens: list[int]) -> list[list[int]]:
    """Split sequences into attention groups by length (see the module docstring)."""
    order = sorted(range(len(q_lens)), key=lambda b: (-q_lens[b], -context_lens[b]))
    groups: list[list[int]] = []
    Qg = Lg = least = 0  # the open group's rectangle, and the fewest real scores of a row in it
    for b in order:
        q, c = q_lens[b], context_lens[b]
        if groups and min(least, q * c) >= GROUP_FILL * Qg * max(Lg, c):  # a longer Lg pads every row more
            groups[-1].append(b)
            Lg, least = max(Lg, c), min(least, q * c)
        else:
            groups.append([b])
            Qg, Lg, least = q, c, q * c
    return groups


def _attn_group(rows, table, starts, ctx, q_lens, offsets, block_size: int, sliding_window: int | None,
                in_order: bool) -> AttnGroup:
    """One group's rectangles; `rows` None: every sequence, in batch order."""
    if rows is not None:
        idx = torch.tensor(rows)
        table, starts, ctx, q_lens, offsets = table[idx], starts[idx], ctx[idx], q_lens[idx], offsets[idx]
    Qg, Lg = int(q_lens.max()), int(ctx.max())
    pos_rows = torch.arange(Lg)
    table = table[:, : -(-Lg // block_size)]
    key_slots = table[:, pos_rows // block_size] * block_size + pos_rows % block_size  # [Bg, Lg]
    key_valid = pos_rows[None, :] < ctx[:, None]
    qi = torch.arange(Qg)
    q_valid = qi[None, :] < q_lens[:, None]
    zero = torch.zeros((), dtype=torch.long)
    q_index = torch.where(q_valid, offsets[:, None] + qi[None, :], zero)
    q_pos = torch.where(q_valid, starts[:, None] + qi[None, :], zero)  # [Bg, Qg]
    allowed = key_valid[:, None, :] & (pos_rows[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        allowed &= pos_rows[None, None, :] > q_pos[:, :, None] - sliding_window
    # padding query rows attend key 0 only: never an all-masked softmax (NaN); their output is dropped
    allowed |= (~q_valid[:, :, None]) & (pos_rows[None, None, :] == 0)
    return AttnGroup(q_index=q_index, q_valid=q_valid, gather_slots=torch.where(key_valid, key_slots, zero),
                     attn_mask=allowed[:, None], out_index=None if in_order else q_index[q_valid])


def build_batch(
    token_starts: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
    sliding_window: int | None = None, *, group: bool = True,
) -> PagedBatch:
    """Sequence b computes tokens [token_starts[b], context_lens[b]) with all its keys in the cache.
    group: split a batch with more than one query per sequence into attention groups by length."""
    q_lens = [c - s for s, c in zip(token_starts, context_lens, strict=True)]
    decode = max(q_lens) == 1
    nblk = -(-max(context_lens) // block_size)
    table = torch.tensor([bt[:nblk] + [0] * (nblk - len(bt)) for bt in block_tables], dtype=torch.long)
    starts, ctx, qlen_t = torch.tensor(token_starts), torch.tensor(context_lens), torch.tensor(q_lens)
    offsets = torch.cumsum(qlen_t, 0) - qlen_t
    # every new token: its sequence, absolute position and cache slot
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), qlen_t)
    positions = starts[seq_of] + torch.arange(len(seq_of)) - offsets[seq_of]
    slot_mapping = table[seq_of, positions // block_size] * block_size + positions % block_size
    row_groups = group_rows(q_lens, context_lens) if group and not decode else None
    if row_groups is None or len(row_groups) == 1:
        groups = [_attn_group(None, table, starts, ctx, qlen_t, offsets, block_size, sliding_window, True)]
    else:
        groups = [_attn_group(r, table, starts, ctx, qlen_t, offsets, block_size, sliding_window, False)
                  for r in row_groups]
    return PagedBatch(decode=decode, positions=positions, slot_mapping=slot_mapping, groups=groups,
                      last_index=offsets + qlen_t - 1)


def _attend(q, K, V, g: AttnGroup, decode: bool) -> torch.Tensor:
    """One group: queries [Bg, Qg, Hq, D] over keys K [Bg, Hkv, D, Lg], V [Bg, Hkv, Lg, D] -> [Bg, Qg, Hq, D].

    fp32 goes through SDPA; half precision is written out (scores, softmax in fp32, weighted sum),
    where SDPA's CPU path with a boolean mask and grouped KV heads was measured 2-25x slower for
    decode. Each KV head serves its group of Hq / Hkv query heads by broadcasting, never by copying."""
    B, Hkv, D, _ = K.shape
    Q = q.view(B, 1, q.shape[1], D) if decode else q[g.q_index]  # [Bg, Qg, Hq, D]
    Qmax, Hq = Q.shape[1], Q.shape[2]
    if Q.dtype == torch.float32:  # SDPA's fp32 CPU kernel is the faster one (measured)
        out = F.scaled_dot_product_attention(Q.transpose(1, 2), K.transpose(2, 3), V, attn_mask=g.attn_mask,
                                             enable_gqa=Hq != Hkv)
        return out.transpose(1, 2)  # [Bg, Qg, Hq, D]
    Qg = Q.view(B, Qmax, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # [Bg, Hkv, G, Qg, D]
    scores = (Qg @ K[:, :, None]).float() * D**-0.5  # [Bg, Hkv, G, Qg, L]
    scores = scores.masked_fill(~g.attn_mask[:, :, None], float("-inf"))
    out = scores.softmax(-1).to(V.dtype) @ V[:, :, None]  # [Bg, Hkv, G, Qg, D]
    return out.permute(0, 3, 1, 2, 4).reshape(B, Qmax, Hq, D)


def paged_attention(q, k, v, cache: tuple[torch.Tensor, torch.Tensor], batch: PagedBatch) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] of the new tokens -> attention output [N, Hq, D]."""
    k_cache, v_cache = cache
    k_cache.index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    out = None
    for g in batch.groups:
        B, L = g.gather_slots.shape
        flat = g.gather_slots.reshape(-1)
        K = k_cache.index_select(0, flat).view(B, L, Hkv, D).permute(0, 2, 3, 1)  # [Bg, Hkv, D, Lg]
        V = v_cache.index_select(0, flat).view(B, L, Hkv, D).transpose(1, 2)  # [Bg, Hkv, Lg, D]
        o = _attend(q, K, V, g, batch.decode)
        o = o.view(B, Hq, D) if batch.decode else o[g.q_valid]  # [n_g, Hq, D]
        if g.out_index is None:  # the only group, in batch order
            return o
        if out is None:
            out = q.new_empty(N, Hq, o.shape[-1])
        out[g.out_index] = o
    return out
