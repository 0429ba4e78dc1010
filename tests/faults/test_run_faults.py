"""Faults a whole run must survive or report in one line: a reward function that hangs, exits, calls
os._exit, returns an overflowing value or allocates far past its memory limit (the run goes on, each
such sample counted), and a disk that fills up while a checkpoint is written (one line naming the
directory and the bytes needed; no partial checkpoint visible)."""

from __future__ import annotations

import json
import resource
import signal

import pytest

from harness import CHAOS, TINY, TrainRun, merged

pytestmark = pytest.mark.faults


def test_a_misbehaving_reward_function_fails_only_its_samples(tmp_path, monkeypatch):
    (tmp_path / "chaos.py").write_text(CHAOS)
    monkeypatch.setenv("CHAOS_COUNTER", str(tmp_path / "calls"))
    config = merged(TINY, {"rollout": {"prompts_per_step": 4, "group_size": 4},
                           "reward": {"functions": [{"name": f"{tmp_path / 'chaos.py'}:chaos"}], "timeout_s": 2,
                                      "memory_mb": 1024},
                           "run": {"steps": 2}})
    run = TrainRun(tmp_path / "t", config)
    try:
        assert run.wait(timeout=300) == 0, run.stderr()
    finally:
        run.kill()
    steps = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward/mean" in m]
    assert len(steps) == 2
    assert sum(m["reward/failures"] for m in steps) == 5  # the hang, exit, _exit, 10**400 and the bomb
    assert sum(m["reward/timeouts"] for m in steps) == 1
    assert (tmp_path / "calls").stat().st_size == 8 + 2 * 16 + 8  # every call ran exactly once


def test_disk_full_while_checkpointing_is_one_line_and_leaves_nothing_partial(tmp_path):
    limit = 150_000  # bytes per file: the tiny base model (~90 kB) fits, a checkpoint shard (~300 kB) does not

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = TrainRun(tmp_path, merged(TINY, {"run": {"steps": 2, "save_every": 1}}), preexec=small_files)
    try:
        code = run.wait(timeout=300)
    finally:
        run.kill()
    lines = run.error_lines()
    assert code == 2, run.stderr()
    assert len(lines) == 1, lines
    assert lines[0].startswith("relayrl: error: ") and "checkpoints" in lines[0] and "bytes" in lines[0], lines
    ckpts = run.run_dir / "checkpoints"
    assert not ckpts.exists() or [p.name for p in ckpts.iterdir()] == []  # nothing partial, not even hidden
    assert [json.loads(x)["step"] for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
