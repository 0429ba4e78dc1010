"""kill -9 of the driver at several points — mid-step, mid-checkpoint (shards written, run state not;
everything written, not renamed), right after a checkpoint — then `relayrl train --resume`: the final
weights equal an uninterrupted run's, bit for bit, and no process of the killed run is left (its
reward pool, its actor workers: each dies with its parent). A run whose newest checkpoint is corrupt
resumes from the one before and says so in one line."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from harness import TINY, TrainRun, descendants, leftovers, merged

pytestmark = pytest.mark.faults

STEPS = {"run": {"steps": 3, "save_every": 1, "keep_last": 3}}
LOCAL = {"parallel": {"backend": "local", "heartbeat_timeout_s": 5}}  # the actor in a worker process


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same runs, never killed (one process, and with the actor in a worker)."""
    out = {}
    for name, extra in (("none", {}), ("local", LOCAL)):
        run = TrainRun(tmp_path_factory.mktemp(f"ref-{name}"), merged(TINY, STEPS, extra))
        try:
            assert run.wait(timeout=300) == 0, run.stderr()
            out[name] = final_weights(run.run_dir)
        finally:
            run.kill()
    return out


@pytest.mark.parametrize("point,n,backend", [
    ("rollout", 3, "none"),          # mid step 3: steps 1 and 2 checkpointed
    ("shards-written", 2, "none"),   # the step-2 checkpoint half written (shards, no run state, no manifest)
    ("before-rename", 2, "none"),    # the step-2 checkpoint written in full under its temporary name
    ("after-save", 2, "none"),       # right after the step-2 checkpoint was published
    ("rollout", 3, "local"),         # mid step 3 with the actor in a worker process: it dies with the driver
])
def test_killed_driver_resumes_to_the_same_weights(tmp_path, uninterrupted, point, n, backend):
    config = merged(TINY, STEPS, LOCAL if backend == "local" else {})
    killed = TrainRun(tmp_path / "killed", config, kill_at=(point, n))
    try:
        # snapshot the process tree from the start as it grows, until the kill: a run can reach its kill point
        # within one poll of its first step's metrics, so waiting for them first could miss every child
        tree: dict[int, str] = {}
        deadline = time.monotonic() + 180
        while killed.proc.poll() is None and time.monotonic() < deadline:
            tree |= descendants(killed.pid)
            time.sleep(0.05)
        assert killed.proc.returncode == -9, killed.stderr()
        assert any(s >= 1 for s in killed.steps()), killed.stderr()  # it trained a step before it was killed
        assert leftovers(tree) == [], {p: tree[p] for p in leftovers(tree, 0)}
        if backend == "local":
            assert "rl-actor-0" in tree.values()
        assert "rl-reward-pool" in tree.values()
    finally:
        killed.kill()
    ckpts = sorted(p.name for p in (killed.run_dir / "checkpoints").iterdir() if not p.name.startswith("."))
    expected = {"rollout": ["step_00000001", "step_00000002"], "shards-written": ["step_00000001"],
                "before-rename": ["step_00000001"], "after-save": ["step_00000001", "step_00000002"]}[point]
    assert ckpts == expected  # a half-written checkpoint is never visible under its final name
    resumed = TrainRun(tmp_path / "resumed", None, command="train", args=["--resume", str(killed.run_dir)])
    try:
        assert resumed.wait(timeout=300) == 0, resumed.stderr()
    finally:
        resumed.kill()
    assert_same_weights(final_weights(killed.run_dir), uninterrupted[backend])


def test_a_corrupt_newest_checkpoint_falls_back_in_one_line(tmp_path, uninterrupted):
    first = TrainRun(tmp_path / "first", merged(TINY, STEPS), kill_at=("rollout", 3))
    try:
        first.wait(timeout=300)
    finally:
        first.kill()
    # a copy of the run whose every checkpoint is damaged: --resume stops in one line, starts nothing
    hopeless = tmp_path / "hopeless"
    shutil.copytree(first.run_dir, hopeless)
    for ckpt in (hopeless / "checkpoints").glob("step_*"):
        (ckpt / "extra.json").write_text("{")
    nothing = TrainRun(tmp_path / "nothing", None, command="train", args=["--resume", str(hopeless)])
    try:
        assert nothing.wait(timeout=120) == 2
    finally:
        nothing.kill()
    lines = nothing.error_lines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"relayrl: error: no valid checkpoint in {hopeless}/checkpoints"), lines
    assert "step_00000002" in nothing.stderr() and "step_00000001" in nothing.stderr()  # each skipped, with why

    shard = next((first.run_dir / "checkpoints" / "step_00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, different checksum
    shard.write_bytes(bytes(data))
    resumed = TrainRun(tmp_path / "resumed", None, command="train", args=["--resume", str(first.run_dir)])
    try:
        assert resumed.wait(timeout=300) == 0, resumed.stderr()
    finally:
        resumed.kill()
    skipped = [x for x in resumed.stderr().splitlines() if x.startswith("relayrl: skipping checkpoint")]
    assert len(skipped) == 1 and "step_00000002" in skipped[0] and shard.name in skipped[0], skipped
    assert_same_weights(final_weights(first.run_dir), uninterrupted["none"])
