"""A TrainBatch crosses to the trainer's workers as itself (no field list kept by hand, no conversion): a DP_SPLIT
call cuts it into one chunk per data-parallel rank, every field that is set arrives, the chunks rejoin in rank
order, a chunk pickles its own rows only, and parts that set different fields are refused instead of dropped."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from relayrl.single_controller.batch import Rows
from relayrl.single_controller.dispatch import Dispatch, DPInfo, collect_outputs, split_inputs
from relayrl.trainer.batch import TrainBatch

pytestmark = pytest.mark.unit


def _full_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (4, 6), generator=g)
    return TrainBatch(ids, torch.ones_like(ids), torch.ones(4, 6), **{
        f.name: (torch.randn(4, 6, 2, 1, generator=g).to(torch.int16) if f.name == "routing"
                 else torch.randn(4, generator=g) if f.name == "advantages" else torch.randn(4, 6, generator=g))
        for f in dataclasses.fields(TrainBatch) if f.name not in ("input_ids", "attention_mask", "response_mask")})


def test_every_field_crosses_and_comes_back_whole_through_a_dp_split():
    batch = _full_batch()
    assert isinstance(batch, Rows)
    infos = [DPInfo(d, 3) for d in range(3)]
    calls = split_inputs(Dispatch.DP_SPLIT, infos, (batch,), {"profile": True})
    chunks = [pickle.loads(pickle.dumps(args[0])) for args, kw in calls]  # as the process backend sends them
    assert [len(c) for c in chunks] == [2, 1, 1] and all(kw == {"profile": True} for _, kw in calls)
    back = collect_outputs(Dispatch.DP_SPLIT, infos, chunks)
    assert type(back) is TrainBatch
    for f in dataclasses.fields(TrainBatch):
        assert torch.equal(getattr(back, f.name), getattr(batch, f.name)), f.name


def test_a_chunk_pickles_its_own_rows_only():
    big = TrainBatch(torch.zeros(1000, 64, dtype=torch.long), torch.ones(1000, 64, dtype=torch.long),
                     torch.ones(1000, 64))
    whole, chunk = len(pickle.dumps(big)), len(pickle.dumps(big.chunk(10)[0]))
    assert chunk < whole / 5


def test_unset_fields_stay_unset_and_mixed_parts_are_refused():
    ids = torch.tensor([[5, 6, 7]])
    plain = TrainBatch(ids, torch.ones_like(ids), torch.ones(1, 3))
    back = TrainBatch.concat(pickle.loads(pickle.dumps(plain)).chunk(1))
    assert back.advantages is None and back.routing is None and torch.equal(back.input_ids, ids)
    with pytest.raises(ValueError, match="parts set different fields"):
        TrainBatch.concat([plain, plain.replace(old_logp=torch.zeros(1, 3))])


def test_a_tensor_argument_is_not_split():
    t = torch.arange(4)
    calls = split_inputs(Dispatch.DP_SPLIT, [DPInfo(0, 2), DPInfo(1, 2)], (t,), {})
    assert all(args[0] is t for args, _ in calls)
