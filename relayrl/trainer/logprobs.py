"""This module computes the trainer-side logprobs, by the definition the engine's sampler reports (see
relayrl.engine.sampler).

    logp[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]     (logp[:, 0] = 0)

over the full vocabulary, computed in fp32 whatever the model's dtype.

Padding-free: the sequences are laid end to end in one packed row, positions restarting per sequence, and
attention runs per sequence over gathered keys (relayrl.models.packed), so neither the linear layers nor
attention spend anything on padding or on another sequence; the result is unpacked to the padded [B, T] layout
and equals the padded computation.

Shared prefix (padding-free with prefix_lens): the G samples of a prompt hold the same prompt tokens; they are
computed once, and each sample's response attends to them (a segment whose parent is the prompt's). A step
then computes P + G R tokens per prompt instead of G (P + R), and attention P^2 + G R (P + R) query-key
pairs instead of G (P + R)^2, with the same logprobs, losses and gradients.

One runner (LogprobRunner) computes a batch's logprobs forward only, in micro-batches, for every caller: the actor's
old-logprob pass, its LoRA reference (adapters off) and the reference model's, a pipeline (pp > 1) one branch of it;
what differs between them (autocast, how rows are cut, the data-parallel ranks' equal forwards) is a setting.

It imports torch, relayrl.models, relayrl.parallel and the trainer's own modules only; like all of the trainer, it
must never import the engine, sync, the controller or the CLI. The two sides share the definition, not code.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from relayrl.models import CausalLM
from relayrl.models.config import MoEShape
from relayrl.models.linear import packed_rows
from relayrl.models.moe import Routing
from relayrl.models.packed import PackedLayout
from relayrl.parallel.device import module_device
from relayrl.parallel.vocab_parallel import (
    full_vocab_logprobs,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_and_entropy,
)
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.pipelined import micro_batches, pad_rows
from relayrl.trainer.routing import replay_routing


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool, tp_group=None,
                 entropy_grad: bool = True):
    if tp_group is not None:
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        if with_entropy:
            return vocab_parallel_logprobs_and_entropy(local, targets, tp_group, temperature, grad=entropy_grad)
        return vocab_parallel_logprobs(local, targets, tp_group, temperature), None
    return full_vocab_logprobs(logits, targets, temperature, with_entropy, entropy_grad)


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
    routing: Routing | None = None,
    cp=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [B, T], entropy [B, T] or None) for right-padded rows; entropy is that of the
    temperature-scaled distribution at each token's position. entropy_grad=False: the entropy is a
    statistic (no gradient, no graph: backward keeps one [B, T, V] fp32 tensor fewer).

    tp_group: the model is tensor-parallel and returns vocab-sharded logits; the logprobs are then
    computed shard-wise (relayrl.parallel.vocab_parallel), never gathering the vocabulary.

    prefix_lens (padding-free only): row i's first prefix_lens[i] tokens may be shared; rows whose prefixes are
    equal (the samples of one prompt) compute them once (see _packed_logprobs). The result is the same.

    routing (MoE models): replay [B, T, n_moe, k] in these rows' layout (-1: route), and the record, which comes
    back in these rows' layout too, whatever the forward's: logits [B, T, E], selected [B, T, k] per MoE layer
    (a shared prompt's tokens read from its one computation in every row that holds it).

    cp (a relayrl.parallel.context_parallel.ContextParallel over the model): padded rows only; this rank computes
    its shard of the sequence and the logprobs come back whole (see _cp_logprobs)."""
    if cp is not None:
        if padding_free or routing is not None:
            raise ValueError("context parallelism shards padded rows without routing replay: padding_free=False")
        return _cp_logprobs(cp, input_ids, attention_mask, temperature, with_entropy, tp_group, entropy_grad)
    if padding_free:
        return _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy, tp_group, entropy_grad,
                                prefix_lens, routing)
    if prefix_lens is not None:
        raise ValueError("prefix_lens needs padding_free=True (shared prefixes are a packed layout)")
    logits = model(input_ids, attention_mask=attention_mask, routing=routing)[:, :-1]
    logp, ent = _from_logits(logits, input_ids[:, 1:], temperature, with_entropy, tp_group, entropy_grad)
    return _shift_pad(logp), _shift_pad(ent)


def _cp_logprobs(cp, input_ids, attention_mask, temperature, with_entropy, tp_group, entropy_grad):
    """Context parallel: the rows padded to a multiple of the cp layout's chunks, this rank's slots' next-token
    logprobs (slot s predicts token s + 1) computed on its shard, then gathered whole on every cp rank. The gather's
    backward keeps this rank's part, so a loss over the whole rows (global denominators, the same on every cp
    rank) gives each rank the gradient of its own tokens, and FSDP's sum over dp_shard x cp the full one."""
    T = input_ids.shape[1]
    pad = -T % cp.seq_multiple
    ids, attn = F.pad(input_ids, (0, pad)), F.pad(attention_mask, (0, pad))
    logits = cp(ids, attention_mask=attn)
    logp, ent = _from_logits(logits, cp.shard(F.pad(ids[:, 1:], (0, 1))), temperature, with_entropy, tp_group,
                             entropy_grad)
    logp = cp.gather(logp)[:, :T - 1]
    ent = cp.gather(ent)[:, :T - 1] if ent is not None else None
    return _shift_pad(logp), _shift_pad(ent)


class LogprobRunner:
    """Logprobs [B, T] of a batch's response tokens (0 elsewhere), forward only, in micro-batches: the one pass behind
    the actor's old logprobs, its LoRA reference (the same pass, adapters off) and the reference model's
    (relayrl.trainer.reference).

        batch ──shared_prefix: rows grouped by prompt (by_prompt)──> micro-batches (split_rows) ──> token_logprobs
          │                                                                 × response_mask, back in the batch's order
          └──pipe: relayrl.trainer.pipelined's equal micro-batches through the stages (pp > 1)

    What differs between its callers is a setting, each caller's numerics its own to the bit:
        bf16       the forward under bf16 autocast, as the actor's update runs it (trainer.bf16); off: the model's
                   own dtype (the reference model)
        even       ceil(B / micro_batch_size) micro-batches of near-equal rows, the cut the actor's update takes;
                   off: chunks of micro_batch_size rows, the last the remainder (the reference model's)
        dp_group   every data-parallel rank runs as many forwards (a sharded model's are collective)
    Micro-batches go to `device` (default: the model's) one at a time; the logprobs come back on the batch's device."""

    def __init__(self, model: CausalLM, temperature: float, micro_batch_size: int, device=None, *,
                 padding_free: bool = False, shared_prefix: bool = False, routing_replay: bool = False,
                 bf16: bool = False, even: bool = True, tp_group=None, dp_group=None, cp=None, pipe=None):
        self.model, self.temperature, self.micro_batch_size = model, temperature, micro_batch_size
        self.device = torch.device(device) if device is not None else module_device(model)
        self.padding_free, self.shared_prefix, self.routing_replay = padding_free, shared_prefix, routing_replay
        self.bf16, self.even = bf16, even
        self.tp_group, self.dp_group, self.cp, self.pipe = tp_group, dp_group, cp, pipe

    @torch.no_grad()
    def __call__(self, batch: TrainBatch) -> torch.Tensor:
        self.model.eval()
        if self.pipe is not None:
            return self._pipelined(batch)
        return by_prompt(batch, self._rows) if self.shared_prefix else self._rows(batch)

    def _rows(self, batch: TrainBatch) -> torch.Tensor:
        micro = split_rows(batch, self.micro_batch_size, self.device, even=self.even, dp_group=self.dp_group)
        return per_token(batch, self._forward, micro, self.bf16)

    def _forward(self, mb: TrainBatch) -> torch.Tensor:
        prefix = prompt_lens(mb.response_mask, mb.attention_mask) if self.shared_prefix else None
        return token_logprobs(self.model, mb.input_ids, mb.attention_mask, self.temperature,
                              padding_free=self.padding_free, tp_group=self.tp_group, prefix_lens=prefix,
                              routing=replay_routing(mb.routing, self.routing_replay), cp=self.cp)[0]

    def _pipelined(self, batch: TrainBatch) -> torch.Tensor:
        """pp > 1: the rows padded to the pipeline's equal micro-batches (the same shapes on every dp rank), the
        logprobs of every pp rank's copy cut back to [B, T]."""
        B, T = batch.input_ids.shape
        m, per, length = micro_batches(batch, self.micro_batch_size, self.dp_group)
        rows = pad_rows(batch, m, per, length).to(self.device)
        with autocast(self.device, self.bf16):
            logp = self.pipe.logprobs(rows.input_ids, m, self.temperature, tp_group=self.tp_group,
                                      attention_mask=rows.attention_mask)
        return (logp[:B, :T] * batch.response_mask.to(logp.device)).to(batch.response_mask.device)


def autocast(device: torch.device, bf16: bool):
    """The forward's precision: bf16 autocast on the device's type (trainer.bf16), or the model's own dtype."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


@torch.no_grad()
def per_token(batch: TrainBatch, forward, micro, bf16: bool = False) -> torch.Tensor:
    """forward(micro-batch) -> [b, T] over `micro` (split_rows' (micro-batch, is_real) pairs; no grad, bf16:
    under autocast), masked to the response tokens, on the batch's device; stand-ins run, their output dropped."""
    parts = []
    for mb, real in micro:
        with autocast(mb.input_ids.device, bf16):
            out = forward(mb).float()
        if real:
            parts.append(out * mb.response_mask)
    return torch.cat(parts).to(batch.response_mask.device) if parts else torch.zeros_like(batch.response_mask)


def split_rows(rows: TrainBatch, size: int, device, *, even: bool = True, dp_group=None,
               template: TrainBatch | None = None):
    """Yields (micro-batch on `device`, is_real) over `rows`, at most `size` rows each: even, ceil(B / size)
    micro-batches of near-equal rows; otherwise chunks of `size` rows, the last the remainder. dp_group: the SAME
    number on every data-parallel rank (FSDP and DDP run collectives in each forward / backward, so all ranks must
    run as many); a rank with too few rows runs a stand-in, the template's first row with no loss tokens (no
    loss, no gradient, no stats)."""
    k = max(1, -(-len(rows) // size))
    if dp_group is not None:
        t = torch.tensor([k])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        k = int(t)
    bounds = [len(rows) * i // k if even else min(len(rows), size * i) for i in range(k + 1)]
    template = rows if template is None else template
    for a, b in itertools.pairwise(bounds):
        if b > a:
            yield rows.select(slice(a, b)).to(device), True
        else:
            stand_in = template.select(slice(0, 1))
            yield stand_in.replace(response_mask=torch.zeros_like(stand_in.response_mask)).to(device), False


def by_prompt(batch: TrainBatch, per_row) -> torch.Tensor:
    """per_row(rows) [B, ...] computed with the batch's rows grouped by prompt (prompt_order), so consecutive
    micro-batches hold whole groups, and returned in the batch's own row order."""
    order = prompt_order(batch)
    return per_row(batch.select(order))[order.argsort()]


def prompt_lens(response_mask: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """Each row's tokens before its first loss token: what its prompt's samples share (a row without loss
    tokens, all of its tokens)."""
    has = response_mask.sum(-1) > 0
    first = (response_mask > 0).float().argmax(-1)
    return torch.where(has, first, attention_mask.sum(-1)).tolist()


def computed_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix_lens: list[int] | None) -> int:
    """Tokens a padding-free forward computes: every row's real tokens, each shared prefix once."""
    lengths = attention_mask.sum(-1).tolist()
    if prefix_lens is None:
        return int(sum(lengths))
    groups = shared_prefix_groups(input_ids, [min(p, n) for p, n in zip(prefix_lens, lengths, strict=True)])
    return sum(p + sum(lengths[i] - p for i in rows) for p, rows in groups)


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


def _filler_tokens(model, n: int, device, tp_group, routing) -> int:
    """How many filler tokens round a packed row of n up to the row count its linears are compiled for
    (relayrl.models.linear.packed_rows; 0 where they pad nothing). Filler is its own segment: it attends to itself
    only and no logprob reads it, so nothing it computes reaches a loss or a gradient. None under tensor
    parallelism (its linears are torch's sharded ops), with an MoE model or routing replay (filler would be routed
    to experts)."""
    if tp_group is not None or routing is not None or isinstance(model.config, MoEShape):
        return 0
    dtype = next(model.parameters()).dtype
    return packed_rows(n, model.config.hidden_size, dtype, device) - n


def _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy, tp_group=None, entropy_grad=True,
                     prefix_lens: list[int] | None = None, routing: Routing | None = None):
    """The padding-free forward; with prefix_lens, the shared-prefix one.

    Every token is laid once in one packed row (relayrl.models.packed): a group's prefix, then each member's
    remaining tokens (without a prefix: one row's tokens),

        tokens     [ p p p p | a a a | b b | c c c c ]   segments: the prefix's, then one per member whose
        positions    0 1 2 3   4 5 6   4 5   4 5 6 7     parent is the prefix (it attends to the prefix too)

    and attention runs per segment over its gathered keys, so no token pays for another sequence's attention.
    Where the linears run on oneDNN the row ends in filler tokens up to their row bucket (_filler_tokens).
    Token t of row i is read at the slot holding its token t - 1: a (slot, token) pair, which the prefix's rows
    share, except at its last slot, which predicts each member's first own token (one pair per member).

    Routing: holder[n] is one (row, token) slot n holds (a prefix's: the group's first member's), by which a replay
    is laid into the packed row; slot_of[i, t] is the slot holding row i's token t (-1: padding), by which the
    record is read back into rows."""
    device, input_ids = input_ids.device, input_ids.cpu()  # the layout is built on the host, then moved
    B, T = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    prefix_lens = [0] * B if prefix_lens is None else [min(p, n) for p, n in zip(prefix_lens, lengths, strict=True)]
    groups = shared_prefix_groups(input_ids, prefix_lens)
    N = sum(p + sum(lengths[i] - p for i in rows) for p, rows in groups)  # what computed_tokens sums
    packed = torch.zeros(N, dtype=input_ids.dtype)
    pos = torch.zeros(N, dtype=torch.long)
    segments: list[tuple[int, int, tuple[int, int] | None]] = []
    # the (slot, next token) pairs whose logprobs are read, and for each row's token t the pair that is its
    # logprob (-1: none); a prefix's pairs serve all its rows, its last slot one pair per row
    pair_slots, pair_tokens, count = [], [], [0]
    src = torch.full((B, T), -1, dtype=torch.long)
    slot_of = torch.full((B, T), -1, dtype=torch.long)
    holder = torch.zeros(N, 2, dtype=torch.long)  # per slot, one (row, token) it holds

    def pairs(slots: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        pair_slots.append(slots)
        pair_tokens.append(tokens)
        count[0] += len(slots)
        return torch.arange(count[0] - len(slots), count[0])

    off = 0
    for p, members in groups:
        parent = None
        if p > 0:
            first = members[0]
            packed[off:off + p], pos[off:off + p] = input_ids[first, :p], torch.arange(p)
            slot_of[members, :p] = torch.arange(off, off + p)
            holder[off:off + p, 0], holder[off:off + p, 1] = first, torch.arange(p)
            segments.append((off, off + p, None))
            parent = (off, off + p)
            if p > 1:
                src[members, 1:p] = pairs(torch.arange(off, off + p - 1), input_ids[first, 1:p])
            for i in members:  # each own first token is predicted by the prefix's last slot
                if lengths[i] > p:
                    src[i, p] = pairs(torch.tensor([off + p - 1]), input_ids[i, p:p + 1])
            off += p
        for i in members:
            n, k = lengths[i], lengths[i] - p
            if k == 0:
                continue
            packed[off:off + k], pos[off:off + k] = input_ids[i, p:n], torch.arange(p, n)
            slot_of[i, p:n] = torch.arange(off, off + k)
            holder[off:off + k, 0], holder[off:off + k, 1] = i, torch.arange(p, n)
            segments.append((off, off + k, parent))
            if k > 1:
                src[i, p + 1:n] = pairs(torch.arange(off, off + k - 1), input_ids[i, p + 1:n])
            off += k
    fill = _filler_tokens(model, N, device, tp_group, routing)
    if fill:  # a segment of its own that no pair reads: the linears meet their row bucket and copy nothing
        packed, pos = torch.cat([packed, torch.zeros(fill, dtype=packed.dtype)]), torch.cat([pos, torch.arange(fill)])
        segments.append((N, N + fill, None))
        N += fill
    empty = torch.zeros(0, dtype=torch.long)
    slots, tokens = torch.cat(pair_slots or [empty]), torch.cat(pair_tokens or [empty])
    layout = PackedLayout.build(segments, pos, model.config.sliding_window, device)
    packed, pos, src, slots, tokens = (t.to(device) for t in (packed, pos, src, slots, tokens))
    row_routing = routing
    if routing is not None:  # the forward's own Routing over the packed row
        replay = None
        if routing.replay is not None:
            rows, toks = holder.to(routing.replay.device).unbind(-1)
            replay = routing.replay[rows, toks].view(1, N, *routing.replay.shape[2:])
        routing = Routing(replay=replay, record=routing.record)
    logits = model(packed.view(1, N), position_ids=pos.view(1, N), layout=layout, routing=routing)
    if row_routing is not None and row_routing.record:  # the record back in rows (padding reads slot 0: mask it)
        at_row = slot_of.clamp(min=0).to(device)
        for j in routing.logits:
            row_routing.logits[j] = routing.logits[j][0][at_row]
            row_routing.selected[j] = routing.selected[j][0][at_row]
    # only the read slots reach the log-softmax (what backward keeps: one row per pair, as padded rows keep s - 1)
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    logp_p, ent_p = _from_logits(local.reshape(N, -1)[slots], tokens, temperature, with_entropy, tp_group,
                                 entropy_grad)
    has, at = src >= 0, src.clamp(min=0)
    ent = torch.where(has, ent_p[at], 0.0) if with_entropy else None
    return torch.where(has, logp_p[at], 0.0), ent
