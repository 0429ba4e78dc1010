"""This module runs one scheduled batch for the rollout engine, from its sequences to their next tokens:

    prepare (the batch flattened; the copy-on-write copies the block manager asked for)
      ──> run on every rank ──> with record_routing: each token's experts written at its KV slot
      ──> logits, one row per sequence (a fork reads its parent's prefill row; relayrl.engine.sequence)
      ──> sample_next: each sequence's token under its own settings, from its own seeded stream (and its top
          logprobs when params.logprobs asks for them)

The batch is counted in the engine's stats as it runs (relayrl.engine.stats). What the new tokens do to their
requests (stops, finishing, outputs) is the request table's (relayrl.engine.request_table).

It imports torch and the engine's own modules; like the whole engine, it must never import the trainer, sync,
the controller or the CLI.
"""

from __future__ import annotations

import torch

from relayrl.engine.block_manager import BlockManager
from relayrl.engine.model_runner import ModelRunner, prepare
from relayrl.engine.protocols import RunnerGroup
from relayrl.engine.routing import RoutingStore
from relayrl.engine.sampler import sample
from relayrl.engine.sequence import Sequence, fork_rows
from relayrl.engine.stats import EngineStats


class BatchRunner:
    """The routing store (None without record_routing) and the stats a batch is recorded and counted in."""

    def __init__(self, stats: EngineStats, routing: RoutingStore | None, *, block_size: int,
                 sliding_window: int | None, group_prefill: bool):
        self.stats, self.routing = stats, routing
        self.block_size, self.sliding_window, self.group_prefill = block_size, sliding_window, group_prefill

    def run(self, seqs: list[Sequence], is_prefill: bool, block_manager: BlockManager,
            ranks: RunnerGroup) -> torch.Tensor:
        """The batch's logits, one row per sequence of `seqs`, run by ModelRunner.run on every one of `ranks`."""
        self.stats.observe_blocks(block_manager)
        run, rows = fork_rows(seqs) if is_prefill else (seqs, None)  # forks read their parent's logits
        input_ids, batch = prepare(run, is_prefill, self.block_size, self.sliding_window,
                                   group=self.group_prefill, copies=block_manager.take_copies())
        if self.routing is not None:
            logits, routing = ranks.call(ModelRunner.run, input_ids, batch, True)
            if batch.copy_from is not None:  # the KV's copy-on-write copies, mirrored before the batch's writes
                self.routing.copy(batch.copy_from, batch.copy_to)
            self.routing.write(batch.slot_mapping, routing)
            for s in seqs:  # every token of each has run now (a fork's: its parent's, in the same slots)
                s.num_routed = s.num_tokens
        else:
            logits = ranks.call(ModelRunner.run, input_ids, batch)
        if rows is not None:
            logits = logits[rows]
        self.stats.count(seqs, is_prefill)
        return logits


def sample_next(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each sequence's next token and its logprob (relayrl.engine.sampler), one logits row each; the top
    params.logprobs tokens' logprobs are appended to s.top_logprobs."""

    def row(f, dt):  # one sampling parameter per sequence, as a column for the batched sampler
        return torch.tensor([f(s.params) for s in seqs], dtype=dt)

    u = torch.tensor([s.rng.random() for s in seqs], dtype=torch.float64).float()
    tokens, logps = sample(logits, row(lambda p: p.temperature, torch.float32), row(lambda p: p.top_k, torch.long),
                           row(lambda p: p.top_p, torch.float32), row(lambda p: p.min_p, torch.float32), u)
    _record_top_logprobs(seqs, logits)
    return tokens.tolist(), logps.tolist()


def _record_top_logprobs(seqs: list[Sequence], logits: torch.Tensor) -> None:
    k = max(s.params.logprobs for s in seqs)
    if k == 0:
        return
    temp = torch.tensor([s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs])
    top = (logits / temp[:, None]).log_softmax(-1).topk(k, dim=-1)
    for i, s in enumerate(seqs):
        n = s.params.logprobs
        if n:
            s.top_logprobs.append(dict(zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist(), strict=True)))
