"""The trainer's passes through a pipeline (parallel.pp > 1): a batch of rows laid out for
relayrl.parallel.pipeline, whose schedules run equal micro-batches.

    rows [B, T] ──pad──> [m * b, T'] ── m micro-batches of b rows ──> the stages
    m   = ceil(B / trainer.micro_batch_size); the update's m also at least what its schedule needs
          (Pipeline.micro_batches: one per stage for 1F1B, whole rounds for interleaved ones)
    b   = ceil(B / m); the m * b - B added rows are stand-ins (row 0 with no loss tokens: no loss, no gradient,
          no stats)
    T'  = T rounded up to a multiple of PAD_T with padding (attention_mask 0): torch's schedule is built for one
          micro-batch shape and rebuilt (with a shape-inference pass) for each new one, so rounding keeps a run's
          shapes few
    B and T are the largest over the data-parallel ranks, so that every rank runs the same shapes (micro_batches)

The logprobs of the padded rows are those of the rows (padding is masked out of attention), cut back to [B, T]
(the forward-only passes: relayrl.trainer.logprobs.LogprobRunner's pipeline branch).

It imports torch, relayrl.parallel and the trainer's own modules only; like all of the trainer, it must never
import the engine, sync, the controller or the CLI.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relayrl.parallel.pipeline import Pipeline
from relayrl.trainer.batch import TrainBatch

PAD_T = 16  # sequence lengths a pipeline sees are multiples of this


def micro_batches(batch: TrainBatch, micro_batch_size: int, dp_group=None, pipe: Pipeline | None = None
                  ) -> tuple[int, int, int]:
    """(m, b, T'): m micro-batches of b rows and T' tokens, the same on every data-parallel rank (from the largest
    rank's rows and length). FSDP's collectives run once per stage and micro-batch, and torch's schedule runs a
    shape-inference pass when it meets a new micro-batch shape: a rank whose shapes differed would run other
    collectives than its peers. With `pipe`, m is at least what its training schedule runs."""
    rows, T = len(batch), batch.input_ids.shape[1]
    if dp_group is not None:
        t = torch.tensor([rows, T])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        rows, T = int(t[0]), int(t[1])
    m = max(1, -(-rows // micro_batch_size))
    if pipe is not None:
        m = pipe.micro_batches(m)
    return m, max(1, -(-rows // m)), T + (-T % PAD_T)


def pad_rows(batch: TrainBatch, m: int, per: int, length: int, template: TrainBatch | None = None) -> TrainBatch:
    """The batch as m micro-batches of `per` rows and `length` tokens (see the module docstring): stand-in rows
    appended (the template's first row, no loss tokens, for a rank with no rows of its own), then every [B, T]
    field padded to `length`."""
    template = batch if template is None or len(batch) else template
    extra = m * per - len(batch)
    if extra:
        stand_in = template.select(torch.zeros(extra, dtype=torch.long))
        stand_in = stand_in.replace(response_mask=torch.zeros_like(stand_in.response_mask))
        batch = TrainBatch.concat([batch, stand_in]) if len(batch) else stand_in
    pad = length - batch.input_ids.shape[1]
    if not pad:
        return batch
    fields = {}
    for name in ("input_ids", "attention_mask", "response_mask", "old_logp", "rollout_logp", "ref_logp", "values",
                 "returns"):
        t = getattr(batch, name)
        fields[name] = None if t is None else F.pad(t, (0, pad))
    return batch.replace(**fields)


