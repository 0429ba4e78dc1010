"""What a fleet does today when a replica's process dies mid-rollout: the step's generate call stops in one line
naming the lost replica (its worker group, rank and pid), after the other replicas' calls ended, and the fleet closes
without leaving a process behind. (Moving the lost replica's requests to the others, restarting it and re-syncing it
are issue 35's deliverable 4, not built yet: NOTES-s35.md.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from relayrl.engine import SamplingParams
from relayrl.models.tokenizer import load_tokenizer
from relayrl.roles.fleet import RolloutFleet
from relayrl.single_controller.liveness import GroupOptions, WorkerLostError

pytestmark = pytest.mark.faults

PROMPTS = [[5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15, 16]]


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_replica_killed_mid_rollout_is_named_in_one_line(tmp_path):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", "0123456789+=", TinyModelConfig(hidden_size=32,
                                                                                 intermediate_size=64,
                                                                                 num_hidden_layers=1))
    fleet = RolloutFleet.own_processes(2, model_dir, {"num_blocks": 64, "seed": 0}, GroupOptions(threads=1),
                                       load_tokenizer(model_dir), block_size=16)
    pids = [role.group._pids[0] for role in fleet.replicas]
    try:
        params = SamplingParams(n=2, max_tokens=4, seed=1)
        assert len(fleet.generate(PROMPTS, params)) == len(PROMPTS)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerLostError) as info:
            fleet.generate(PROMPTS, params)  # 4 prompts of no shared block: 2 routed to each replica
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"rollout1 worker rank 0 (pid {pids[1]}) died (killed by SIGKILL)")
        assert all(fleet.router.load(r) == 0 for r in range(2))  # the failed call's work left the router's load
    finally:
        fleet.close()
    assert gone(pids[0]) and gone(pids[1])
