"""This module keeps the experts an MoE model's tokens were routed to during rollout, so that each completion carries
them for routing replay (R3: the trainer's forward passes use the engine's experts instead of routing again).

What a completion carries (LLMEngine(record_routing=True)):

    CompletionSample.routing   int16 [len(prompt_token_ids) + len(token_ids), n_moe, k]
        row t      token t of  prompt_token_ids + token_ids  (the sequence the trainer forwards, in that order)
        column j   the j-th MoE layer of cfg.moe_layers (dense layers have none)
        last axis  the k experts the router chose, in top-k order (highest probability first)
        -1         a token the engine never ran (only: the newest token of an aborted sample, every token of a
                   resumed sample that had already ended; a finished sample has none)

    Routing(replay=torch.stack([s.routing for s in samples of one length]).long()) is the layout
    relayrl.models.moe.Routing takes ([B, q, n_moe, k]).

Where it lives: routing is per token, computed exactly when that token's KV is, so it is kept like the KV, per cache
slot, on the host:

    store  [num_blocks * block_size, n_moe, k] int16      slot = block_table[p // block_size] * block_size + p % bs

    run           the batch's N tokens' routing (rank 0's; the router is replicated, every TP rank picks the same)
                  is written at the batch's slot_mapping, after the batch's copy-on-write copies are mirrored here
    prefix hit    a cached block's slots hold the routing computed with its KV (a slot is written only by the
                  sequence holding it, and a block leaves the cache before it is reused), so a sequence whose
                  prefix came from the cache reads the routing of the run that computed it; forked samples read
                  their parent's prompt routing from the blocks they share
    finish        the sequence's rows are gathered from its slots before its blocks are freed

The final token: a sample's last sampled token is never fed back for generation, but the trainer forwards it (its
routing changes only its own, unused, logits, yet replay needs ids for every position). With record_routing the
engine runs it once more before the sample finishes (one more decode position per sample, its logits dropped), so a
finished sample's routing has no -1 row; the scheduler reserves KV for that token too.

Host memory: num_blocks * block_size * n_moe * k * 2 bytes (Qwen3-30B-A3B, 48 layers x 8 experts: 768 bytes a slot).

Expert load: every routed (token, slot) pair the engine computes is counted per MoE layer and expert (`load`
[n_moe, E], recomputed tokens included: it is the work the experts did), for the engine's stats: the largest
max / mean load over layers, over experts and (expert_placement "ep") over the ranks holding them — the imbalance
that leaves some ranks idle while the most loaded one computes.

It imports torch and the engine's own Sequence only; like the whole engine, it must never import the trainer, sync,
the controller or the CLI.
"""

from __future__ import annotations

import torch

from relayrl.engine.sequence import Sequence
from relayrl.models.router_losses import load_max_over_mean

UNKNOWN = -1  # a token the engine never ran


class RoutingStore:
    """Each KV slot's routing [n_moe, k] (int16), on the host."""

    def __init__(self, num_slots: int, num_moe_layers: int, top_k: int, block_size: int, num_experts: int):
        self.block_size, self.num_experts = block_size, num_experts
        self.slots = torch.full((num_slots, num_moe_layers, top_k), UNKNOWN, dtype=torch.int16)
        self.load = torch.zeros(num_moe_layers, num_experts, dtype=torch.long)  # pairs computed per expert

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Mirror the KV cache's copy-on-write copies (slot indices), before the batch writes anything."""
        self.slots[dst] = self.slots[src]

    def write(self, slot_mapping: torch.Tensor, routing: torch.Tensor) -> None:
        """routing [N, n_moe, k] of the batch's N tokens, at their slots; their pairs join the expert load."""
        self.slots[slot_mapping] = routing.to(torch.int16)
        ids = routing.long().transpose(0, 1).reshape(routing.shape[1], -1)  # [n_moe, N k]
        self.load += torch.zeros_like(self.load).scatter_add_(1, ids, torch.ones_like(ids))

    def load_max_over_mean(self, groups: int = 0) -> float:
        """max over MoE layers of max / mean load, over experts (groups 0) or over `groups` equal runs of experts
        (the ranks of an EP placement); 1.0 is perfect balance, 0.0 before any token ran."""
        load = self.load if not groups else self.load.view(self.load.shape[0], groups, -1).sum(-1)
        ratio = load_max_over_mean(load)
        return 0.0 if ratio is None else float(ratio.max())

    def gather(self, seq: Sequence) -> torch.Tensor:
        """seq's routing [num_tokens, n_moe, k]: its first seq.num_routed rows from its slots, UNKNOWN after."""
        out = torch.full((seq.num_tokens, *self.slots.shape[1:]), UNKNOWN, dtype=torch.int16)
        n = min(seq.num_routed, seq.num_tokens) if seq.block_table else 0
        if n:
            pos = torch.arange(n)
            table = torch.tensor(seq.block_table, dtype=torch.long)
            out[:n] = self.slots[table[pos // self.block_size] * self.block_size + pos % self.block_size]
        return out
