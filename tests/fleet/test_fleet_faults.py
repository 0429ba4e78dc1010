"""A fleet's replicas lost, restarted, added and drained (relayrl.roles.fleet), each replica a rollout worker process of
its own: a replica killed (kill -9) or stopped (SIGSTOP) in the middle of a generate call is noticed (at once; within
the heartbeat deadline), its requests move to the others and resume from the tokens it had reported (re-prefilled, their
seeded streams advanced past them), giving exactly the samples the call gives without a fault; the lost replica is
restarted, up to rollout.replica_restarts times, and joins at the next sync point once built; with none left the call
stops in one line naming every loss. The whole-run cases (the step finishes and the run trains as without the fault, the
checkpoint when none is left, `relayrl fleet`) are in tests/faults/test_fleet_run_faults.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.models.tokenizer import load_tokenizer
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_replicas import DRAINING, JOINING, LOST, RETIRED, SERVING, STARTING, FleetLostError
from relayrl.roles.rollout_worker import RolloutRole, RolloutWorker
from relayrl.rollout.router import Router
from relayrl.single_controller.liveness import GroupOptions, WorkerLostError
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.single_controller.worker_group import WorkerGroup

pytestmark = pytest.mark.faults

# 8 prompts of distinct first tokens (no block shared): the router spreads them 4 and 4 over two replicas
PROMPTS = [[5 + i, 6, 7, 8 + i] for i in range(8)]
HEARTBEAT_S = 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)
    return build_tiny_model(tmp_path_factory.mktemp("fleet") / "m", "0123456789+=abcdefghijklmnopqrstuvwxyz", cfg)


def params(max_tokens: int = 400) -> list[SamplingParams]:
    return [SamplingParams(n=2, temperature=1.0, max_tokens=max_tokens, seed=7 + i, ignore_eos=True)
            for i in range(len(PROMPTS))]


def start(model_dir, n: int, restarts: int = 1) -> tuple[RolloutFleet, list[str]]:
    notices: list[str] = []
    fleet = RolloutFleet.own_processes(n, model_dir, {"num_blocks": 256, "seed": 0},
                                       GroupOptions(threads=1, heartbeat_timeout_s=HEARTBEAT_S),
                                       load_tokenizer(model_dir), block_size=16, max_restarts=restarts)
    fleet.notice = notices.append
    return fleet, notices


def inline_fleet(model_dir, n: int, restarts: int = 1) -> tuple[RolloutFleet, list[str]]:
    """n replicas whose engines live in this process (inline rollout roles; a restart or an added replica is one more
    inline group): the fleet's bookkeeping of losses, restarts and sizes, in a second, without processes. A loss is
    told to it as the worker group reports one (a RunFault)."""
    tok = load_tokenizer(model_dir)

    def build():
        return LLMEngine.from_pretrained(model_dir, num_blocks=64, block_size=16, seed=0)

    def spawn(name: str, place: int):
        return WorkerGroup.start(ResourcePool([1], name=name), RolloutWorker, (build,),
                                 options=GroupOptions(backend="inline"))

    notices: list[str] = []
    fleet = RolloutFleet([RolloutRole.inline(build, tok) for _ in range(n)], Router(n, 16), spawn=spawn,
                         max_restarts=restarts, notice=notices.append)
    return fleet, notices


def lost(r: int) -> WorkerLostError:
    return WorkerLostError(f"rollout{r} worker rank 0 (pid 1) died (killed by SIGKILL) during 'generate'")


def pid_of(fleet: RolloutFleet, r: int) -> int:
    return fleet.replicas[r].group._pids[0]


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def tokens(outs) -> list[list[list[int]]]:
    return [[s.token_ids for s in o.samples] for o in outs]


def until_built(fleet: RolloutFleet, r: int, timeout: float = 60.0) -> list[int]:
    """maintain() until replica r has been built (the way a sync point sees it); returns the joining replicas."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        joining = fleet.maintain()
        if fleet.slots[r].state != STARTING:
            return joining
        time.sleep(0.2)
    raise AssertionError(f"replica {r} not built in {timeout}s: {fleet.status()}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGSTOP, marks=pytest.mark.slow)],
                         ids=["kill-9", "sigstop"])
def test_a_replica_lost_mid_generate_loses_no_sample_and_is_restarted(model_dir, sig):
    """CI: kill -9; `make bench`: SIGSTOP too (the heartbeat's own detection is covered in CI by tests/faults)."""
    fleet, notices = start(model_dir, 2)
    try:
        want = fleet.generate(PROMPTS, params())  # both replicas, no fault: the reference samples
        assert [fleet.router.counters[r].requests for r in range(2)] == [4, 4]
        fleet.reset_stats()
        pid = pid_of(fleet, 1)
        killer = threading.Timer(0.3, os.kill, (pid, sig))  # while the call runs (400 tokens x 8 prompts x 2: >1 s)
        t0 = time.monotonic()
        killer.start()
        got = fleet.generate(PROMPTS, params())
        took = time.monotonic() - t0
        killer.join()
        assert tokens(got) == tokens(want)  # every request answered once, with the samples its seed gives
        s = fleet.stats()
        assert s["fleet/rerouted_requests"] == 4  # replica 1's share moved to replica 0...
        # ...resumed from the tokens replica 1 had reported (rounds of 16 engine steps): re-prefilled, not redone
        assert 0 < s["fleet/reprefilled_tokens"] < 4 * 2 * 400
        assert s["fleet/lost"] == 1 and s["fleet/restarts"] == 1 and s["fleet/replicas"] == 1
        assert s["fleet/replicas_starting"] == 1 and 0 < s["fleet/recovery_s"] < took
        assert "fleet/replica1/requests" not in s  # out of service: no figures
        # noticed at once (kill -9: the pipe) or within the heartbeat deadline (SIGSTOP), on a busy 2-core box
        assert took < (10.0 if sig == signal.SIGKILL else HEARTBEAT_S + 12.0), took
        (line,) = [n for n in notices if "lost" in n]
        why = "died (killed by SIGKILL)" if sig == signal.SIGKILL else "sent no heartbeat for"
        assert line.startswith(f"rollout replica 1 lost: rollout1 worker rank 0 (pid {pid}) ") and why in line
        assert line.endswith("its requests move to replica(s) 0") and "\n" not in line
        assert gone(pid)  # the stopped one too: its group killed it
        assert fleet.slots[1].state == STARTING
        # the restart builds in its own process while the fleet serves on; a sync point finds it built: joining
        assert tokens(fleet.generate(PROMPTS[:2], params()[:2])) == tokens(want[:2]) and fleet.serving == [0]
        assert until_built(fleet, 1) == [1] and fleet.slots[1].state == JOINING
        assert pid_of(fleet, 1) != pid  # a new process
    finally:
        fleet.close()
    assert gone(pid_of(fleet, 0)) and gone(pid_of(fleet, 1))


@pytest.mark.slow  # ~7 s: `make bench`; CI: the same error from inline replicas (the restart cap's test below)
def test_no_replica_left_stops_the_call_in_one_line_naming_each_loss(model_dir):
    fleet, notices = start(model_dir, 2, restarts=0)
    pids = [pid_of(fleet, r) for r in range(2)]
    try:
        fleet.resize(3)  # a third replica starts building: it serves nothing until a sync, and close() stops it
        pids.append(fleet.slots[2].group._pids[0])
        for pid in pids[:2]:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(FleetLostError) as info:
            fleet.generate(PROMPTS, params(4))
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("every rollout replica is lost (replica 0: rollout0 worker rank 0 "
                                                  f"(pid {pids[0]}) died (killed by SIGKILL)")
        assert f"replica 1: rollout1 worker rank 0 (pid {pids[1]}) died" in msg
        assert msg.endswith("resume it from its last checkpoint with relayrl train --resume")
        # restarts capped at 0: each retired, and the fleet says how many replicas it goes on with (the one building)
        assert [s.state for s in fleet.slots] == [RETIRED, RETIRED, STARTING]
        assert "rollout replica 0 is not restarted after 0 restart(s); the run goes on with 2 replica(s)" in notices
        assert "rollout replica 1 is not restarted after 0 restart(s); the run goes on with 1 replica(s)" in notices
    finally:
        fleet.close()
    assert all(gone(p) for p in pids)


def test_a_replica_is_restarted_at_most_replica_restarts_times(model_dir):
    fleet, notices = inline_fleet(model_dir, 2, restarts=1)
    try:
        fleet.lose(1, lost(1))
        assert fleet.slots[1].state == STARTING and fleet.slots[1].restarts == 1
        assert until_built(fleet, 1) == [1]
        fleet.joined(1)
        assert fleet.serving == [0, 1]
        fleet.lose(1, lost(1))
        assert fleet.slots[1].state == RETIRED and fleet.serving == [0] and fleet.size == 1
        assert notices[-1] == "rollout replica 1 is not restarted after 1 restart(s); the run goes on with 1 replica(s)"
        assert fleet.status()["lost_total"] == 2 and fleet.status()["restarts_total"] == 1
        assert fleet.status()["reasons"]["1"].startswith("rollout1 worker rank 0 (pid 1) died")
        fleet.lose(0, lost(0))  # the last: the next call stops, naming both
        with pytest.raises(FleetLostError, match=r"replica 0: rollout0 .*; replica 1: rollout1 "):
            fleet.generate(PROMPTS[:1], params(2)[:1])
    finally:
        fleet.close()


def test_a_loss_seen_off_the_main_thread_is_restarted_at_the_next_sync_point(model_dir):
    """Worker processes start from the driver's main thread (a worker dies with the thread that started it): a loss
    a driver thread notices (the rollout stream's) is restarted by maintain(), which runs at the sync point."""
    fleet, _ = inline_fleet(model_dir, 2)
    try:
        t = threading.Thread(target=fleet.lose, args=(1, lost(1)))
        t.start()
        t.join()
        assert fleet.slots[1].state == LOST and fleet.slots[1].restarts == 0
        fleet.maintain()  # restarted from the main thread (inline, it may be built already)
        assert fleet.slots[1].state in (STARTING, JOINING) and fleet.slots[1].restarts == 1
        assert until_built(fleet, 1) == [1]  # joining at the sync point that finds it built
    finally:
        fleet.close()


def test_resize_adds_replicas_that_join_at_a_sync_point_and_drains_the_highest(model_dir):
    fleet, notices = inline_fleet(model_dir, 1)
    try:
        want = fleet.generate(PROMPTS, params(8))
        fleet.resize(3)
        assert [s.state for s in fleet.slots] == [SERVING, STARTING, STARTING] and fleet.size == 3
        assert fleet.router.replicas == 3 and notices[-1] == "rollout replica 2 is starting (the fleet's size: 3)"
        assert tokens(fleet.generate(PROMPTS, params(8))) == tokens(want)  # replica 0 serves until they join
        assert fleet.router.counters[0].requests == 16
        until_built(fleet, 1)
        assert until_built(fleet, 2) == [1, 2]
        for r in (1, 2):
            fleet.joined(r)
        fleet.reset_stats()
        assert tokens(fleet.generate(PROMPTS, params(8))) == tokens(want)  # three replicas, the same samples
        assert [fleet.router.counters[r].requests for r in range(3)] == [3, 3, 2]
        fleet.resize(1)
        assert [s.state for s in fleet.slots] == [SERVING, DRAINING, DRAINING] and fleet.size == 1
        assert tokens(fleet.generate(PROMPTS, params(8))) == tokens(want)  # draining replicas take no request
        assert [fleet.router.counters[r].requests for r in range(3)] == [3 + 8, 3, 2]
        assert fleet.maintain() == []  # a sync point: nothing in flight, the drained ones closed
        assert [s.state for s in fleet.slots] == [SERVING, RETIRED, RETIRED]
        assert "rollout replica 2 drained and closed (the fleet's size: 1)" in notices
        fleet.resize(2)  # a replica added later takes a new number; numbers are never reused
        assert [s.state for s in fleet.slots][3] == STARTING and fleet.size == 2
        fleet.resize(1)  # still starting: drained first, closed once built
        assert fleet.slots[3].state == DRAINING
        fleet.slots[3].starting.result()  # built (inline: in a thread of the fleet)
        fleet.maintain()
        assert fleet.slots[3].state == RETIRED and fleet.serving == [0]
        with pytest.raises(ValueError, match="at least 1"):
            fleet.resize(0)
    finally:
        fleet.close()


def test_fleet_control_applies_each_request_once_and_writes_the_status(model_dir, tmp_path):
    """The run's side of `relayrl fleet` (relayrl.jobs.fleet_control), between two steps: a request read once by its
    id, a bad one ignored in one line, the status written for the command to follow."""
    import json

    from relayrl.jobs.fleet_control import REQUEST, STATUS, fleet_control

    fleet, notices = inline_fleet(model_dir, 1)
    try:
        fleet_control(fleet, tmp_path)  # no request: the status alone
        status = json.loads((tmp_path / STATUS).read_text())
        assert status["serving"] == [0] and status["size"] == 1 and status["request"] is None
        (tmp_path / REQUEST).write_text(json.dumps({"replicas": 2, "id": "a"}))
        fleet_control(fleet, tmp_path)
        assert fleet.size == 2 and json.loads((tmp_path / STATUS).read_text())["request"] == "a"
        until_built(fleet, 1)
        fleet.joined(1)
        fleet_control(fleet, tmp_path)  # the same request again: not applied twice
        status = json.loads((tmp_path / STATUS).read_text())
        assert fleet.size == 2 and status["serving"] == [0, 1] and status["starting"] == []
        (tmp_path / REQUEST).write_text(json.dumps({"replicas": "three", "id": "b"}))
        fleet_control(fleet, tmp_path)
        status = json.loads((tmp_path / STATUS).read_text())
        assert status["error"] == notices[-1] == "ignored a fleet request of replicas='three': it must be a whole " \
                                                 "number >= 1"
        assert fleet.size == 2 and status["request"] == "b"
        (tmp_path / REQUEST).write_text("{not json")  # a file being written, or garbage: read as nothing
        fleet_control(fleet, tmp_path)
        assert fleet.size == 2
    finally:
        fleet.close()
