"""Fault injection into a running `relayrl train` whose four roles each run in worker processes of their
own: kill -9 and SIGSTOP of the actor, reference, rollout and reward worker. Each stops the run within
the deadline (heartbeats every second, parallel.heartbeat_timeout_s=3) with one line naming the role,
rank, pid and the call it was in, exit status 3, and leaves no process of the run behind."""

from __future__ import annotations

import signal

import pytest

from harness import ALL_ROLES, ROLE_PROCESS, TINY, TrainRun, descendants, leftovers, merged

pytestmark = pytest.mark.faults

DEADLINE_S = 30.0  # detection (at most the 3 s heartbeat timeout + a 1 s check) and teardown, on a loaded CI box


# the reference and reward groups (15-17 s a case), SIGSTOP on the actor and kill -9 on the rollout worker run in
# `make bench`; CI keeps kill -9 on the actor and SIGSTOP on the rollout worker (the same liveness and deadline code
# for every group: each way of noticing a loss, a closed pipe and a silent heartbeat, stays in CI)
SLOW_STOPS = {("reference", "sigstop"), ("reward", "sigstop"), ("reference", "kill-9"), ("reward", "kill-9"),
              ("actor", "sigstop"), ("rollout", "kill-9")}


CASES = [pytest.param(role, sig, id=f"{role}-{name}", marks=[pytest.mark.slow] if (role, name) in SLOW_STOPS else [])
         for sig, name in ((signal.SIGKILL, "kill-9"), (signal.SIGSTOP, "sigstop")) for role in ROLE_PROCESS]


@pytest.mark.parametrize("role,sig", CASES)
def test_a_dead_or_stopped_worker_stops_the_run_in_one_line(tmp_path, role, sig):
    run = TrainRun(tmp_path, merged(TINY, ALL_ROLES))
    try:
        run.wait_for_step(1, timeout=180)
        tree = descendants(run.pid)
        pid = run.find(ROLE_PROCESS[role])
        run.signal(pid, sig)
        code = run.wait(timeout=120)
        took = run.seconds_since_injection()
        lines = run.error_lines()
        assert code == 3, run.stderr()
        assert len(lines) == 1, lines
        (line,) = lines
        assert line.startswith(f"relayrl: error: {role} worker rank 0 (pid {pid}) "), line
        if sig == signal.SIGKILL:
            assert "died (killed by SIGKILL)" in line
        else:
            assert "sent no heartbeat for" in line and "stopped or hung" in line
        assert "during '" in line  # the call it was in
        assert took < DEADLINE_S, took
        assert leftovers(tree) == [], {p: tree[p] for p in leftovers(tree, 0)}
    finally:
        run.kill()
