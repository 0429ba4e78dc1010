"""The one logprob runner (relayrl.trainer.logprobs.LogprobRunner): how its settings cut the rows, that the reference
model's pass is token_logprobs over plain chunks to the bit, and that every data-parallel rank runs as many
forwards whichever cut it takes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.logprobs import split_rows, token_logprobs
from relayrl.trainer.reference import Reference

from dist_harness import run_distributed
from helpers import random_train_batch


def _rows(n: int) -> TrainBatch:
    ids = torch.arange(n * 3).view(n, 3)
    return TrainBatch(ids, torch.ones(n, 3, dtype=torch.long), torch.ones(n, 3))


@pytest.mark.unit
def test_even_cut_is_the_updates_and_chunks_the_references():
    rows = _rows(10)
    even = [len(mb) for mb, _ in split_rows(rows, 4, "cpu")]
    chunks = [len(mb) for mb, _ in split_rows(rows, 4, "cpu", even=False)]
    assert even == [3, 3, 4] and chunks == [4, 4, 2]
    got = torch.cat([mb.input_ids for mb, _ in split_rows(rows, 4, "cpu", even=False)])
    assert torch.equal(got, rows.input_ids)


@pytest.mark.equivalence
def test_reference_pass_is_token_logprobs_over_chunks_to_the_bit(tiny_model):
    b = random_train_batch(n=10, seed=5)
    want = torch.cat([token_logprobs(tiny_model, mb.input_ids, mb.attention_mask, 0.7, padding_free=True)[0]
                      * mb.response_mask for mb in b.split(4)])
    got = Reference(tiny_model, temperature=0.7, micro_batch_size=4, padding_free=True).compute_ref_logprobs(b)
    assert torch.equal(got, want)
    assert not any(p.requires_grad for p in tiny_model.parameters()) and not tiny_model.training


def _counts(rank: int, world: int, even: bool) -> list[tuple[int, bool, float]]:
    rows = _rows(5 - rank)  # DP_SPLIT's chunks: 5 and 4 rows
    return [(len(mb), real, float(mb.response_mask.sum()))
            for mb, real in split_rows(rows, 4, "cpu", even=even, dp_group=dist.group.WORLD)]


@pytest.mark.equivalence
@pytest.mark.parametrize("even", [True, False])
def test_every_dp_rank_runs_as_many_micro_batches(even):
    """A sharded model's forwards are collective: the rank with fewer rows runs a stand-in (no loss tokens)."""
    first, second = run_distributed(_counts, 2, even)
    assert len(first) == len(second) == 2
    assert [real for _, real, _ in first] == [True, True]
    want = [(2, True, 6.0), (2, True, 6.0)] if even else [(4, True, 12.0), (1, False, 0.0)]
    assert second == want
