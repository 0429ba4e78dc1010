"""Ring attention: each context-parallel rank keeps its queries and passes its K, V blocks around the ring.

    rank r holds q, k, v of its sequence chunks (zigzag: chunks r and 2cp-1-r of 2cp equal chunks)
    step s = 0 .. cp-1: attend r's queries to the K, V block of rank (r - s) mod cp, then send that block to
                        rank r+1 and receive the next one from rank r-1 (the transfer overlaps the compute)

Each (query chunk, key chunk) pair whose keys all lie after its queries is skipped (causal block skipping);
with the zigzag layout every rank then computes the same number of pairs, so no rank waits for another.
The blocks' partial results merge exactly by their log-sum-exp (the online softmax of flash attention):

    lse = logaddexp(lse_a, lse_b)        out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

The backward is flash attention's, block by block, recomputing each block's probabilities from the saved lse
(so only q, k, v, out and lse are kept for it, all of this rank's T/cp tokens):

    P = exp(S - lse)   dV += P^T dO   dP = dO V^T   dS = P (dP - rowsum(dO * O))   dQ += dS K c   dK += dS^T Q c

K, V go round the ring again, and the dK, dV accumulators travel with them; one more pass after the last step
brings each block's gradient home to the rank that owns it.

GQA: query head i uses KV head i // (H / KV), as in the model; K, V travel with their KV heads only.

It imports torch only; it must never import another relayrl layer (models, the trainer, ...): they import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

Span = tuple[int, int]  # [start, stop) slots of the full sequence
MaskFn = Callable[[Span, Span], "Tensor | None"]  # bool [B, 1, q, k] (True = may attend), None = all allowed


def _ring_pass(tensors: Sequence[Tensor], group) -> tuple[list, list[Tensor]]:
    """Start sending `tensors` to the next rank of the ring and receiving as many from the previous one."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in received]
    return dist.batch_isend_irecv(ops), received


def _wait(works) -> None:
    for w in works:
        w.wait()


def _pairs(q_spans: Sequence[Span], k_spans: Sequence[Span]):
    """(local q offset, q span, local k offset, k span) of every chunk pair that is not all in the future."""
    q_off = 0
    for qs in q_spans:
        k_off = 0
        for ks in k_spans:
            if ks[0] < qs[1]:  # some key at or before some query
                yield q_off, qs, k_off, ks
            k_off += ks[1] - ks[0]
        q_off += qs[1] - qs[0]


def _block_scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """q [B, KV, g, tq, D], k [B, KV, tk, D] → scores [B, KV, g, tq, tk], -inf where masked."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask[:, :, None], float("-inf"))


def _finite(lse: Tensor) -> Tensor:
    """lse with -inf (a row that saw no key yet) replaced by 0, so exp(x - lse) stays 0 instead of NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spans, mask_fn, group):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        B, H, T, D = q.shape
        KV = k.shape[1]
        scale = D ** -0.5
        qg = q.float().unflatten(1, (KV, H // KV))
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = (k, v)
        for s in range(n):
            works, nxt = _ring_pass(kv, group) if s < n - 1 else ([], None)
            kb, vb = kv[0].float(), kv[1].float()
            for qo, qs, ko, ks in _pairs(spans[r], spans[(r - s) % n]):
                tq, tk = qs[1] - qs[0], ks[1] - ks[0]
                sc = _block_scores(qg[:, :, :, qo:qo + tq], kb[:, :, ko:ko + tk], mask_fn(qs, ks), scale)
                b_lse = torch.logsumexp(sc, -1)
                b_out = torch.matmul(torch.exp(sc - _finite(b_lse)[..., None]), vb[:, :, None, ko:ko + tk])
                a_lse = lse[..., qo:qo + tq]
                new = _finite(torch.logaddexp(a_lse, b_lse))
                out[:, :, :, qo:qo + tq] = (out[:, :, :, qo:qo + tq] * torch.exp(a_lse - new)[..., None]
                                            + b_out * torch.exp(b_lse - new)[..., None])
                lse[..., qo:qo + tq] = torch.logaddexp(a_lse, b_lse)
            _wait(works)
            kv = nxt if nxt is not None else kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.mask_fn, ctx.group, ctx.scale = spans, mask_fn, group, scale
        return out.flatten(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        spans, mask_fn, group, scale = ctx.spans, ctx.mask_fn, ctx.group, ctx.scale
        n, r = dist.get_world_size(group), dist.get_rank(group)
        KV = k.shape[1]
        qg = q.float().unflatten(1, (KV, q.shape[1] // KV))
        do = grad.float().unflatten(1, qg.shape[1:3])
        delta = (do * out).sum(-1)  # rowsum(dO * O): [B, KV, g, T]
        dq = torch.zeros_like(qg)
        kv = (k, v)
        dkv = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
        for s in range(n):
            works, nxt = _ring_pass(kv, group) if s < n - 1 else ([], None)
            kb, vb = kv[0].float(), kv[1].float()
            dk, dv = dkv
            for qo, qs, ko, ks in _pairs(spans[r], spans[(r - s) % n]):
                tq, tk = qs[1] - qs[0], ks[1] - ks[0]
                qq, dd = qg[:, :, :, qo:qo + tq], do[:, :, :, qo:qo + tq]
                kk, vv = kb[:, :, ko:ko + tk], vb[:, :, ko:ko + tk]
                p = torch.exp(_block_scores(qq, kk, mask_fn(qs, ks), scale) - lse[..., qo:qo + tq, None])
                dv[:, :, ko:ko + tk] += torch.einsum("bkgqt,bkgqd->bktd", p, dd)
                ds = p * (torch.matmul(dd, vv.unsqueeze(2).transpose(-1, -2)) - delta[..., qo:qo + tq, None])
                dq[:, :, :, qo:qo + tq] += torch.matmul(ds, kk.unsqueeze(2)) * scale
                dk[:, :, ko:ko + tk] += torch.einsum("bkgqt,bkgqd->bktd", ds, qq) * scale
            _wait(works)
            if n > 1:  # the block's gradient moves on with it (after the last step: home to its owner)
                works, dkv = _ring_pass(dkv, group)
                _wait(works)
            kv = nxt if nxt is not None else kv
        dk, dv = dkv
        return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, spans: Sequence[Sequence[Span]], mask_fn: MaskFn,
                   group) -> Tensor:
    """Attention of this rank's queries over the whole sequence held across the ring `group`.

    q [B, H, t, D], k / v [B, KV, t, D]: this rank's tokens, its spans' slots in order; spans[i] are rank i's
    spans of the full sequence; mask_fn(q_span, k_span) gives that block's mask. Returns [B, H, t, D]."""
    return _RingAttention.apply(q, k, v, spans, mask_fn, group)
