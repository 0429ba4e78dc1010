"""Fault injection into a running `relayrl train` whose rollout is a fleet of 2 replicas (rollout.replicas 2, each a
rollout worker process of its own): a replica killed (kill -9) or stopped (SIGSTOP) while the run trains is noticed,
its requests move to the other replica, the step finishes, the replica is restarted and re-synced, and the run trains
exactly as the same run without the fault — every sample of every step, every reward and loss. Every replica lost,
restarts used up: one line, a checkpoint of the last finished step, exit 3, and a resume from that checkpoint trains on
exactly as the run would have. `relayrl fleet RUN_DIR --replicas N` grows and shrinks the live run's fleet, the samples
unchanged. (The fleet's own cases, call by call: tests/fleet/test_fleet_faults.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REPO, TINY, TrainRun, descendants, leftovers, merged

pytestmark = pytest.mark.faults

FLEET = merged(TINY, {
    "rollout": {"replicas": 2, "max_tokens": 8},
    "parallel": {"backend": "local", "placement": "disaggregated", "rollout_worker": True, "heartbeat_timeout_s": 3},
    "run": {"samples_every": 1, "samples_per_step": 4, "save_every": 0},  # TINY's run.steps: 1000, stopped by the test
    "eval": {"every": 0},
})
KEYS = ("reward/mean", "loss/policy", "response_length/mean", "sync/canary_gap")


def rows(run_dir: Path, upto: int) -> list[dict]:
    out = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [r for r in out if r["split"] == "train" and r["step"] <= upto]


def metrics(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "reward/mean" in m:
            out.append(m)
    return out


def stop_after(run: TrainRun, done, timeout: float = 180.0) -> list[dict]:
    """Wait until done(metrics) holds, then stop the run; its metrics."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run.proc.poll() is None, run.stderr()
        if (run.run_dir / "metrics.jsonl").exists() and done(metrics(run.run_dir)):
            run.kill()
            return metrics(run.run_dir)
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s:\n{run.stderr()}")


def reference(tmp_path: Path, steps: int, overrides: list[str] = ()) -> Path:
    """The same run, no fault, stopped once it has `steps` steps."""
    run = TrainRun(tmp_path / "reference", FLEET, overrides)
    try:
        stop_after(run, lambda ms: len(ms) >= steps)
    finally:
        run.kill()
    return run.run_dir


def assert_trains_as(run_dir: Path, tmp_path: Path, overrides: list[str] = ()) -> int:
    """Every step the run finished (the last one's samples may be unwritten when it was stopped) as the same run's
    without the fault: every prompt, completion, reward and advantage, the step's reward, loss and canary. Returns
    how many steps were compared."""
    upto = len(metrics(run_dir)) - 1
    assert upto >= 3
    want = reference(tmp_path, upto + 1, overrides)
    assert rows(run_dir, upto) == rows(want, upto)
    for a, b in zip(metrics(run_dir)[:upto], metrics(want)[:upto], strict=True):
        for k in KEYS:
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (a["step"], k)
    return upto


@pytest.mark.slow  # ~35 s a case (two runs): `make bench`; CI: the same loss and rejoin in one run in process
# (tests/fleet/test_fleet_run.py), and mid-generate against the no-fault outputs (tests/fleet/test_fleet_faults.py)
@pytest.mark.parametrize("sig,mode", [(signal.SIGKILL, "sync"), (signal.SIGSTOP, "sync"),
                                      (signal.SIGKILL, "one_step_off")],
                         ids=["kill-9", "sigstop", "one-step-off-kill-9"])
def test_a_lost_replica_is_replaced_and_the_run_trains_as_without_the_fault(tmp_path, sig, mode):
    """kill -9 and SIGSTOP in lockstep, kill -9 under one_step_off (the stream's stepper notices
    the loss in an advance; drained at batch boundaries, one_step_off is as deterministic as lockstep)."""
    overrides = [f"rollout.mode={mode}"]
    run = TrainRun(tmp_path, FLEET, overrides)
    try:
        run.wait_for_step(2, timeout=180)
        pid = run.find("rl-rollout1-0")
        run.signal(pid, sig)
        # the step goes on on replica 0; the restart builds beside the steps and joins at a sync: stop 2 steps later
        ms = stop_after(run, lambda ms: any(m.get("fleet/joined") for m in ms[:-2]))
        lost = [line for line in run.error_lines() if "rollout replica 1 lost" in line]
        assert len(lost) == 1 and f"(pid {pid})" in lost[0], run.stderr()
        hit = next(m for m in ms if m.get("fleet/lost", 0) == 1)  # the step that noticed it
        assert hit["fleet/replicas"] == 1 and ms[-1]["fleet/restarts"] == 1  # (a stream restarts at the next sync)
        joined = [m for m in ms if m.get("fleet/joined", 0) == 1]
        assert len(joined) == 1 and joined[0]["step"] > hit["step"], [m["step"] for m in joined]
        j = joined[0]
        # replaced: a new process, at the step's version, verified like the other, in service from then on
        assert j["fleet/replica1/version"] == j["fleet/replica0/version"] == j["step"]
        assert j["fleet/replica1/canary_gap"] <= 1e-3 and j["fleet/replica1/sync_bytes"] == j["sync/bytes_per_replica"]
        assert all(m["fleet/replicas"] == 2 for m in ms if m["step"] >= j["step"])
        assert ms[-1]["fleet/replica1/requests"] > 0
    finally:
        run.kill()
    assert_trains_as(run.run_dir, tmp_path, overrides)  # no sample lost or duplicated; the same training


@pytest.mark.slow  # ~40 s (a run, then its resume): `make bench`; CI checks the checkpoint's step in tests/fleet
def test_no_replica_left_checkpoints_exits_3_and_resumes_as_the_run_would_have(tmp_path):
    run = TrainRun(tmp_path, FLEET, ["rollout.replica_restarts=0"])
    try:
        run.wait_for_step(2, timeout=180)
        tree = descendants(run.pid)
        for r in (0, 1):
            run.signal(run.find(f"rl-rollout{r}-0"), signal.SIGKILL)
        code = run.wait(timeout=120)
        lines = run.error_lines()
        assert code == 3, run.stderr()
        assert lines[-1].startswith("relayrl: error: every rollout replica is lost (replica 0: rollout0 worker rank 0")
        assert lines[-1].endswith("resume it from its last checkpoint with relayrl train --resume"), lines
        assert leftovers(tree) == []
        done = max(m["step"] for m in metrics(run.run_dir))
        ckpts = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
        assert ckpts[-1] == f"step_{done:08d}", ckpts  # the last finished step, though run.save_every is 0
    finally:
        run.kill()
    resumed = TrainRun(tmp_path / "resume", None, [f"run.steps={done + 4}"], args=["--resume", str(run.run_dir)])
    try:
        assert resumed.wait(timeout=300) == 0, resumed.stderr()
    finally:
        resumed.kill()
    # the untrained step's prompts came first after the resume: the steps before and after it as without the fault
    assert len(metrics(run.run_dir)) == done + 4
    assert assert_trains_as(run.run_dir, tmp_path) == done + 3


def fleet_cmd(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relayrl.cli.main", "fleet", str(run_dir), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # ~40 s: `make bench`; CI: RolloutFleet.resize and fleet_control in tests/fleet
def test_relayrl_fleet_grows_and_shrinks_a_live_run_and_the_samples_do_not_change(tmp_path):
    run = TrainRun(tmp_path, FLEET)
    try:
        run.wait_for_step(1, timeout=180)
        grow = fleet_cmd(run.run_dir, "--replicas", "3", "--wait", "120")
        assert grow.returncode == 0, grow.stderr + run.stderr()
        assert "size 3: 3 serving" in grow.stdout.splitlines()[-1]
        # in service from the next sync: synced to the step's version and verified like the others (2 prompts a
        # step go to the two least loaded, replicas 0 and 1: no request need reach it)
        deadline = time.monotonic() + 60
        while not any(m.get("fleet/replicas") == 3 for m in metrics(run.run_dir)):
            assert time.monotonic() < deadline, run.stderr()
            time.sleep(0.1)
        third = next(m for m in metrics(run.run_dir) if m.get("fleet/replicas") == 3)
        assert third["fleet/replica2/version"] == third["step"] and third["fleet/replica2/canary_gap"] <= 1e-3
        assert third["fleet/replica2/sync_bytes"] == third["sync/bytes_per_replica"]
        shrink = fleet_cmd(run.run_dir, "--replicas", "1", "--wait", "120")
        assert shrink.returncode == 0, shrink.stderr + run.stderr()
        assert "size 1: 1 serving" in shrink.stdout.splitlines()[-1]
        status = fleet_cmd(run.run_dir)
        assert status.returncode == 0 and json.loads(status.stdout.splitlines()[-1])["retired"] == [1, 2]
        assert sorted(n for n in descendants(run.pid).values() if n.startswith("rl-rollout")) == ["rl-rollout0-0"]
        bad = fleet_cmd(run.run_dir, "--replicas", "0")
        assert bad.returncode == 2 and bad.stderr.strip() == "relayrl: error: --replicas must be at least 1, got 0"
        ms = metrics(run.run_dir)
        stop_after(run, lambda now: len(now) >= len(ms) + 2)
    finally:
        run.kill()
    assert_trains_as(run.run_dir, tmp_path)  # one, two and three replicas over the run: the same training


def test_relayrl_fleet_on_a_run_that_is_not_live_or_not_a_fleet_says_so(tmp_path, capsys):
    from relayrl.cli.main import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert main(["fleet", str(run_dir), "--replicas", "2"]) == 2
    assert capsys.readouterr().err.strip().startswith(f"relayrl: error: {run_dir} has no fleet status (fleet.json): "
                                                      "the run is not a rollout fleet")
    (run_dir / "fleet.json").write_text('{"size": 2, "serving": [0, 1], "version": 3}')
    assert main(["fleet", str(run_dir), "--replicas", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"relayrl: error: no run is live in {run_dir}: a fleet's size changes while its run trains (resume it with "
        f"relayrl train --resume {run_dir} rollout.replicas=3)")
    assert not (run_dir / "fleet_request.json").exists()
    assert main(["fleet", str(run_dir)]) == 0  # the status, as the run last wrote it
    assert capsys.readouterr().out.splitlines()[0] == "size 2: 2 serving; lost 0, restarted 0; weights version 3"


def test_the_train_job_checkpoints_its_last_step_when_the_fleet_is_lost_and_resumes_with_the_lost_steps_prompts(
        tmp_path, monkeypatch):
    """In process (seconds): the engine's fourth generate call (step 3's) raises FleetLostError (as a fleet with no
    replica left does) — the job saves a checkpoint of step 2 (run.save_every 0), re-raises, and a resume trains
    steps 3 and 4 exactly as the run without the fault (the sampler was put back: step 3's prompts were not skipped)."""
    from relayrl.engine import LLMEngine
    from relayrl.jobs.train import train
    from relayrl.roles.fleet_replicas import FleetLostError

    from helpers import cfg_for, step_metrics

    def config(name: str):
        return cfg_for(tmp_path, name, run={"steps": 4, "save_every": 0, "samples_every": 1, "samples_per_step": 4},
                       eval={"every": 0})

    want = Path(train(config("clean"), show_progress=False)["run_dir"])
    real, calls = LLMEngine.generate, []

    def lost_on_the_third(self, prompts, params):
        calls.append(1)
        if len(calls) == 4:  # the first held-out evaluation's, steps 1 and 2, then step 3's
            raise FleetLostError("every rollout replica is lost (replica 0: test)")
        return real(self, prompts, params)

    monkeypatch.setattr(LLMEngine, "generate", lost_on_the_third)
    with pytest.raises(FleetLostError):
        train(config("lost"), show_progress=False)
    got = tmp_path / "lost"
    assert [m["step"] for m in step_metrics(got)] == [1, 2]
    assert sorted(p.name for p in (got / "checkpoints").iterdir()) == ["step_00000002"]
    monkeypatch.setattr(LLMEngine, "generate", real)
    train(config("lost"), resume=True, show_progress=False)
    assert rows(got, 4) == rows(want, 4)
    for a, b in zip(step_metrics(got), step_metrics(want), strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["loss/policy"] == pytest.approx(b["loss/policy"], abs=1e-7)
