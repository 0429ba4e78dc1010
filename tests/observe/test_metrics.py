"""Stage timer, metrics.jsonl sink (incl. crash tolerance and resume truncation), progress bar."""

import io
import json

import numpy as np
import pytest
import torch

from relayrl.errors import UserError
from relayrl.observe import MetricsLogger, Progress, StageTimer, read_metrics, truncate_metrics

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_stage_timer_accumulates_and_resets():
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with timer.stage("rollout"):
        clock.now += 2.0
    with timer.stage("update"):
        clock.now += 0.5
    with timer.stage("rollout"):
        clock.now += 1.0
    with pytest.raises(RuntimeError), timer.stage("score"):
        clock.now += 0.25
        raise RuntimeError("reward crashed")
    assert timer.pop() == {"time/rollout": 3.0, "time/update": 0.5, "time/score": 0.25}
    assert timer.pop() == {}


def test_stage_timer_real_clock():
    import time

    timer = StageTimer()
    with timer.stage("sleep"):
        time.sleep(0.02)
    assert 0.015 < timer.pop()["time/sleep"] < 1.0


def test_metrics_round_trip_converts_tensors_and_numpy(tmp_path):
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        logger.log(1, {"reward/mean": torch.tensor(0.5), "loss": np.float32(0.25), "n": 3})
        logger.log(2, {"reward/mean": 0.75})
    assert read_metrics(tmp_path) == [
        {"step": 1, "reward/mean": 0.5, "loss": 0.25, "n": 3.0},
        {"step": 2, "reward/mean": 0.75},
    ]
    logger = MetricsLogger(tmp_path, use_tensorboard=False)
    with pytest.raises(TypeError, match="'bad'"):
        logger.log(3, {"bad": "text"})
    with pytest.raises(TypeError):
        logger.log(3, {"vec": torch.ones(2)})
    logger.close()


def test_each_line_is_on_disk_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, use_tensorboard=False)
    logger.log(1, {"a": 1.0})
    # Not closed, as if the process were killed now: the line must already be readable.
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}]
    logger.close()


def test_read_metrics_tolerates_truncated_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"')
    assert read_metrics(tmp_path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a\n{"step": 3, "a": 3.0}\n')
    with pytest.raises(UserError, match="line 2"):
        read_metrics(tmp_path)
    assert read_metrics(tmp_path / "missing") == []


def test_truncate_metrics_makes_resumed_file_equal_uninterrupted(tmp_path):
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    with MetricsLogger(uninterrupted, use_tensorboard=False) as logger:
        for step in range(1, 7):
            logger.log(step, {"x": step / 10})

    # Killed after logging step 5 (and half of step 6); the last checkpoint was at step 3.
    with MetricsLogger(resumed, use_tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, {"x": step / 10})
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x"')
    with MetricsLogger(resumed, use_tensorboard=False, resume_step=3) as logger:
        assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3]
        for step in range(4, 7):
            logger.log(step, {"x": step / 10})
    expected = (uninterrupted / "metrics.jsonl").read_bytes()
    assert (resumed / "metrics.jsonl").read_bytes() == expected
    assert [p.name for p in resumed.iterdir()] == ["metrics.jsonl"]  # no temp file left behind

    truncate_metrics(tmp_path / "nothing_here", 3)  # no file: nothing to do


def test_tensorboard_scalars_written(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"reward/mean": 0.5})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 0.5}


def test_progress_non_tty_is_modest():
    out = io.StringIO()  # not a TTY, like a CI log
    with Progress(100, desc="train", file=out) as bar:
        for step in range(1, 51):
            bar.update(step, {"reward": 0.123456, "acc": torch.tensor(0.5)})
    text = out.getvalue()
    # First draw and the final one on close; the 5 s interval suppresses the 48 in between.
    assert text.count("\r") + text.count("\n") <= 4
    assert "50/100" in text and "reward=0.1235" in text and "acc=0.5" in text


def test_progress_resume_starts_at_initial():
    out = io.StringIO()
    with Progress(10, initial=4, file=out) as bar:
        bar.update(5)
    assert "5/10" in out.getvalue()
