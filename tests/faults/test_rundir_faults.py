"""One run per directory, and the run directory's own faults, each one line and exit 2 with nothing written lost:

    a second `relayrl train` (or `--resume`) into a live run's directory   refused naming the holder's pid; the
                                                                           directory is not touched
    the holder SIGKILLed (its run.lock left behind)                        the next --resume takes the stale lock
    a --resume refused (a layout the model does not fit, or a change of    config.yaml and every other file as
    the model: model.tiny.hidden_size)                                     they were; the plain --resume runs
    run.out_dir a file, below a file, or on a read-only file system       one line, nothing made
    the disk full while metrics.jsonl is written (half a line on disk)     whole lines only; --resume continues

The runs are tiny (tests/faults/harness.py); the full disk is tests/faults/full_disk.py (os.write fails with
ENOSPC after writing half a line, as a disk another process filled does).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.errors import RunDirError
from relayrl.jobs.run_dir import LOCK_FILE, RunDirLock
from relayrl.observe.metrics import MetricsLogger, read_metrics

from harness import REPO, TINY, TrainRun, merged

pytestmark = pytest.mark.faults

SAVED = merged(TINY, {"run": {"save_every": 1}})


def tree(run_dir: Path) -> dict[str, tuple]:
    """Every entry under run_dir: (size, mtime, sha1) of a file, None of a directory."""
    out = {}
    for p in sorted(run_dir.rglob("*")):
        rel = str(p.relative_to(run_dir))
        if p.is_dir():
            out[rel] = None
        else:
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
    return out


def trained_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir) if "reward/mean" in m]


def error_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("grpo:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("relayrl: error: "), lines
    return lines[0]


def test_a_second_run_into_a_live_runs_directory_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path, capsys):
    first = TrainRun(tmp_path, SAVED)
    run_dir = first.run_dir
    try:
        first.wait_for_step(2)
        os.killpg(first.pid, signal.SIGSTOP)  # the live run holds still while the others try
        before = tree(run_dir)
        assert f"pid={first.pid} " in (run_dir / LOCK_FILE).read_text()
        for argv in (["train", str(tmp_path / "config.yaml"), f"run.out_dir={run_dir}"],
                     ["train", "--resume", str(run_dir)]):
            assert main(argv) == 2
            line = error_line(capsys)
            assert f"{run_dir} is in use by relayrl train (pid {first.pid} on " in line, line
            assert tree(run_dir) == before  # nothing read-modified, created or removed
        os.killpg(first.pid, signal.SIGKILL)  # dies holding the lock: its run.lock stays, naming it
        first.wait()
    finally:
        first.kill()
    assert f"pid={first.pid} " in (run_dir / LOCK_FILE).read_text()
    last = max(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*"))
    resumed = TrainRun(tmp_path / "resume", None, [f"run.steps={last + 2}"], args=["--resume", str(run_dir)])
    try:
        assert resumed.wait(timeout=300) == 0, resumed.stderr()
    finally:
        resumed.kill()
    assert trained_steps(run_dir) == list(range(1, last + 3))  # each step once: no other run wrote in between
    assert not (run_dir / LOCK_FILE).exists()  # let go at its end


def test_a_refused_resume_changes_nothing_on_disk(tmp_path, capsys):
    run = TrainRun(tmp_path, merged(SAVED, {"run": {"steps": 2}}))
    try:
        assert run.wait(timeout=300) == 0, run.stderr()
    finally:
        run.kill()
    run_dir = run.run_dir
    before = tree(run_dir)
    # refused by the layout check once the model is read (it used to rewrite config.yaml first, so that the plain
    # --resume failed after it with the same error)
    assert main(["train", "--resume", str(run_dir), "parallel.backend=local", "parallel.tp=3"]) == 2
    assert "parallel.tp: tensor parallel degree 3 does not divide num_attention_heads = 4" in error_line(capsys)
    assert tree(run_dir) == before
    # a change of the model's shape (it used to be ignored, exit 0, while config.yaml claimed 64)
    assert main(["train", "--resume", str(run_dir), "model.tiny.hidden_size=64", "run.steps=3"]) == 2
    line = error_line(capsys)
    assert "--resume cannot change the model: model.tiny.hidden_size is 32 in the run, 64 given" in line, line
    assert tree(run_dir) == before
    # and of its source
    assert main(["train", "--resume", str(run_dir), f"model.path={run_dir / 'final_model'}", "run.steps=3"]) == 2
    assert "model.path is None in the run" in error_line(capsys)
    assert tree(run_dir) == before
    assert main(["train", "--resume", str(run_dir), "run.steps=3"]) == 0
    assert trained_steps(run_dir) == [1, 2, 3]
    assert "hidden_size: 32" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_an_out_dir_that_is_a_file_is_one_line_and_nothing_is_made(tmp_path, capsys, where):
    (tmp_path / "config.yaml").write_text(json.dumps(merged(TINY, {"run": {"steps": 1}})))
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    out = f if where == "file" else f / "run"
    assert main(["train", str(tmp_path / "config.yaml"), f"run.out_dir={out}"]) == 2
    line = error_line(capsys)
    expected = (f"{f} exists and is not a directory: set run.out_dir to a directory" if where == "file"
                else f"{f} is a file, so {out} cannot be made in it: set run.out_dir to a directory")
    assert expected in line, line
    assert f.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "notes.txt"]


def test_a_read_only_out_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """A read-only file system (EROFS from mkdir, simulated: a read-only mount needs root) and, where this runs as a
    user, a directory without write permission (real)."""
    (tmp_path / "config.yaml").write_text(json.dumps(merged(TINY, {"run": {"steps": 1}})))
    out = tmp_path / "ro" / "run"
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "mkdir", read_only)
        assert main(["train", str(tmp_path / "config.yaml"), f"run.out_dir={out}"]) == 2
    line = error_line(capsys)
    assert f"cannot write {out}: its file system is read-only; set run.out_dir to a writable" in line, line
    if os.geteuid() == 0:
        return  # root writes through permissions
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        assert main(["train", str(tmp_path / "config.yaml"), f"run.out_dir={locked / 'run'}"]) == 2
        assert f"cannot write {locked / 'run'}: permission denied" in error_line(capsys)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_a_full_disk_mid_line_leaves_whole_lines_and_is_raised(tmp_path, monkeypatch):
    """MetricsLogger alone: the write of step 3's line puts half of it on disk, then fails with ENOSPC."""
    log = MetricsLogger(tmp_path, use_tensorboard=False)
    log.log(1, {"loss": 0.5})
    log.log(2, {"loss": 0.25})
    real = os.write

    def full(fd, data):
        real(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "write", full)
        with pytest.raises(OSError) as e:
            log.log(3, {"loss": 0.125})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "metrics.jsonl")
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text == '{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.25}\n'  # the half line taken back
    log.log(3, {"loss": 0.125})  # space freed: the run's file goes on whole
    log.close()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]


def test_a_disk_full_while_metrics_are_written_is_one_line_and_resume_continues(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps(SAVED))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    # metrics.jsonl's 4th line: step 0's evaluation, steps 1 and 2, then step 3's (its checkpoint not written)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("full_disk.py")), "4", "train", str(cfg),
                           f"run.out_dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("grpo:") and "Warning" not in x
             and not x.startswith("  warnings.warn")]
    assert proc.returncode == 2, proc.stderr
    assert lines == [f"relayrl: error: cannot write {run_dir / 'metrics.jsonl'}: its disk is full; free space (or "
                     f"make it writable), then resume with relayrl train --resume {run_dir}"], lines
    raw = (run_dir / "metrics.jsonl").read_text()
    assert raw.endswith("\n") and [json.loads(x)["step"] for x in raw.splitlines()] == [0, 1, 2]  # whole lines only
    assert not (run_dir / LOCK_FILE).exists()
    resumed = TrainRun(tmp_path / "resume", None, ["run.steps=4"], args=["--resume", str(run_dir)])
    try:
        assert resumed.wait(timeout=300) == 0, resumed.stderr()
    finally:
        resumed.kill()
    assert trained_steps(run_dir) == [1, 2, 3, 4]


def test_the_lock_is_the_drivers_alone(tmp_path):
    """In one process a second RunDirLock on the directory is refused too (flock is per open file), a child forked
    from the holder holds no copy of it (a leftover child never keeps a directory locked), and a dead holder's file
    is taken over."""
    with RunDirLock(tmp_path, "train") as lock:
        assert lock.held
        with pytest.raises(RunDirError, match=rf"is in use by relayrl train \(pid {os.getpid()} on "):
            RunDirLock(tmp_path, "sft").__enter__()
        fd = lock._fd
        child = os.fork()
        if child == 0:
            try:
                os.fstat(fd)
            except OSError as e:
                os._exit(0 if e.errno == errno.EBADF else 2)
            os._exit(1)  # the child still holds the lock's open file
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.fstat(fd)  # the parent's is open, and still locks
        with pytest.raises(RunDirError):
            RunDirLock(tmp_path, "sft").__enter__()
    assert not (tmp_path / LOCK_FILE).exists()
    (tmp_path / LOCK_FILE).write_text("pid=999999999 host=elsewhere started=then command=train\n")  # a dead holder's
    with RunDirLock(tmp_path, "train"):
        assert f"pid={os.getpid()} " in (tmp_path / LOCK_FILE).read_text()
    assert not (tmp_path / LOCK_FILE).exists()


def test_sft_into_a_held_directory_is_refused_and_touches_nothing(tmp_path, capsys):
    run_dir = tmp_path / "sft"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine\n")
    with RunDirLock(run_dir, "train"):  # this process holds it, as a live run would
        before = tree(run_dir)
        assert main(["sft", "data.task=arith", "data.n_train=8", "data.n_eval=2", "sft.steps=1",
                     f"sft.out_dir={run_dir}"]) == 2
        line = error_line(capsys)
        assert f"{run_dir} is in use by relayrl train (pid {os.getpid()} on " in line, line
        assert line.endswith("or set sft.out_dir to another directory"), line
        assert tree(run_dir) == before
