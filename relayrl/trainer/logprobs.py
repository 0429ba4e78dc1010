"""This module computes the trainer-side logprobs, by the definition the engine's sampler reports (see
relayrl.engine.sampler).

    logp[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]     (logp[:, 0] = 0)

over the full vocabulary, computed in fp32 whatever the model's dtype.

Padding-free: sequences are packed into rows (first-fit, each row at most as long as the longest
sequence) with segment ids (attention stays within a sequence) and positions restarting per
sequence, so the linear layers spend nothing on padding; the result is unpacked to the padded
[B, T] layout and equals the padded computation.

It imports torch, relayrl.models and relayrl.parallel only; like all of the trainer, it must never
import the engine, sync, the controller or the CLI. The two sides share the definition, not code.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor

from relayrl.models import CausalLM
from relayrl.parallel.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, tp_group=None,
                 entropy_grad: bool = True):
    if tp_group is not None:
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        if with_entropy:
            return vocab_parallel_logprobs_and_entropy(local, targets, tp_group, temperature, grad=entropy_grad)
        return vocab_parallel_logprobs(local, targets, tp_group, temperature), None
    logits = logits.float() / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    # a statistic only: no graph, so backward keeps no exp(log p) of [B, T, V] beside log_softmax's output
    with nullcontext() if entropy_grad else torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def _shift_pad(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else torch.nn.functional.pad(x, (1, 0))


def token_logprobs(
    model: CausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    padding_free: bool = False,
    tp_group=None,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [B, T], entropy [B, T] or None) for right-padded rows; entropy is that of the
    temperature-scaled distribution at each token's position. entropy_grad=False: the entropy is a
    statistic (no gradient, no graph: backward keeps one [B, T, V] fp32 tensor fewer).

    tp_group: the model is tensor-parallel and returns vocab-sharded logits; the logprobs are then
    computed shard-wise (relayrl.parallel.vocab_parallel), never gathering the vocabulary."""
    if padding_free:
        return _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy, tp_group, entropy_grad)
    logits = model(input_ids, attention_mask=attention_mask)[:, :-1]
    logp, ent = _from_logits(logits, input_ids[:, 1:], temperature, with_entropy, tp_group, entropy_grad)
    return _shift_pad(logp), _shift_pad(ent)


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: sequence indices grouped into rows of at most `capacity` tokens.
    Rows as long as the longest sequence keep attention (quadratic per row) no dearer than padding,
    while the linear layers see no padding at all."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy, tp_group=None, entropy_grad=True):
    B, T = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    rows = pack_rows(lengths, max(lengths))
    L = max(sum(lengths[i] for i in row) for row in rows)
    packed = torch.zeros(len(rows), L, dtype=input_ids.dtype)
    seg = torch.full((len(rows), L), -1)  # -1: the padding at the end of a row
    pos = torch.zeros(len(rows), L, dtype=torch.long)
    where = {}  # sequence -> (row, offset)
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            n = lengths[i]
            packed[r, off:off + n] = input_ids[i, :n]
            seg[r, off:off + n] = i
            pos[r, off:off + n] = torch.arange(n)
            where[i] = (r, off)
            off += n
    logits = model(packed, attention_mask=(seg >= 0).long(), position_ids=pos, segment_ids=seg)[:, :-1]
    logp_p, ent_p = _from_logits(logits, packed[:, 1:], temperature, with_entropy, tp_group, entropy_grad)
    logp = torch.zeros(B, T, dtype=logp_p.dtype)
    ent = torch.zeros(B, T, dtype=logp_p.dtype) if with_entropy else None
    for i, (r, off) in where.items():
        n = lengths[i]
        # packed position off + t - 1 predicts token t of sequence i (t >= 1)
        logp[i, 1:n] = logp_p[r, off:off + n - 1]
        if with_entropy:
            ent[i, 1:n] = ent_p[r, off:off + n - 1]
    return logp, ent
