"""This module computes the trainer-side logprobs, by the definition the engine's sampler reports (see
relayrl.engine.sampler).

    logp[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]     (logp[:, 0] = 0)

over the full vocabulary, computed in fp32 whatever the model's dtype.

Padding-free: sequences are packed into rows (first-fit, each row at most as long as the longest
sequence) with segment ids (attention stays within a sequence) and positions restarting per
sequence, so the linear layers spend nothing on padding; the result is unpacked to the padded
[B, T] layout and equals the padded computation.

Shared prefix (padding-free with prefix_lens): the G samples of a prompt hold the same prompt tokens; they are
computed once, and each sample's response attends to them (parent segments, relayrl.models.transformer). A
step then computes about P + G R tokens per prompt instead of G (P + R), with the same logprobs, losses and
gradients.

It imports torch, relayrl.models and relayrl.parallel only; like all of the trainer, it must never
import the engine, sync, the controller or the CLI. The two sides share the definition, not code.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor

from relayrl.models import CausalLM
from relayrl.parallel.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy
from relayrl.trainer.batch import TrainBatch


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
    prefix_lens: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [B, T], entropy [B, T] or None) for right-padded rows; entropy is that of the
    temperature-scaled distribution at each token's position. entropy_grad=False: the entropy is a
    statistic (no gradient, no graph: backward keeps one [B, T, V] fp32 tensor fewer).

    tp_group: the model is tensor-parallel and returns vocab-sharded logits; the logprobs are then
    computed shard-wise (relayrl.parallel.vocab_parallel), never gathering the vocabulary.

    prefix_lens (padding-free only): row i's first prefix_lens[i] tokens may be shared; rows whose prefixes are
    equal (the samples of one prompt) compute them once (see _packed_logprobs). The result is the same."""
    if padding_free:
        return _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy, tp_group, entropy_grad,
                                prefix_lens)
    if prefix_lens is not None:
        raise ValueError("prefix_lens needs padding_free=True (shared prefixes are a packed layout)")
    logits = model(input_ids, attention_mask=attention_mask)[:, :-1]
    logp, ent = _from_logits(logits, input_ids[:, 1:], temperature, with_entropy, tp_group, entropy_grad)
    return _shift_pad(logp), _shift_pad(ent)


@torch.no_grad()
def frozen_logprobs(model: CausalLM, batch: TrainBatch, temperature: float, micro_batch_size: int, *,
                    padding_free: bool = False, shared_prefix: bool = False, tp_group=None) -> torch.Tensor:
    """A frozen model's logprobs [B, T] of the batch's response tokens (0 elsewhere), in micro-batches of rows
    (the reference model's pass; padding_free and shared_prefix as the trainer's settings)."""
    def rows(b: TrainBatch) -> torch.Tensor:
        parts = []
        for mb in b.split(micro_batch_size):
            prefix = prompt_lens(mb.response_mask, mb.attention_mask) if shared_prefix else None
            logp, _ = token_logprobs(model, mb.input_ids, mb.attention_mask, temperature, padding_free=padding_free,
                                     tp_group=tp_group, prefix_lens=prefix)
            parts.append(logp * mb.response_mask)
        return torch.cat(parts)

    return by_prompt(batch, rows) if shared_prefix else rows(batch)


def by_prompt(batch: TrainBatch, per_row) -> torch.Tensor:
    """per_row(rows) [B, ...] computed with the batch's rows grouped by prompt (prompt_order), so consecutive
    micro-batches hold whole groups, and returned in the batch's own row order."""
    order = prompt_order(batch)
    return per_row(batch.select(order))[order.argsort()]


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: unit indices (a sequence, or a shared prompt with its samples) grouped into rows of
    at most `capacity` tokens. Rows as long as the longest unit keep attention (quadratic per row) no dearer
    than one row per unit, while the linear layers see no padding at all."""
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


def prompt_lens(response_mask: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """Each row's tokens before its first loss token: what its prompt's samples share (a row without loss
    tokens, all of its tokens)."""
    has = response_mask.sum(-1) > 0
    first = (response_mask > 0).float().argmax(-1)
    return torch.where(has, first, attention_mask.sum(-1)).tolist()


def computed_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_lens: list[int] | None,
                    hidden_size: int) -> int:
    """Tokens a padding-free forward computes: every row's real tokens, each shared prefix once per unit."""
    lengths = attention_mask.sum(-1).tolist()
    if prefix_lens is None:
        return int(sum(lengths))
    units = prefix_units(input_ids, [min(p, n) for p, n in zip(prefix_lens, lengths, strict=True)], lengths,
                         hidden_size)
    return sum(p + sum(lengths[i] - p for i in rows) for p, rows in units)


def samples_per_prefix(prefix: int, response: float, hidden_size: int) -> int:
    """How many samples one copy of a prefix serves, at the least cost of a packed unit under dense attention
    (a boolean mask: every query-key pair of the unit is computed, the masked ones too).

    A unit of P + k R tokens costs about (P + k R) c h^2 in its per-token work and (P + k R)^2 h in attention,
    so per sample the cost is least at k = sqrt(P (c h + P)) / R: many samples per prompt when the responses
    are short beside it, one (no sharing) when they are long, where the responses' attention to each other
    outweighs the prompt tokens saved. c = 24 was measured, not derived: the matmuls alone would give 6, but a
    token's norms, activations and loss cost more than its share of FLOPs: on the CPU one update was fastest at
    k = 8 (of 8) on bench_shared_prefix's three GRPO shapes, and within 6% of k = 4 on its long-answer shape,
    where c = 6 picks 7 and 4 (bench_shared_prefix.py --force-k; RESULTS.md)."""
    if response <= 0:
        return 1 << 30
    return max(1, round(math.sqrt(prefix * (24 * hidden_size + prefix)) / response))


def prefix_units(input_ids: torch.Tensor, prefix_lens: list[int], lengths: list[int],
                 hidden_size: int) -> list[tuple[int, list[int]]]:
    """[(prefix length, rows)]: the packed units, each a group's prefix with up to samples_per_prefix of its
    rows (a group of one row, or without a prefix, is one unit)."""
    units = []
    for p, rows in shared_prefix_groups(input_ids, prefix_lens):
        k = samples_per_prefix(p, sum(lengths[i] - p for i in rows) / len(rows), hidden_size) if p else 1
        units += [(p, rows[j:j + k]) for j in range(0, len(rows), k)]
    return units


def prompt_order(batch: TrainBatch) -> torch.Tensor:
    """A permutation of the batch's rows that puts the rows of each prompt next to each other (prompts in order
    of first appearance), so that micro-batches of consecutive rows hold whole groups and share their prompts."""
    groups = shared_prefix_groups(batch.input_ids, prompt_lens(batch.response_mask, batch.attention_mask))
    return torch.tensor([i for _, rows in groups for i in rows], dtype=torch.long)


def shared_prefix_groups(input_ids: torch.Tensor, prefix_lens: list[int]) -> list[tuple[int, list[int]]]:
    """[(prefix length, rows)]: rows whose first prefix_lens[i] tokens are equal (the G samples of a prompt)
    share one computation of them. A row whose prefix_lens is 0 is a group of its own with no prefix."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prefix_lens):
        key = (p, *input_ids[i, :p].tolist()) if p > 0 else ("row", i)
        groups.setdefault(key, []).append(i)
    return [(key[0] if key[0] != "row" else 0, rows) for key, rows in groups.items()]


def _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy, tp_group=None, entropy_grad=True,
                     prefix_lens: list[int] | None = None):
    """The padding-free forward; with prefix_lens, the shared-prefix one.

    A unit is a group's prefix followed by every member's remaining tokens (without a prefix: one row's tokens),

        tokens     [ p p p p | a a a | b b | c c c c ]   segments: the prefix's, then one per member whose
        positions    0 1 2 3   4 5 6   4 5   4 5 6 7     parent is the prefix's (it attends to the prefix too)

    so the prefix is computed once per unit (a group's rows split into units by samples_per_prefix). Units are
    packed into rows first-fit (pack_rows). Token t of row i is read at the slot holding its token t - 1: a
    (slot, token) pair, which the prefix's rows share, except at its last slot, which predicts each member's
    first own token (one pair per member)."""
    device, input_ids = input_ids.device, input_ids.cpu()  # the layout is built on the host, then moved
    B, T = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    prefix_lens = [0] * B if prefix_lens is None else [min(p, n) for p, n in zip(prefix_lens, lengths, strict=True)]
    groups = prefix_units(input_ids, prefix_lens, lengths, model.config.hidden_size)
    units = [p + sum(lengths[i] - p for i in rows) for p, rows in groups]  # what computed_tokens sums
    placed = pack_rows(units, max(units))
    L = max(sum(units[u] for u in row) for row in placed)
    R = len(placed)
    packed = torch.zeros(R * L, dtype=input_ids.dtype)
    seg = torch.full((R * L,), -1)  # -1: the padding at the end of a row
    parent = torch.full((R * L,), -2)  # -2: no parent segment
    pos = torch.zeros(R * L, dtype=torch.long)
    # the (slot, next token) pairs whose logprobs are read, and for each row's token t the pair that is its
    # logprob (-1: none); a prefix's pairs serve all its rows, its last slot one pair per row
    pair_slots, pair_tokens, count = [], [], [0]
    src = torch.full((B, T), -1, dtype=torch.long)

    def pairs(slots: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        pair_slots.append(slots)
        pair_tokens.append(tokens)
        count[0] += len(slots)
        return torch.arange(count[0] - len(slots), count[0])

    for r, row in enumerate(placed):
        off = r * L
        for u in row:
            p, members = groups[u]
            g = B + u  # the prefix's segment id; a member's is its row index
            if p > 0:
                first = members[0]
                packed[off:off + p] = input_ids[first, :p]
                seg[off:off + p], pos[off:off + p] = g, torch.arange(p)
                if p > 1:
                    src[members, 1:p] = pairs(torch.arange(off, off + p - 1), input_ids[first, 1:p])
                last, off = off + p - 1, off + p
                for i in members:  # each own first token is predicted by the prefix's last slot
                    if lengths[i] > p:
                        src[i, p] = pairs(torch.tensor([last]), input_ids[i, p:p + 1])
            for i in members:
                n, k = lengths[i], lengths[i] - p
                packed[off:off + k] = input_ids[i, p:n]
                seg[off:off + k], parent[off:off + k], pos[off:off + k] = i, g, torch.arange(p, n)
                if k > 1:
                    src[i, p + 1:n] = pairs(torch.arange(off, off + k - 1), input_ids[i, p + 1:n])
                off += k
    empty = torch.zeros(0, dtype=torch.long)
    slots, tokens = torch.cat(pair_slots or [empty]), torch.cat(pair_tokens or [empty])
    packed, seg, parent, pos, src, slots, tokens = (
        t.to(device) for t in (packed, seg, parent, pos, src, slots, tokens))
    logits = model(packed.view(R, L), attention_mask=(seg >= 0).long().view(R, L), position_ids=pos.view(R, L),
                   segment_ids=seg.view(R, L), parent_ids=parent.view(R, L) if any(prefix_lens) else None)
    # only the read slots reach the log-softmax (what backward keeps: one row per pair, as padded rows keep s - 1)
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    logp_p, ent_p = _from_logits(local.reshape(R * L, -1)[slots], tokens, temperature, with_entropy, tp_group,
                                 entropy_grad)
    has, at = src >= 0, src.clamp(min=0)
    ent = torch.where(has, ent_p[at], 0.0) if with_entropy else None
    return torch.where(has, logp_p[at], 0.0), ent
