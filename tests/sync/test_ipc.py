"""The IPC transport of the weight sync (SyncSpec.ipc, relayrl.sync.ipc) between real processes: each bucket's
message is a handle to the sender's packed bucket, the receiver copies out of the mapped memory and acks.

On a GPU the handles are CUDA IPC; here the same protocol runs on CPU tensors shared through torch's file_system
strategy (the processes set it), so what is checked is everything but CUDA's own mapping: the engine ends up
holding exactly what the plan puts there (its logprobs equal the reference model's, every piece's checksum the
trainer's), the bytes and messages are counted as the payload, windows stay bounded with acks both ways in a
process that is both sender and receiver, and the result equals the gloo transport's bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo
from relayrl.models import ModelConfig
from relayrl.models.config import ModelShape
from relayrl.parallel.rendezvous import serve_store
from relayrl.sync import ipc
from relayrl.sync.apply import shard_state_dict
from relayrl.sync.checksums import dest_checksums, first_mismatch, source_checksums
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.plan import plan_sync
from relayrl.sync.transfer import BackgroundSend, Members, SyncComm, SyncSpec, finish_receives, post_receives, sync_step

from dist_harness import run_distributed
from helpers import SYNC_CONFIGS as CONFIGS
from helpers import SYNC_ROWS as ROWS
from helpers import sync_model, sync_reference_logp


def _spec(model, layout, etp, members, use_ipc, fp8=False) -> SyncSpec:
    return SyncSpec(shape=ModelShape.of(model.config), trainer=layout, engine=EngineLayout(etp), members=members,
                    dtype=torch.float32, bucket_bytes=256, window=2, fp8=fp8, ipc=use_ipc)  # many buckets per pair


def _disaggregated(rank: int, world: int, store) -> list[tuple]:
    """Trainer ranks 0, 1 (TP 2 shards) send to engine ranks 0, 1 (TP 2) in processes 2, 3: three syncs in a row
    on one group, ipc, ipc with the float8 wire, then gloo."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    model = sync_model("gqa8x2")
    layout, members = TrainerLayout(tp=2), Members(2, 2, colocated=False)
    comm = SyncComm(store, rank, 4)
    engine_group = dist.new_group([2, 3])
    full = {k: v.detach() for k, v in model.state_dict().items()}
    shared, share = [], ipc.share
    ipc.share = lambda t: shared.append(t.numel()) or share(t)  # what went as a handle (the transfer's own call)
    out = []
    for use_ipc, fp8 in ((True, False), (True, True), (False, False)):
        spec = _spec(model, layout, 2, members, use_ipc, fp8)
        if rank < 2:
            local = shard_state_dict(full, model.config, layout, rank)
            shared.clear()
            stats = BackgroundSend(spec, rank, local, comm).join()
            out.append(("trainer", stats.bytes_sent, source_checksums(spec.plan, rank, local, torch.float32, fp8),
                        len(shared)))
            continue
        e = rank - 2
        runner = ModelRunner(model.config, torch.float32, TPInfo(e, 2, engine_group))
        params = runner.params()
        for p in params.values():
            p.fill_(float("nan"))  # anything the sync misses shows
        pending = post_receives(spec, e, params, comm)
        assert len(pending.posted) <= spec.window
        stats = finish_receives(pending, params)
        got = runner.score(ROWS)
        out.append(("engine", got, float((got - sync_reference_logp(model)).abs().max()), stats.bytes_received,
                    stats.messages, spec.plan.bytes_per_dst_rank(torch.float32)[e],
                    dest_checksums(spec.plan, e, params), len(spec.plan.for_dst(e))))
    comm.close()
    return out


def _both(rank: int, world: int, store, pair_store) -> tuple:
    """The disaggregated syncs on all four processes, then the colocated ones on processes 0 and 1 (one launch)."""
    disaggregated = _disaggregated(rank, world, store)
    pair = dist.new_group([0, 1])  # collective: every rank takes part
    return disaggregated, _colocated(rank, pair_store, pair) if rank < 2 else None


@pytest.fixture(scope="module")
def runs():
    stores = serve_store(), serve_store()
    try:
        results = run_distributed(_both, 4, stores[0].address, stores[1].address, timeout=240)
    finally:
        for s in stores:
            s.close()
    return [r[0] for r in results], [r[1] for r in results[:2]]


@pytest.mark.equivalence
def test_ipc_disaggregated_equals_the_plan_and_the_gloo_transport(runs):
    results = runs[0]
    plan = plan_sync(ModelConfig(**CONFIGS["gqa8x2"]), TrainerLayout(tp=2), EngineLayout(2))
    for run, fp8 in ((0, False), (1, True)):  # the two ipc syncs
        trainers, engines = [r[run] for r in results[:2]], [r[run] for r in results[2:]]
        src = {k: v for t in trainers for k, v in t[2].items()}
        dst = {k: v for e in engines for k, v in e[6].items()}
        assert first_mismatch(plan, src, dst) is None  # every piece where it belongs, rounded as promised
        for _, _got, gap, received, messages, shard_bytes, _, pieces in engines:
            # the payload, not the handles: a byte per element and a scale per piece through float8
            assert received == (shard_bytes // 4 + 4 * pieces if fp8 else shard_bytes)
            assert messages > 10
            assert (gap > 1e-4) if fp8 else (gap < 1e-6)  # fp8: its rounding shows (the checksums place it)
        assert sum(t[1] for t in trainers) == sum(e[3] for e in engines)
        assert sum(t[3] for t in trainers) == sum(e[4] for e in engines)  # every message was a handle
    assert [r[2][3] for r in results[:2]] == [0, 0]  # and none with the gloo transport
    for r in results[2:]:  # ipc delivers what the gloo transport delivers, bit for bit
        assert torch.equal(r[0][1], r[2][1]) and r[0][3] == r[2][3] and r[0][4] == r[2][4]


def _colocated(rank: int, store, group) -> list[tuple]:
    """Trainer FSDP 2 -> engine TP 2, engine rank r in trainer rank r's process: each process sends to the other
    and receives from it (a receiving thread beside the sender; acks cross both ways). ipc, then gloo."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    model = sync_model("gqa8x2")
    layout, members = TrainerLayout(dp_shard=2), Members(2, 2, colocated=True)
    comm = SyncComm(store, rank, 2)
    local = shard_state_dict({k: v.detach() for k, v in model.state_dict().items()}, model.config, layout, rank)
    runner = ModelRunner(model.config, torch.float32, TPInfo(rank, 2, group))
    out = []
    for use_ipc in (True, False):
        for p in runner.params().values():
            p.fill_(float("nan"))
        stats = sync_step(_spec(model, layout, 2, members, use_ipc), comm=comm, trainer_rank=rank, engine_rank=rank,
                          local=local, params=runner.params())
        got = runner.score(ROWS)
        gap = float((got - sync_reference_logp(model)).abs().max())
        out.append((got, gap, stats.bytes_received, stats.bytes_copied))
    comm.close()
    return out


@pytest.mark.equivalence
def test_ipc_colocated_acks_both_ways_and_equals_gloo(runs):
    results = runs[1]
    plan = plan_sync(ModelConfig(**CONFIGS["gqa8x2"]), TrainerLayout(dp_shard=2), EngineLayout(2))
    for r, ((got, gap, received, copied), (g_got, _, g_received, g_copied)) in enumerate(results):
        assert gap < 1e-6 and torch.equal(got, g_got)
        assert received + copied == plan.bytes_per_dst_rank(torch.float32)[r]
        assert 0 < received == g_received and copied == g_copied  # part crosses processes, part is copied in place


@pytest.mark.unit
def test_handle_message_round_trip():
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        x = torch.arange(12, dtype=torch.float32).view(3, 4)[1:]
        msg = ipc.share(x)
        assert msg.dtype == torch.uint8 and msg.shape == (ipc.HANDLE_BYTES,)
        assert torch.equal(ipc.open_shared(msg.clone()), x)  # a view keeps its offset and shape
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


@pytest.mark.unit
def test_the_transport_by_device_and_backend(tmp_path, monkeypatch):
    from relayrl.errors import ConfigError
    from relayrl.jobs import preflight
    from tests.helpers import cfg_for

    def transport(device: str, **sections) -> str:
        monkeypatch.setattr(preflight, "resolve_device", lambda setting: device)
        return preflight.sync_transport(cfg_for(tmp_path, "r", **sections))

    assert transport("cpu") == "gloo"  # a CPU run moves what it always moved
    assert transport("cuda") == transport("cuda", parallel={"backend": "local", "dp_shard": 2}) == "ipc"
    assert transport("cuda", parallel={"backend": "ray"}) == "gloo"  # each Ray worker sees its own devices
    assert transport("cuda", sync={"transport": "gloo"}) == "gloo"
    with pytest.raises(ConfigError, match=r"^sync\.transport=ipc shares CUDA memory .* parallel\.device=cpu"):
        transport("cpu", sync={"transport": "ipc"})
    with pytest.raises(ConfigError, match=r"^sync\.transport=ipc needs the processes of one machine"):
        transport("cuda", sync={"transport": "ipc"}, parallel={"backend": "ray"})
