"""The LoRA weight sync between real processes: an FSDP2-sharded LoRA trainer into a TP 2 engine (colocated),
plain trainer shards into a TP 2 engine of its own processes (disaggregated); the engine's logprobs
equal the single-process LoRA model's after the first (base + adapters) and a later (adapters only)
sync, in both engine modes, and each engine rank receives exactly its shard."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.models.lora import apply_lora, lora_modules
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.rendezvous import serve_store
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.apply import shard_state_dict
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.transfer import (
    BackgroundSend,
    Members,
    SyncComm,
    SyncSpec,
    finish_receives,
    post_receives,
    sync_step,
    trainer_locals,
)
from relayrl.trainer.logprobs import token_logprobs

from dist_harness import run_distributed
from helpers import SYNC_CONFIGS

pytestmark = pytest.mark.equivalence

R, ALPHA = 3, 6.0
ROWS = [[1, 5, 2, 7, 3, 9, 4, 0, 6, 8], [3, 3, 1, 4, 1, 5, 9, 2, 6, 5]]


def _lora_model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**SYNC_CONFIGS["gqa8x2"]))  # 8 Q / 2 KV heads
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    apply_lora(model, R, ALPHA)
    _set_adapters(model, seed + 1)
    return model


@torch.no_grad()
def _set_adapters(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        for p in (m.lora_A, m.lora_B):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _reference(model) -> torch.Tensor:
    ids = torch.tensor(ROWS)
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))[0]


def _specs(layout: TrainerLayout, members: Members) -> tuple[SyncSpec, SyncSpec]:
    shape = ModelShape.of(ModelConfig(**SYNC_CONFIGS["gqa8x2"]))
    full = SyncSpec(shape=shape, trainer=layout, engine=EngineLayout(2), members=members, dtype=torch.float32,
                    bucket_bytes=512, window=2, lora=AdapterShape(R))
    return full, dataclasses.replace(full, base=False)


def _engine(rank: int, mode: str, group) -> ModelRunner:
    runner = ModelRunner(ModelConfig(**SYNC_CONFIGS["gqa8x2"]), torch.float32, TPInfo(rank, 2, group))
    runner.enable_lora(R, ALPHA / R, AdapterShape(R).targets, mode)
    for p in runner.params().values():
        p.fill_(float("nan"))  # anything a sync misses shows
    return runner


TRAINERS = {"fsdp2": (1, 2), "tp2": (2, 1)}  # (tp, dp_shard) of the LoRA trainer, as parallelize_model lays it out


def _colocated(rank: int, world: int, store) -> dict:
    """FSDP 2 or TP 2 trainer (the real shards of the LoRA model) and engine rank r in process r; each
    layout and engine mode in turn (one launch: processes are the slow part)."""
    comm = SyncComm(store, rank, 2)
    out = {(t, mode): _colocated_case(rank, comm, *TRAINERS[t], mode)
           for t in TRAINERS for mode in ("separate", "merge")}
    comm.close()
    return out


def _colocated_case(rank: int, comm: SyncComm, tp: int, dp: int, mode: str) -> list:
    ref = _lora_model()
    dims = ParallelDims(dp_shard=dp, tp=tp, world_size=2)
    model = _lora_model()
    model = parallelize_model(model, dims, dims.build_mesh("cpu"))
    runner = _engine(rank, mode, dist.group.WORLD)
    full, adapters = _specs(TrainerLayout(tp=tp, dp_shard=dp), Members(2, 2, colocated=True))
    out = []
    for step, spec in enumerate((full, adapters, adapters)):
        if step:  # an update: new adapters in the reference, and the same values in the FSDP shards
            _set_adapters(ref, 10 + step)
            want = dict(ref.named_parameters())
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith((".lora_A", ".lora_B")):
                        assert isinstance(p, DTensor)
                        p.to_local().copy_(distribute_tensor(want[name].detach(), p.device_mesh,
                                                             p.placements).to_local())
        stats = sync_step(spec, comm=comm, trainer_rank=rank, engine_rank=rank, local=trainer_locals(model),
                          params=runner.params())
        if mode == "merge":
            runner.merge_lora()
        got = runner.score(ROWS)
        moved = stats.bytes_received + stats.bytes_copied
        out.append((float((got - _reference(ref)).abs()[:, 1:].max()), moved,
                    spec.plan.bytes_per_dst_rank(torch.float32)[rank]))
    return out


def test_fsdp2_and_tp2_trainers_to_colocated_engine_tp2():
    store = serve_store()
    results = run_distributed(_colocated, 2, store.address, timeout=240)
    assert len(results[0]) == 4
    for per_rank in (case for r in results for case in r.values()):
        (gap0, moved0, shard0), *later = per_rank
        assert gap0 < 1e-5 and moved0 == shard0
        for gap, moved, shard in later:
            assert gap < 1e-5
            assert moved == shard < shard0 / 2  # adapters only: this rank's adapter shard, nothing more


def _disaggregated(rank: int, world: int, store) -> dict:
    """Trainer ranks 0, 1 (FSDP 2 shards cut from the full state dict), engine ranks 2, 3 (TP 2); each
    engine mode in turn."""
    comm = SyncComm(store, rank, 4)
    engine_group = dist.new_group([2, 3])
    out = {mode: _disaggregated_mode(rank, comm, engine_group, mode) for mode in ("separate", "merge")}
    comm.close()
    return out


def _disaggregated_mode(rank: int, comm: SyncComm, engine_group, mode: str) -> list:
    ref = _lora_model()
    layout, members = TrainerLayout(dp_shard=2), Members(2, 2, colocated=False)
    full, adapters = _specs(layout, members)
    runner = _engine(rank - 2, mode, engine_group) if rank >= 2 else None
    out = []
    for step, spec in enumerate((full, adapters)):
        if step:
            _set_adapters(ref, 20)
        if runner is None:
            sd = {k: v.detach() for k, v in ref.state_dict().items()}
            BackgroundSend(spec, rank, shard_state_dict(sd, ref.config, layout, rank, spec.lora), comm).join()
            continue
        params = runner.params()
        stats = finish_receives(post_receives(spec, rank - 2, params, comm), params)
        if mode == "merge":
            runner.merge_lora()
        out.append((float((runner.score(ROWS) - _reference(ref)).abs()[:, 1:].max()), stats.bytes_received,
                    spec.plan.bytes_per_dst_rank(torch.float32)[rank - 2]))
    return out


def test_disaggregated_engine_tp2():
    store = serve_store()
    results = run_distributed(_disaggregated, 4, store.address, timeout=180)
    for per_rank in (r[mode] for r in results[2:] for mode in ("separate", "merge")):
        (gap0, got0, shard0), (gap1, got1, shard1) = per_rank
        assert gap0 < 1e-5 and got0 == shard0
        assert gap1 < 1e-5 and got1 == shard1 < shard0 / 2

