"""The driver's weight sync: the canary catches a wrong transfer and names the piece; debug
checksums; the GRPO loop colocated and disaggregated gives the same run; sleep / wake is verified."""

from __future__ import annotations

import pytest
import torch

from relayrl.controller.config import RunConfig
from relayrl.engine import LLMEngine
from relayrl.errors import ConfigError
from relayrl.jobs.train import train
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.roles.group_policy import GroupPolicy
from relayrl.roles.weight_sync import PlannedWeightSync, SyncVerificationError
from relayrl.sync.config import SyncConfig
from relayrl.sync.layout import TrainerLayout

from helpers import (
    EXACT,
    SYNC_CONFIGS,
    assert_same_metrics,
    cfg_for,
    colocated_engine,
    group_cfg,
    inline_policy,
    naive_plan,
    policy_model,
    step_metrics,
)


def _policy(key: str = "gqa8x2", engine_dtype: torch.dtype | None = None) -> GroupPolicy:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**SYNC_CONFIGS[key]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # a peaked distribution: wrong weights move the logprobs far
    return inline_policy(model, engine_dtype)


def _sync(policy, engine, tp: int, colocated: bool, **cfg) -> PlannedWeightSync:
    shape = ModelShape.of(policy_model(policy).config)
    return PlannedWeightSync(policy, engine, shape=shape, trainer_layout=TrainerLayout(), engine_tp=tp,
                             colocated=colocated, engine_dtype=engine.dtype, trainer_dtype=torch.float32,
                             temperature=1.0, cfg=SyncConfig(**cfg))


def _colocated(dtype: torch.dtype = torch.float32) -> tuple[GroupPolicy, LLMEngine]:
    """A policy and the engine's one rank beside its actor, in this process (filled by the first sync)."""
    policy = _policy(engine_dtype=dtype)
    return policy, colocated_engine(policy, dtype)


def _write_naive(runner, naive: dict) -> None:
    params = runner.params()
    for name, t in naive[runner.tp.rank].items():
        params[name].copy_(t)


@pytest.mark.faults
def test_naive_fused_slicing_is_caught_and_named():
    policy = _policy()
    cfg = policy_model(policy).config
    engine = LLMEngine(cfg, tensor_parallel_size=2, kv_cache_bytes=1 << 16)  # ranks in processes of their own
    try:
        ws = _sync(policy, engine, 2, colocated=False)
        m = ws.sync()
        assert m["sync/canary_gap"] < 1e-5
        full = {k: v.detach() for k, v in policy_model(policy).state_dict().items()}
        engine.run_on_ranks(_write_naive, naive_plan(full, cfg, 2))  # "assemble qkv, cut in 2 by rows"
        with pytest.raises(SyncVerificationError) as err:
            ws.verify("the naive load")
        msg = str(err.value)
        assert "canary logprob gap" in msg
        # rank 0's first 16 rows happen to be right (its Q heads); the K rows after them are not
        assert "first parameter whose checksum differs: engine rank 0 layers.0.self_attn.qkv_proj.weight" in msg
        assert "k_proj" in msg
    finally:
        engine.close()


@pytest.mark.faults
def test_debug_checksums_catch_what_the_canary_cannot():
    policy, engine = _colocated()  # colocated: this process
    ws = _sync(policy, engine, 1, colocated=True)
    m = ws.sync()
    assert m["sync/bytes_copied_in_place"] == m["sync/bytes_per_engine_rank"] and m["sync/bytes_between_processes"] == 0
    table = ws.checksum_table()
    assert table and all(a == b for a, b in table.values())

    def nudge(runner):  # one element, far below what the logprobs can see
        runner.params()["layers.1.mlp.gate_up_proj.weight"][3, 2] += 1e-4

    engine.run_on_ranks(nudge)
    assert ws.verify("a nudge") < ws.bound  # the canary passes (pieces were compared on the first sync only) ...
    ws.cfg = SyncConfig(debug_checksums=True)
    with pytest.raises(SyncVerificationError, match=r"layers\.1\.mlp\.gate_up_proj\.weight \[0:24, 0:18\] "
                                                    r"\(= model\.layers\.1\.mlp\.gate_proj\.weight"):
        ws.verify("a nudge")  # ... the checksums do not
    table = ws.checksum_table()
    assert [k for k, (a, b) in table.items() if a != b] == ["engine rank 0: layers.1.mlp.gate_up_proj.weight"]


def _with_engine_tp(cfg: RunConfig, tp: int) -> RunConfig:
    d = cfg.to_dict()
    d["rollout"]["tp"] = tp
    return RunConfig.from_dict(d)


@pytest.mark.faults
def test_first_sync_compares_every_piece_and_nan_never_passes():
    policy, engine = _colocated()
    ws = _sync(policy, engine, 1, colocated=True)
    ws.transfer()

    def nudge(runner):
        runner.params()["layers.0.self_attn.qkv_proj.weight"][33, 1] += 1e-4  # a K row (Q: 0-31, K: 32-39)

    engine.run_on_ranks(nudge)
    with pytest.raises(SyncVerificationError, match=r"engine rank 0 layers\.0\.self_attn\.qkv_proj\.weight .*k_proj"):
        ws.verify("the first sync")  # under the gap bound, but the plan's first sync checks every piece

    ws.transfer()
    assert ws.verify("a good sync") < 1e-6

    def poison(runner):
        runner.params()["norm.weight"][0] = float("nan")

    engine.run_on_ranks(poison)
    with pytest.raises(SyncVerificationError, match=r"canary logprob gap nan .*engine rank 0 norm\.weight"):
        ws.verify("a NaN")


@pytest.mark.unit
def test_bf16_bound_leaves_room_for_the_measured_rounding():
    policy, engine = _colocated(torch.bfloat16)
    ws = _sync(policy, engine, 1, colocated=True)
    assert ws.bound == 0.05
    gap = ws.sync()["sync/canary_gap"]
    assert 1e-3 < gap < 0.05  # bf16 rounds: a real gap, under the dtype's bound
    assert ws.bound == max(0.05, 3 * gap)
    fixed = _sync(policy, engine, 1, colocated=True, gap_bound=0.07)
    fixed.sync()
    assert fixed.bound == 0.07  # a bound the user set stays as set


@pytest.mark.e2e
def test_grpo_colocated_and_disaggregated_give_the_same_run(tmp_path):
    """FSDP 2 trainer, engine TP 2: in the actor's processes, then in processes of its own."""
    co = train(_with_engine_tp(group_cfg(tmp_path, "colocated", backend="local", dp_shard=2), 2), show_progress=False)
    dis = train(_with_engine_tp(group_cfg(tmp_path, "disaggregated", backend="local", dp_shard=2,
                                     placement="disaggregated"), 2), show_progress=False)
    a, b = step_metrics(co["run_dir"]), step_metrics(dis["run_dir"])
    assert_same_metrics(a, b)
    for x, y in zip(a, b, strict=True):
        assert x["sync/canary_gap"] == y["sync/canary_gap"] < 1e-5
        total = x["sync/bytes_between_processes"] + x["sync/bytes_copied_in_place"]
        assert total == y["sync/bytes_between_processes"] > 0 and y["sync/bytes_copied_in_place"] == 0
        assert 0 < x["sync/bytes_copied_in_place"] < total  # colocated: own pieces never leave the process


@pytest.mark.e2e
def test_sleep_and_wake_between_steps_changes_nothing(tmp_path, monkeypatch):
    from relayrl.engine.model_runner import ModelRunner

    awake = train(cfg_for(tmp_path, "awake", run={"steps": 3, "save_every": 0}), show_progress=False)
    freed = []
    real = ModelRunner.free_weights
    monkeypatch.setattr(ModelRunner, "free_weights", lambda self: (freed.append(1), real(self))[1])
    slept = train(cfg_for(tmp_path, "slept", run={"steps": 3, "save_every": 0}, rollout={"sleep_level": 2}),
                  show_progress=False)
    assert len(freed) == 3  # the weights really went away after every rollout, and came back by the sync
    a, b = step_metrics(awake["run_dir"]), step_metrics(slept["run_dir"])
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        for k in EXACT + ("loss", "sync/canary_gap"):
            assert x[k] == y[k], k


@pytest.mark.unit
def test_placement_errors_say_what_to_change():
    with pytest.raises(ConfigError, match="rollout.tp"):
        RunConfig.from_dict({"rollout": {"tp": 2}})  # colocated in the one driver process
    with pytest.raises(ConfigError, match="placement=disaggregated"):
        RunConfig.from_dict({"parallel": {"backend": "local", "rollout_worker": True}})
    RunConfig.from_dict({"rollout": {"tp": 2}, "parallel": {"placement": "disaggregated"}})
    RunConfig.from_dict({"rollout": {"tp": 2}, "parallel": {"backend": "local", "dp_shard": 2}})


@pytest.mark.e2e
def test_metrics_carry_the_sync(tmp_path):
    res = train(cfg_for(tmp_path, "m", run={"steps": 1, "save_every": 0}), show_progress=False)
    (m,) = step_metrics(res["run_dir"])
    for k in ("time/sync", "time/sync_transfer", "time/sync_verify", "sync/canary_gap", "sync/bytes_per_engine_rank",
              "sync/bytes_copied_in_place", "sync/bytes_between_processes"):
        assert k in m, k
    assert m["sync/canary_gap"] < 1e-5
    assert not (tmp_path / "m" / "sync_checksums.jsonl").exists()


@pytest.mark.e2e
def test_debug_mode_writes_per_tensor_checksums(tmp_path):
    import json

    res = train(cfg_for(tmp_path, "d", run={"steps": 2, "save_every": 0}, sync={"debug_checksums": True}),
                show_progress=False)
    lines = [json.loads(x) for x in (tmp_path / "d" / "sync_checksums.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    table = lines[-1]["checksums"]
    assert "engine rank 0: layers.0.self_attn.qkv_proj.weight" in table
    assert all(a == b for a, b in table.values())
    assert res["steps"] == 2


@pytest.mark.unit
def test_float8_wire_rounds_every_piece_the_same_way():
    policy, engine = _colocated()
    exact = _sync(policy, engine, 1, colocated=True).sync()["sync/canary_gap"]
    ws = _sync(policy, engine, 1, colocated=True, wire="float8", debug_checksums=True)
    gap = ws.sync()["sync/canary_gap"]  # debug: every piece's checksum against the fp8-rounded source
    assert exact < 1e-6 < gap < 0.25  # the float8 wire's bound
    assert ws.bound == max(0.25, 3 * gap)  # after a checksum-verified first sync: room for 3x that gap
    embed = engine.runner.params()["embed_tokens.weight"]
    w = policy_model(policy).model.embed_tokens.weight.detach()
    scale = w.abs().max() / 448
    assert torch.equal(embed, (w / scale).to(torch.float8_e4m3fn).float() * scale)


@pytest.mark.faults
def test_a_sender_that_dies_fails_the_sync_within_the_timeout(monkeypatch):
    import time

    import relayrl.sync.transfer as transfer

    policy = _policy()
    engine = LLMEngine(policy_model(policy).config, own_processes=True, kv_cache_bytes=1 << 16)  # disaggregated
    try:
        ws = _sync(policy, engine, 1, colocated=False, timeout_s=3.0)
        ws.sync()

        def dies(*args, **kwargs):
            raise OSError("trainer rank 0 lost its network")

        monkeypatch.setattr(transfer.BackgroundSend, "__init__",
                            lambda self, *a, **k: transfer._Background.__init__(self, dies, *a, **k))
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError):
            ws.transfer()  # the engine rank gives up waiting after timeout_s
        assert time.perf_counter() - t0 < 30
        assert ws.broken
        with pytest.raises(RuntimeError, match="restart the run from its last checkpoint"):
            ws.transfer()
    finally:
        ws.close()
        engine.close()


class _Side:
    """A sync side whose run_on_ranks raises `error` for the transfer step `fails` and for the liveness probe."""

    def __init__(self, fails, error, probe_error=None):
        self.fails, self.error, self.probe_error = fails, error, probe_error
        self.calls = []

    def run_on_ranks(self, fn, *args):
        self.calls.append(fn.__name__)
        if fn.__name__ == "alive":
            if self.probe_error is not None:
                raise self.probe_error
            return [None]
        if fn.__name__ == self.fails:
            raise self.error
        return []


@pytest.mark.faults
def test_a_rank_killed_during_a_transfer_is_named_not_the_survivors_socket_error():
    """The trainer rank dies mid-transfer: the engine's receive fails first, with gloo's "connection reset by
    peer"; the sync then asks both sides, and the dead rank's own fault (role, rank, pid) is what it raises."""
    from types import SimpleNamespace

    from relayrl.errors import RunFault
    from relayrl.roles import sync_steps as steps
    from relayrl.single_controller.liveness import WorkerLostError

    class _Engine(_Side):
        asleep = 0

        def begin_weight_update(self):
            pass

    def disaggregated(policy, engine):
        sync = PlannedWeightSync.__new__(PlannedWeightSync)  # only what transfer() reads
        sync.broken, sync.lora, sync.syncs = False, None, 0
        sync.spec = SimpleNamespace(members=SimpleNamespace(colocated=False))
        sync.policy, sync.engine = policy, engine
        return sync

    dead = WorkerLostError("actor worker rank 0 (pid 1234) died (killed by SIGKILL) during 'run_on_ranks'")
    sync = disaggregated(_Side("trainer_finish_send", RuntimeError("never reached"), probe_error=dead),
                         _Engine("engine_receive", RuntimeError("Read error: Connection reset by peer")))
    with pytest.raises(RunFault, match="actor worker rank 0 .*SIGKILL") as info:
        sync.transfer()
    assert isinstance(info.value.__cause__, RuntimeError) and sync.broken
    assert sync.policy.calls == ["trainer_start_send", "alive"] and steps.alive(None) is None
    # both sides alive: the original error stands
    sync = disaggregated(_Side("trainer_finish_send", RuntimeError("never reached")),
                         _Engine("engine_receive", RuntimeError("a real receive bug")))
    with pytest.raises(RuntimeError, match="a real receive bug"):
        sync.transfer()
    assert sync.engine.calls == ["engine_receive", "alive"] and sync.policy.calls == ["trainer_start_send", "alive"]
