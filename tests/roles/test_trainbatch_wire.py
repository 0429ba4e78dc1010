"""A TrainBatch crosses to the trainer's workers as a DataBatch of its own fields (no field list kept by hand):
every field that is set arrives, split and rejoined by data-parallel rank, and a name that is no field is
refused instead of dropped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relayrl.roles.actor_workers import to_data, to_train
from relayrl.single_controller.batch import DataBatch
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
    wire = to_data(batch)
    assert set(wire.tensors) == {f.name for f in dataclasses.fields(TrainBatch)}
    back = to_train(DataBatch.concat(wire.split(3)))
    for f in dataclasses.fields(TrainBatch):
        assert torch.equal(getattr(back, f.name), getattr(batch, f.name)), f.name


def test_unset_fields_stay_unset_and_unknown_names_are_refused():
    ids = torch.tensor([[5, 6, 7]])
    back = to_train(to_data(TrainBatch(ids, torch.ones_like(ids), torch.ones(1, 3))))
    assert back.advantages is None and back.routing is None
    with pytest.raises(ValueError, match=r"not TrainBatch fields: \['old_logps'\]"):
        to_train(DataBatch({"input_ids": ids, "attention_mask": ids, "response_mask": ids, "old_logps": ids}))
