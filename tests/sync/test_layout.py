"""The trainer layout the planner assumes IS what the trainer's parallelize_model (TP plan, then
FSDP2 / HSDP) leaves on each rank: same local shapes, same values — checked in this one process
with torch's fake process group (a rank at a time; no data moves, so TP splits locally)."""

import functools

import pytest
import torch
import torch.distributed as dist

import relayrl.parallel.tensor_parallel as tensor_parallel
from relayrl.models import CausalLM, ModelConfig
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.sync.apply import shard_state_dict
from relayrl.sync.layout import TrainerLayout, logical_tensors

pytestmark = pytest.mark.unit

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

CFG = dict(model_type="qwen2", vocab_size=30, hidden_size=18, intermediate_size=24, num_hidden_layers=1,
           num_attention_heads=8, num_key_value_heads=2, head_dim=4, qkv_bias=True)


@pytest.mark.parametrize("rep,shard,tp,tied,sp", [
    (1, 4, 2, True, False),   # uneven chunks: vocab 15 rows per TP rank over 4 -> 4, 4, 4, 3; norms 5, 5, 5, 3
    (2, 2, 2, False, True),   # HSDP, sequence parallel, untied lm_head
    (1, 3, 1, True, False),   # FSDP only: k_proj 8 rows over 3 -> 3, 3, 2
])
def test_layout_matches_parallelize_model(monkeypatch, rep, shard, tp, tied, sp):
    # the fake group moves no data: make TP split the (identical) full weights locally instead of scattering
    monkeypatch.setattr(tensor_parallel, "parallelize_module",
                        functools.partial(tensor_parallel.parallelize_module, src_data_rank=None))
    cfg = ModelConfig(**CFG, tie_word_embeddings=tied)
    torch.manual_seed(0)
    full = {k: v.detach().clone() for k, v in CausalLM(cfg).state_dict().items()}
    layout = TrainerLayout(tp=tp, dp_shard=shard, dp_replicate=rep, sequence_parallel=sp)
    for rank in range(layout.world_size):
        dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=fake_pg.FakeStore())
        try:
            dims = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, world_size=layout.world_size)
            model = CausalLM(cfg)
            model.load_state_dict(full)
            parallelize_model(model, dims, dims.build_mesh("cpu"), sequence_parallel=sp)
            params = dict(model.named_parameters())
            mine = shard_state_dict(full, cfg, layout, rank)
            assert set(mine) == set(logical_tensors(cfg)) <= set(params)
            for name, want in mine.items():
                p = params[name]
                local = p.to_local() if hasattr(p, "to_local") else p
                assert local.shape == want.shape, (rank, name)
                assert torch.equal(local.detach(), want), (rank, name)
        finally:
            dist.destroy_process_group()
