"""The planned weight sync between real processes: trainer shards (FSDP2 / TP / HSDP from
parallelize_model) moved into engine ranks, colocated and disaggregated, checked by what the engine
then computes (its logprobs against a single-process reference, fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo, check_tp
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.rendezvous import serve_store
from relayrl.sync.apply import shard_state_dict
from relayrl.sync.boxes import Box
from relayrl.sync.checksums import dest_checksums, first_mismatch, source_checksums
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.plan import plan_sync
from relayrl.sync.transfer import (
    BackgroundSend,
    Members,
    SyncComm,
    SyncSpec,
    buckets,
    finish_receives,
    post_receives,
    sync_step,
    trainer_locals,
)
from relayrl.trainer.logprobs import token_logprobs

from dist_harness import run_distributed
from helpers import SYNC_CONFIGS as CONFIGS
from helpers import SYNC_ROWS as ROWS
from helpers import sync_model, sync_reference_logp

# trainer layouts on 4 ranks as (tp, dp_shard, dp_replicate): FSDP 4, HSDP 2x2, FSDP 2 x TP 2,
# TP 2 with 2 replicas (the seed case's trainer TP=2 feeding engine TP=4), 4 replicas
LAYOUTS_4 = [(1, 4, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2), (1, 1, 4)]
ENGINE_TP = (1, 2, 4)


def _spec(cfg, layout: TrainerLayout, etp: int, members: Members, dtype=torch.float32, **kw) -> SyncSpec:
    return SyncSpec(shape=ModelShape.of(cfg), trainer=layout, engine=EngineLayout(etp), members=members, dtype=dtype,
                    **kw)


def _grid(rank: int, world: int, store) -> list:
    """Every (shape, trainer layout, engine TP) on these 4 processes, colocated: engine rank r in
    process r. Returns (case, engine rank, max |engine - reference|, max |engine - trainer|, bytes)."""
    members = Members(trainer_world=4, engine_world=4, colocated=True)  # engine ranks <= 4 live in 0..3
    comm = SyncComm(store, rank, 4)
    groups = {1: None, 2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    out = []
    for key, shape in CONFIGS.items():
        ref_model = sync_model(key)
        ref = sync_reference_logp(ref_model)
        full = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
        for tp, shard, rep in LAYOUTS_4:
            if shape["num_key_value_heads"] % tp:
                continue
            dims = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, world_size=4)
            model = CausalLM(ref_model.config)
            model.load_state_dict(full)
            model = parallelize_model(model, dims, dims.build_mesh("cpu"))
            ids = torch.tensor(ROWS)
            with torch.no_grad():
                trainer = token_logprobs(model, ids, torch.ones_like(ids),
                                         tp_group=dims.tp_mesh.get_group() if tp > 1 else None)[0]
            layout = TrainerLayout(tp=tp, dp_shard=shard, dp_replicate=rep)
            for etp in ENGINE_TP:
                check_tp(shape["num_attention_heads"], shape["num_key_value_heads"], etp, shape["intermediate_size"])
                plan = plan_sync(ref_model.config, layout, EngineLayout(etp))
                hosts = rank < etp
                runner = ModelRunner(ref_model.config, torch.float32, TPInfo(rank, etp, groups[etp])) if hosts else None
                if runner is not None:
                    for p in runner.params().values():
                        p.fill_(float("nan"))  # anything the sync misses shows
                spec = _spec(ref_model.config, layout, etp, members, bucket_bytes=512, window=2)
                stats = sync_step(spec, comm=comm, trainer_rank=rank, engine_rank=rank if hosts else None,
                                  local=trainer_locals(model), params=runner.params() if hosts else None)
                if hosts:
                    got = runner.score(ROWS)
                    trainer = trainer.detach()
                    moved = stats.bytes_received + stats.bytes_copied
                    out.append((f"{key}-t{tp}x{shard}x{rep}-e{etp}", rank, float((got - ref).abs().max()),
                                float((got - trainer).abs().max()), moved,
                                plan.bytes_per_dst_rank(torch.float32)[rank], stats.bytes_copied))
                dist.barrier()
    comm.close()
    return out


@pytest.mark.equivalence
def test_grid_of_layouts_colocated_engine_equals_trainer():
    store = serve_store()
    results = run_distributed(_grid, 4, store.address, timeout=300)
    rows = [r for per_rank in results for r in per_rank]
    # every case ran on every engine rank: 3 shapes, 5/5/3 trainer layouts (one KV head: no TP 2), 3 engine TPs
    assert len({r[0] for r in rows}) == (5 + 5 + 3) * 3
    assert len(rows) == (5 + 5 + 3) * (1 + 2 + 4)
    for case, rank, vs_ref, vs_trainer, moved, shard_bytes, _ in rows:
        assert vs_ref < 1e-5, (case, rank, vs_ref)
        assert vs_trainer < 1e-5, (case, rank, vs_trainer)
        assert moved == shard_bytes, (case, rank)  # exactly its shard: nothing more arrives
    seed = [r for r in rows if r[0] == "gqa8x2-t2x1x2-e4"]
    assert [r[1] for r in seed] == [0, 1, 2, 3]
    # each engine rank's process holds part of what it needs (its own replicated pieces, own heads
    # where its trainer rank has them): copied in place; only the rest crosses processes
    assert all(0 < r[6] < r[5] for r in seed)


def _disaggregated(rank: int, world: int, store, key: str, tp: int, etp: int, fp8: bool = False) -> tuple:
    """Trainer ranks 0..tp-1 (shards cut from the full state dict), engine ranks after them, in
    processes of their own: trainers send in a background thread, engines receive and unpack.
    Each returns its per-piece checksums (trainer: what the engine should hold; engine: what it does)."""
    model = sync_model(key)
    cfg = model.config
    layout, members = TrainerLayout(tp=tp), Members(tp, etp, colocated=False)
    spec = _spec(cfg, layout, etp, members, bucket_bytes=256, window=2, fp8=fp8)  # many messages per pair
    plan = spec.plan
    comm = SyncComm(store, rank, members.world_size)
    engine_group = dist.new_group(list(range(tp, tp + etp)))
    full = {k: v.detach() for k, v in model.state_dict().items()}
    if rank < tp:
        local = shard_state_dict(full, cfg, layout, rank)
        send = BackgroundSend(spec, rank, local, comm)
        stats = send.join()
        comm.close()
        return ("trainer", stats.bytes_sent, stats.messages, source_checksums(plan, rank, local, torch.float32, fp8))
    e = rank - tp
    runner = ModelRunner(cfg, torch.float32, TPInfo(e, etp, engine_group if etp > 1 else None))
    params = runner.params()
    stats = finish_receives(post_receives(spec, e, params, comm), params)
    got = runner.score(ROWS)
    comm.close()
    return ("engine", float((got - sync_reference_logp(model)).abs().mean()), stats.bytes_received,
            plan.bytes_per_dst_rank(torch.float32)[e], stats.messages, dest_checksums(plan, e, params),
            len(plan.for_dst(e)))


@pytest.mark.equivalence
@pytest.mark.parametrize("fp8", [False, True], ids=["engine-dtype", "float8-wire"])
def test_disaggregated_trainer_tp2_to_engine_tp2(fp8):
    store = serve_store()
    results = run_distributed(_disaggregated, 4, store.address, "gqa8x2", 2, 2, fp8, timeout=180)
    trainers, engines = results[:2], results[2:]
    assert all(r[0] == "engine" for r in engines)
    plan = plan_sync(ModelConfig(**CONFIGS["gqa8x2"]), TrainerLayout(tp=2), EngineLayout(2))
    src = {k: v for t in trainers for k, v in t[3].items()}
    dst = {k: v for e in engines for k, v in e[5].items()}
    assert first_mismatch(plan, src, dst) is None  # every piece where it belongs, rounded as promised
    for _, gap, got, shard_bytes, messages, _, pieces in engines:
        assert messages > 10  # bucketed, not one message per pair
        if fp8:  # a byte per element and a 4-byte scale per piece, against 4 bytes per element
            assert got == shard_bytes // 4 + 4 * pieces
            assert 1e-4 < gap < 0.25  # the fp8 rounding shows in the logprobs, within its bound
        else:
            assert got == shard_bytes
            assert gap < 1e-6
    assert sum(t[1] for t in trainers) == sum(e[2] for e in engines)


# ---------------------------------------------------------------------------- in one process
@pytest.mark.unit
def test_buckets_cut_by_bytes_and_keep_order():
    plan = plan_sync(ModelConfig(**CONFIGS["mha4"]), TrainerLayout(), EngineLayout(1))
    ts = plan.between(0, 0)
    bs = buckets(ts, 4, 64)
    assert [t for b in bs for t in b] == list(ts)
    for b in bs:
        assert len(b) == 1 or sum(t.numel for t in b) * 4 <= 64
    assert len(buckets(ts, 4, 1 << 30)) == 1


@pytest.mark.unit
def test_colocated_single_process_copies_in_place():
    model = sync_model("gqa8x2")
    cfg = model.config
    plan = plan_sync(cfg, TrainerLayout(), EngineLayout(1))
    runner = ModelRunner(cfg, torch.bfloat16)
    spec = _spec(cfg, TrainerLayout(), 1, Members(1, 1, True), torch.bfloat16)
    stats = sync_step(spec, comm=None, trainer_rank=0, engine_rank=0, local=trainer_locals(model),
                      params=runner.params())
    assert stats.bytes_received == 0 and stats.messages == 0
    assert stats.bytes_copied == plan.bytes_per_dst_rank(torch.bfloat16)[0]
    engine_embed = runner.params()["embed_tokens.weight"]
    assert torch.equal(engine_embed, model.model.embed_tokens.weight.detach().to(torch.bfloat16))


@pytest.mark.unit
def test_checksums_see_a_moved_value():
    from relayrl.sync.checksums import _checksum

    x = torch.arange(12.0).view(3, 4)
    box = Box(0, 3, 0, 4)
    assert _checksum(x, box) == _checksum(x.clone(), box)
    swapped = x.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, two rows exchanged
    assert _checksum(swapped, box) != _checksum(x, box)
    assert _checksum(x, box) != _checksum(x, Box(1, 4, 0, 4))  # the same values at other logical rows


class _Loopback:
    """A sync group in one process: sends land in a dict, a receive's wait() takes its message.
    Counts the receives outstanding at once (the engine's staging memory, in buckets)."""

    wire_device = torch.device("cpu")

    def __init__(self, me: int):
        self.me, self.box, self.outstanding, self.most = me, {}, 0, 0

    def as_member(self, me: int) -> _Loopback:
        other = _Loopback(me)
        other.box = self.box
        return other

    def isend(self, t, peer, tag):
        self.box[(self.me, peer, tag)] = t.clone()
        return _Done()

    def irecv(self, t, peer, tag):
        self.outstanding += 1
        self.most = max(self.most, self.outstanding)
        comm = self

        class _Recv:
            def wait(self_):
                t.copy_(comm.box.pop((peer, comm.me, tag)))
                comm.outstanding -= 1

        return _Recv()


class _Done:
    def wait(self):
        pass


@pytest.mark.unit
@pytest.mark.parametrize("fp8", [False, True])
def test_receives_stay_within_the_window_and_unpack_exactly(fp8):
    """Trainer TP 2 -> engine TP 1 through a loopback group: 300-byte buckets, window 3."""
    model = sync_model("gqa8x2")
    cfg = model.config
    layout, members = TrainerLayout(tp=2), Members(2, 1, colocated=False)
    spec = _spec(cfg, layout, 1, members, bucket_bytes=300, window=3, fp8=fp8)
    plan = spec.plan
    full = {k: v.detach() for k, v in model.state_dict().items()}
    base = _Loopback(2)
    for r in range(2):
        sync_step(spec, comm=base.as_member(r), trainer_rank=r, local=shard_state_dict(full, cfg, layout, r))
    runner = ModelRunner(cfg, torch.float32)
    stats = finish_receives(post_receives(spec, 0, runner.params(), base), runner.params())
    assert not base.box  # every message taken
    per_bucket = 2 if fp8 else 1  # fp8: the values and their scales
    assert base.most == 3 * per_bucket < stats.messages  # many buckets, never more than 3 posted at once
    src = {k: v for r in range(2) for k, v in
           source_checksums(plan, r, shard_state_dict(full, cfg, layout, r), torch.float32, fp8).items()}
    assert first_mismatch(plan, src, dest_checksums(plan, 0, runner.params())) is None
