"""The planned sync into a colocated fleet (rollout.replicas on the trainer's ranks): replica k's engine rank r lives
in trainer rank k*tp + r's process (Members.engine_offset k*tp), and every replica gets its full weights from the
sharded trainer. Checked by what each replica's ranks compute (logprobs against one process's reference, fp32), the
bytes each receives (its shard, exactly) and what it copies in place from the trainer rank beside it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo
from relayrl.models import CausalLM
from relayrl.models.config import ModelShape
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.rendezvous import serve_store
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.plan import choose_source, plan_sync
from relayrl.sync.transfer import Members, SyncComm, SyncSpec, sync_step, trainer_locals

from dist_harness import run_distributed
from helpers import SYNC_ROWS as ROWS
from helpers import sync_model, sync_reference_logp

# trainer layouts on 4 ranks (tp, dp_shard, dp_replicate) x engine tp (replicas = 4 / tp)
LAYOUTS = [(2, 2, 1), (1, 1, 4)]
ENGINE_TP = (1, 2)


def _replicas(rank: int, world: int, store) -> list:
    """Each (trainer layout, engine tp): 4 / tp replicas colocated, each synced by sync_step over the trainer ranks'
    group; returns (case, replica, engine rank, max |engine - reference|, bytes moved, the plan's bytes, bytes copied
    in place)."""
    comm = SyncComm(store, rank, world)
    ref_model = sync_model("gqa8x2")
    ref = sync_reference_logp(ref_model)
    full = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    out = []
    for tp, shard, rep in LAYOUTS:
        dims = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, world_size=world)
        model = CausalLM(ref_model.config)
        model.load_state_dict(full)
        model = parallelize_model(model, dims, dims.build_mesh("cpu"))
        layout = TrainerLayout(tp=tp, dp_shard=shard, dp_replicate=rep)
        for etp in ENGINE_TP:
            # every rank makes every replica's TP group, in the same order (relayrl.engine.tp_workers)
            groups = [dist.new_group(list(range(k * etp, k * etp + etp))) if etp > 1 else None
                      for k in range(world // etp)]
            mine, r = divmod(rank, etp)  # this process holds replica `mine`'s engine rank r
            runner = ModelRunner(ref_model.config, torch.float32, TPInfo(r, etp, groups[mine]))
            for p in runner.params().values():
                p.fill_(float("nan"))  # anything the sync misses shows
            for k in range(world // etp):  # replica by replica, as the fleet's sync runs them
                members = Members(world, etp, colocated=True, engine_offset=k * etp)
                spec = SyncSpec(shape=ModelShape.of(ref_model.config), trainer=layout, engine=EngineLayout(etp),
                                members=members, dtype=torch.float32, bucket_bytes=512, window=2)
                hosted = members.hosted_engine_rank(rank)
                assert (hosted is not None) == (k == mine)
                stats = sync_step(spec, comm=comm, trainer_rank=rank, engine_rank=hosted, local=trainer_locals(model),
                                  params=runner.params() if hosted is not None else None)
                if hosted is not None:
                    out.append((f"t{tp}x{shard}x{rep}-e{etp}", k, r, float((runner.score(ROWS) - ref).abs().max()),
                                stats.bytes_received + stats.bytes_copied,
                                spec.plan.bytes_per_dst_rank(torch.float32)[r], stats.bytes_copied))
            dist.barrier()
    comm.close()
    return out


@pytest.mark.slow  # ~7 s on 4 processes: `make bench`; CI: the colocated fleet run (tests/fleet/test_fleet_colocated)
@pytest.mark.equivalence
def test_each_colocated_replica_gets_its_full_weights_from_the_sharded_trainer():
    store = serve_store()
    rows = [r for per_rank in run_distributed(_replicas, 4, store.address, timeout=300) for r in per_rank]
    assert len(rows) == len(LAYOUTS) * 4 * len(ENGINE_TP)  # every process hosts one replica's rank in every case
    for case, k, r, gap, moved, shard_bytes, _ in rows:
        assert gap < 1e-5, (case, k, r, gap)  # the replica computes what the reference does
        assert moved == shard_bytes, (case, k, r)  # exactly its shard arrives, however much is local
    by_case = {(c, k, r): copied for c, k, r, _, _, _, copied in rows}
    # 4 full replicas in the trainer (dp_replicate 4): each replica's ranks copy everything from the trainer rank
    # beside them and nothing crosses processes; under TP 2 x FSDP 2 each copies the part its trainer rank holds (its
    # rows of each tensor's TP half), the rest arrives from the other three
    for k in range(4):
        assert by_case[("t1x1x4-e1", k, 0)] == next(m for c, kk, _, _, m, _, _ in rows if c == "t1x1x4-e1" and kk == k)
        assert 0 < by_case[("t2x2x1-e1", k, 0)] < by_case[("t1x1x4-e1", k, 0)] / 2


@pytest.mark.unit
def test_replicated_pieces_come_from_the_replica_s_own_process():
    """choose_source prefers the trainer rank in the engine rank's process: home + dst (replica k: home k*tp);
    where that rank does not hold the piece, one of the holders, spread by that rank's number."""
    assert choose_source((0, 1, 2, 3), 0, home=2) == 2 and choose_source((0, 1, 2, 3), 1, home=2) == 3
    assert choose_source((0, 1), 1, home=2) == 1  # rank 3 holds none: holders[3 % 2]
    assert choose_source((0, 1, 2, 3), 1) == 1  # the one engine (home 0): as before
    shape = ModelShape.of(sync_model("gqa8x2").config)
    plan = plan_sync(shape, TrainerLayout(dp_replicate=4), EngineLayout(1), home=3)
    assert {t.src_rank for t in plan.transfers} == {3}  # replica 3 reads everything from trainer rank 3


@pytest.mark.unit
def test_a_replica_must_sit_inside_the_trainer_s_ranks():
    m = Members(4, 2, colocated=True, engine_offset=2)
    assert [m.of_engine(r) for r in range(2)] == [2, 3] and m.world_size == 4
    assert [m.hosted_engine_rank(t) for t in range(4)] == [None, None, 0, 1]
    assert Members(4, 2, colocated=True).hosted_engine_rank(3) is None
    with pytest.raises(ValueError, match="engine ranks 3..4 must sit in the 4 trainer ranks"):
        Members(4, 2, colocated=True, engine_offset=3)
    with pytest.raises(ValueError):
        Members(4, 2, colocated=False, engine_offset=2)
