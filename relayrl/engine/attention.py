"""This module computes paged attention over a block-structured KV cache (portable torch: CPU and GPU
alike).

    cache per layer: k, v  [num_blocks * block_size, kv_heads, head_dim]   slot = block * block_size + offset

One step's batch is flattened: N new tokens of B sequences (prefill: each sequence's uncached
tokens; decode: one token each). For every layer:

    1. write the new tokens' k, v at their slots (all sequences first — so a sequence may read a
       prefix block another sequence of the same batch is writing: prefix caching within a batch)
    2. gather each sequence's keys by its block table: [B, max_context, kv_heads, head_dim]
    3. attention of each sequence's queries over its own keys (causal by absolute position,
       sliding window when the model has one), then scatter back to the N tokens

It imports torch only; like the whole engine, it must never import the trainer, sync, the controller or
the CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(kw_only=True)
class PagedBatch:
    decode: bool  # one query per sequence: no query padding to gather or drop
    positions: torch.Tensor  # [N] absolute position of each new token
    slot_mapping: torch.Tensor  # [N] cache slot each new token's k/v is written to
    q_index: torch.Tensor  # [B, Qmax] index into N of each sequence's queries (padding: 0)
    q_valid: torch.Tensor  # [B, Qmax] bool
    gather_slots: torch.Tensor  # [B, Lmax] cache slot of each key position (padding: 0)
    attn_mask: torch.Tensor  # [B, 1, Qmax, Lmax] bool, True = may attend
    last_index: torch.Tensor  # [B] index into N of each sequence's last token (its logits are sampled)


def build_batch(
    token_starts: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
    sliding_window: int | None = None,
) -> PagedBatch:
    """Sequence b computes tokens [token_starts[b], context_lens[b]) with all its keys in the cache."""
    q_lens = [c - s for s, c in zip(token_starts, context_lens, strict=True)]
    Qmax, Lmax = max(q_lens), max(context_lens)
    pos_rows = torch.arange(Lmax)
    # gather slots of every key position, from block tables padded to a rectangle
    nblk = -(-Lmax // block_size)
    table = torch.tensor([bt[:nblk] + [0] * (nblk - len(bt)) for bt in block_tables], dtype=torch.long)
    key_slots = table[:, pos_rows // block_size] * block_size + pos_rows % block_size  # [B, Lmax]
    ctx = torch.tensor(context_lens)
    key_valid = pos_rows[None, :] < ctx[:, None]
    starts = torch.tensor(token_starts)
    qlen_t = torch.tensor(q_lens)
    qi = torch.arange(Qmax)
    q_valid = qi[None, :] < qlen_t[:, None]
    offsets = torch.cumsum(qlen_t, 0) - qlen_t
    q_index = torch.where(q_valid, offsets[:, None] + qi[None, :], torch.zeros((), dtype=torch.long))
    q_pos = torch.where(q_valid, starts[:, None] + qi[None, :], torch.zeros((), dtype=torch.long))  # [B, Qmax]
    positions = q_pos[q_valid]
    slot_mapping = key_slots.gather(1, q_pos)[q_valid]
    allowed = key_valid[:, None, :] & (pos_rows[None, None, :] <= q_pos[:, :, None])
    if sliding_window is not None:
        allowed &= pos_rows[None, None, :] > q_pos[:, :, None] - sliding_window
    # padding query rows attend key 0 only: never an all-masked softmax (NaN); their output is dropped
    allowed |= (~q_valid[:, :, None]) & (pos_rows[None, None, :] == 0)
    return PagedBatch(
        decode=Qmax == 1, positions=positions, slot_mapping=slot_mapping, q_index=q_index, q_valid=q_valid,
        gather_slots=torch.where(key_valid, key_slots, torch.zeros((), dtype=torch.long)),
        attn_mask=allowed[:, None], last_index=offsets + qlen_t - 1,
    )


def paged_attention(q, k, v, cache: tuple[torch.Tensor, torch.Tensor], batch: PagedBatch) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] of the new tokens -> attention output [N, Hq, D].

    fp32 goes through SDPA; half precision is written out (scores, softmax in fp32, weighted sum),
    where SDPA's CPU path with a boolean mask and grouped KV heads was measured 2-25x slower for
    decode. Each KV head serves its group of Hq / Hkv query heads by broadcasting, never by copying.
    """
    k_cache, v_cache = cache
    k_cache.index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, batch.slot_mapping, v.to(v_cache.dtype))
    B, L = batch.gather_slots.shape
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    flat = batch.gather_slots.reshape(-1)
    K = k_cache.index_select(0, flat).view(B, L, Hkv, D).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    V = v_cache.index_select(0, flat).view(B, L, Hkv, D).transpose(1, 2)  # [B, Hkv, L, D]
    Q = q.view(B, 1, Hq, D) if batch.decode else q[batch.q_index]  # [B, Qmax, Hq, D]
    Qmax = Q.shape[1]
    if Q.dtype == torch.float32:  # SDPA's fp32 CPU kernel is the faster one (measured)
        out = F.scaled_dot_product_attention(Q.transpose(1, 2), K.transpose(2, 3), V, attn_mask=batch.attn_mask,
                                             enable_gqa=Hq != Hkv)
        out = out.transpose(1, 2)  # [B, Qmax, Hq, D]
    else:
        Qg = Q.view(B, Qmax, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, Qmax, D]
        scores = (Qg @ K[:, :, None]).float() * D**-0.5  # [B, Hkv, G, Qmax, L]
        scores = scores.masked_fill(~batch.attn_mask[:, :, None], float("-inf"))
        out = scores.softmax(-1).to(V.dtype) @ V[:, :, None]  # [B, Hkv, G, Qmax, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(B, Qmax, Hq, D)
    return out.view(B, Hq, D) if batch.decode else out[batch.q_valid]
