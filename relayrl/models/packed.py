"""This module defines the packed layout: many sequences laid end to end in one row of N tokens, with attention
computed per segment over gathered keys rather than over the row's N x N square.

The trainer's padding-free forward puts every token it needs once in the row, so the linear layers, norms and
MLPs see no padding. Attention needs structure: a segment is a run of the row's tokens (a sequence, a shared
prompt, or one sample's response), and it may have a parent segment (the prompt its response continues),

    row        [ p p p p | a a a | b b | c c c c ]     segments: the prompt (no parent), then a, b, c (parent p)
    positions    0 1 2 3   4 5 6   4 5   4 5 6 7

A segment's queries attend to its parent's tokens and to its own, causally by position (and within the sliding
window when the model has one). Each segment's keys are gathered into a small rectangle,

    queries [S, Qmax]   keys [S, Kmax] = parent tokens, then own tokens     (S segments of a bucket)

so attention costs Σ own x (parent + own) per head, where a dense mask over the row costs N^2: for a prompt of
P tokens with G responses of R, P^2 + G R (P + R) against (P + G R)^2. Segments are grouped into buckets of
similar shape (each bucket's rectangles padded at most 1.25x their real area, PAD_LIMIT), one attention call
per bucket: on the CPU, a limit of 1.25 beat 2 by 16% and 1 (one bucket per distinct shape) by 5% on an update
with 64-token answers (the sort workload's shape), and all three were level on short ones.
Padded query slots see their rectangle's first key only (no all-masked softmax) and are never read back.

It imports torch only; like the rest of models it holds no parallelism: with tensor parallelism each rank's q,
k, v hold its local heads, and the gathers are along the token dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Bucket:
    q_idx: torch.Tensor  # [S, Qmax] row slots of each segment's queries (padding: slot of its first key)
    k_idx: torch.Tensor  # [S, Kmax] row slots of each segment's keys: parent, then own (padding: as above)
    mask: torch.Tensor  # [S, 1, Qmax, Kmax] bool, True = may attend
    read: torch.Tensor  # [S * Qmax] bool: which query slots are real


@dataclass
class PackedLayout:
    """Segments of one packed row, ready for attention (CausalLM.forward(layout=...)); build with `build`."""

    buckets: list[_Bucket]
    order: torch.Tensor  # [N]: row slot n's output is at order[n] of the buckets' real query slots, concatenated
    sliding_window: int | None  # the window the masks hold: the model's own (CausalLM.forward checks)

    @staticmethod
    def build(segments: list[tuple[int, int, tuple[int, int] | None]], position_ids: torch.Tensor,
              sliding_window: int | None = None, device: torch.device | str | None = None) -> PackedLayout:
        """segments: (start, end, parent) of each segment, parent (start, end) or None; together the segments
        cover the row's slots 0..N-1 exactly once. position_ids [N]: each slot's position (causality and the
        window count positions, not slots)."""
        n = int(position_ids.numel())
        covered = torch.zeros(n, dtype=torch.long)
        for s, e, _ in segments:
            covered[s:e] += 1
        if not bool((covered == 1).all()):
            raise ValueError("packed layout: the segments must cover every slot of the row exactly once")
        pos = position_ids.reshape(-1).cpu()
        shapes = [(e - s, e - s + (0 if par is None else par[1] - par[0])) for s, e, par in segments]
        buckets, slot_of_query = [], []
        for members in _group(shapes):
            qm = max(shapes[i][0] for i in members)
            km = max(shapes[i][1] for i in members)
            q_idx = torch.empty(len(members), qm, dtype=torch.long)
            k_idx = torch.empty(len(members), km, dtype=torch.long)
            q_ok = torch.zeros(len(members), qm, dtype=torch.bool)
            k_ok = torch.zeros(len(members), km, dtype=torch.bool)
            for j, i in enumerate(members):
                s, e, par = segments[i]
                keys = torch.arange(s, e) if par is None else torch.cat([torch.arange(*par), torch.arange(s, e)])
                q_idx[j], k_idx[j] = keys[0], keys[0]
                q_idx[j, :e - s], k_idx[j, :len(keys)] = torch.arange(s, e), keys
                q_ok[j, :e - s], k_ok[j, :len(keys)] = True, True
            qp, kp = pos[q_idx], pos[k_idx]
            mask = (kp[:, None, :] <= qp[:, :, None]) & k_ok[:, None, :]
            if sliding_window is not None:
                mask &= kp[:, None, :] > qp[:, :, None] - sliding_window
            mask[:, :, 0] |= ~q_ok  # a padded query sees its first key only
            read = q_ok.reshape(-1)
            slot_of_query.append(q_idx.reshape(-1)[read])
            buckets.append(_Bucket(q_idx.to(device), k_idx.to(device), mask[:, None].to(device), read.to(device)))
        order = torch.empty(n, dtype=torch.long)
        order[torch.cat(slot_of_query)] = torch.arange(n)
        return PackedLayout(buckets, order.to(device), sliding_window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_fn, enable_gqa: bool) -> torch.Tensor:
        """q [1, H, N, D], k / v [1, KV, N, D] → [1, H, N, D]: each segment's attention, by attention_fn(q, k, v,
        mask, enable_gqa) on each bucket's gathered rectangles."""
        qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # [N, heads, D]
        outs = []
        for b in self.buckets:
            out = attention_fn(qt[b.q_idx].transpose(1, 2), kt[b.k_idx].transpose(1, 2), vt[b.k_idx].transpose(1, 2),
                               b.mask, enable_gqa)  # [S, H, Qmax, D]
            outs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])[b.read])  # real queries [n, H, D]
        flat = outs[0] if len(outs) == 1 else torch.cat(outs)
        return flat[self.order].transpose(0, 1)[None]


PAD_LIMIT = 1.25  # a bucket's padded rectangles are at most this many times their real area (measured, below)


def _group(shapes: list[tuple[int, int]], limit: float | None = None) -> list[list[int]]:
    """Segment indices in buckets of similar (queries, keys) shape: longest keys first, a bucket closed when its
    padded rectangles would exceed `limit` (PAD_LIMIT) times their real area."""
    limit = PAD_LIMIT if limit is None else limit
    buckets: list[list[int]] = []
    area = qm = km = 0
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][1], -shapes[i][0])):
        q, k = shapes[i]
        if buckets and (len(buckets[-1]) + 1) * max(qm, q) * max(km, k) <= limit * (area + q * k):
            buckets[-1].append(i)
            area, qm, km = area + q * k, max(qm, q), max(km, k)
        else:
            buckets.append([i])
            area, qm, km = q * k, q, k
    return buckets
