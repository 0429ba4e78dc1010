"""The Reliability table of benchmarks/HISTORY.md (its newest figure heads RESULTS.md): every fault of the
fault-injection suite injected into a real `relayrl train` (the harness of tests/faults), and for each: did
the run survive it (go on, or stop in one line and resume), how much was lost, and how long it took to notice.

    python benchmarks/bench_reliability.py [--out table.md] [--only fleet]

Worker faults run with each role in worker processes of its own (parallel.heartbeat_timeout_s=3); the
time is from the signal to the driver's exit (detection plus teardown). Driver kills are followed by
`--resume`; "lost" counts checkpoints that vanished or stopped loading, and the final weights are
compared with an uninterrupted run's. Rollout-fleet faults (rollout.replicas 2) kill or stop one replica: the run
must go on, the replica come back (restarted and re-synced), and every step keep all its samples; the time is from
the signal to the end of the step that noticed it (the issue's "death to the step's completion"). With no replica
left the run must stop in one line with a checkpoint of its last finished step. A replica added to a live run with
`relayrl fleet` must join verified while the steps go on, none waiting for its engine's build.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "faults"), str(HERE.parent / "tests"), str(HERE.parent)]

import torch  # noqa: E402 - after the sys.path lines above, which the harness import needs
from safetensors.torch import load_file  # noqa: E402 - after the sys.path lines above

from harness import (  # noqa: E402 - found through the sys.path lines above
    ALL_ROLES,
    CHAOS,
    ROLE_PROCESS,
    TINY,
    TrainRun,
    descendants,
    leftovers,
    merged,
)

STEPS = {"run": {"steps": 3, "save_every": 1, "keep_last": 3}}


def worker_fault(tmp: Path, role: str, sig: int) -> dict:
    run = TrainRun(tmp, merged(TINY, ALL_ROLES))
    try:
        run.wait_for_step(1, timeout=180)
        tree = descendants(run.pid)
        run.signal(run.find(ROLE_PROCESS[role]), sig)
        code = run.wait(timeout=120)
        took = run.seconds_since_injection()
        one_line = len(run.error_lines()) == 1
        left = leftovers(tree)
    finally:
        run.kill()
    return {"survived": code == 3 and one_line and not left, "lost": 0, "seconds": took,
            "note": f"exit {code}, {'one line' if one_line else 'not one line'}, {len(left)} processes left"}


FLEET = merged(TINY, {
    "rollout": {"replicas": 2, "max_tokens": 8},
    "parallel": {"backend": "local", "placement": "disaggregated", "rollout_worker": True, "heartbeat_timeout_s": 3},
    "run": {"samples_every": 1, "samples_per_step": 4},
    "eval": {"every": 0},
})


def step_rows(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []:
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "reward/mean" in m:
            out.append(m)
    return out


def fleet_fault(tmp: Path, sig: int) -> dict:
    """One of 2 replicas killed or stopped after step 2: seconds from the signal to the end of the step that noticed
    it; survived = the run went on, the replica rejoined verified, and every step kept its 4 samples."""
    run = TrainRun(tmp, FLEET)
    noticed = joined = None
    try:
        run.wait_for_step(2, timeout=180)
        run.signal(run.find("rl-rollout1-0"), sig)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and joined is None and run.proc.poll() is None:
            ms = step_rows(run.run_dir)
            if noticed is None and any(m.get("fleet/lost") for m in ms):
                noticed = run.seconds_since_injection()
            if any(m.get("fleet/joined") for m in ms):
                joined = run.seconds_since_injection()
            time.sleep(0.05)
        code = run.proc.poll()
        ms = step_rows(run.run_dir)
    finally:
        run.kill()
    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    done = {m["step"] for m in ms[:-1]}  # the last step's samples may be unwritten when the run was stopped
    per_step: dict[int, int] = dict.fromkeys(done, 0)
    for r in samples:
        if r["split"] == "train" and r["step"] in done:
            per_step[r["step"]] += 1
    whole = all(n == 4 for n in per_step.values())
    ok = code is None and noticed is not None and joined is not None and whole
    return {"survived": ok, "lost": sum(4 - n for n in per_step.values()), "seconds": noticed or float("nan"),
            "note": f"the step noticing it ended {noticed or float('nan'):.1f} s after the signal; the replica "
                    f"rejoined verified after {joined or float('nan'):.1f} s; {len(ms)} steps, "
                    f"{'every step 4 samples' if whole else 'samples missing'}"}


def fleet_exhausted(tmp: Path) -> dict:
    """Both replicas killed, no restarts: one line, exit 3, a checkpoint of the last finished step."""
    run = TrainRun(tmp, FLEET, ["rollout.replica_restarts=0"])
    try:
        run.wait_for_step(2, timeout=180)
        for r in (0, 1):
            run.signal(run.find(f"rl-rollout{r}-0"), signal.SIGKILL)
        code = run.wait(timeout=120)
        took = run.seconds_since_injection()
        last = run.error_lines()[-1] if run.error_lines() else ""
        done = max(m["step"] for m in step_rows(run.run_dir))
        ckpts = sorted(p.name for p in (run.run_dir / "checkpoints").iterdir())
    finally:
        run.kill()
    held = ckpts[-1:] == [f"step_{done:08d}"]
    ok = code == 3 and last.startswith("relayrl: error: every rollout replica is lost") and held
    return {"survived": ok, "lost": 0, "seconds": took,
            "note": f"exit {code}, one line, checkpoint of step {done} {'written' if held else 'MISSING'}"}


def fleet_grow(tmp: Path) -> dict:
    """`relayrl fleet RUN_DIR --replicas 3` on a run of 2 replicas after step 2: the run goes on while the third
    replica's process builds its engine (the trainer does not wait for it), and it joins at a sync, verified. Reported:
    the seconds from the request to the step it served in, the steps that ran meanwhile, and those steps' median time
    against the median before the request (on 2 cores the build's own CPU shares them: a slowdown from sharing, not
    from waiting); survived = it joined, no step waited for it (each step until it served, the join step's included,
    took under a quarter of the time its build took), every step 4 samples."""
    import statistics
    import subprocess

    run = TrainRun(tmp, FLEET)
    joined = None
    try:
        run.wait_for_step(2, timeout=180)
        before = step_rows(run.run_dir)
        asked = time.monotonic()
        subprocess.run([sys.executable, "-m", "relayrl.cli.main", "fleet", str(run.run_dir), "--replicas", "3"],
                       cwd=HERE.parent, capture_output=True, text=True, timeout=120, check=True)
        deadline = asked + 180
        while time.monotonic() < deadline and run.proc.poll() is None:
            ms = step_rows(run.run_dir)
            if any(m.get("fleet/replicas") == 3 for m in ms):
                joined = time.monotonic() - asked
                break
            time.sleep(0.05)
        run.wait_for_step(len(step_rows(run.run_dir)) + 2, timeout=120)
        code = run.proc.poll()
        ms = step_rows(run.run_dir)
    finally:
        run.kill()
    first = next((i for i, m in enumerate(ms) if m.get("fleet/replicas") == 3), None)
    during = ms[len(before):first] if first is not None else []
    median = statistics.median(m["time/step"] for m in before[1:])  # the first step warms up
    median_sync = statistics.median(m["time/sync"] for m in before[1:])
    slowed = statistics.median(m["time/step"] for m in during) / median if during else float("nan")
    join_sync = ms[first]["time/sync"] if first is not None else float("nan")
    samples = [json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()]
    counts: dict[int, int] = {}
    for r in samples:
        if r["split"] == "train":
            counts[r["step"]] = counts.get(r["step"], 0) + 1
    whole = all(counts.get(m["step"]) == 4 for m in ms[:-1])
    longest = max((m["time/step"] for m in ms[len(before):first + 1]), default=float("nan")) if first else float("nan")
    ok = code is None and first is not None and whole and longest < (joined or 0) / 4
    at = ms[first]["step"] if first is not None else "-"
    return {"survived": ok, "lost": 0, "seconds": joined or float("nan"),
            "note": f"joined {joined or float('nan'):.1f} s after the request, verified at step {at}; {len(during)} "
                    f"steps ran meanwhile, their median {slowed:.2f}x the steps' before (the build shares the 2 "
                    f"cores), the longest {longest:.2f} s; the join step's sync {join_sync:.2f} s (before: median "
                    f"{median_sync:.2f} s); "
                    f"{'every step 4 samples' if whole else 'samples missing'}"}


def weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def driver_kill(tmp: Path, point: str, n: int, reference: dict) -> dict:
    killed = TrainRun(tmp / "killed", merged(TINY, STEPS), kill_at=(point, n))
    try:
        killed.wait(timeout=300)
    finally:
        killed.kill()
    before = sorted(p.name for p in (killed.run_dir / "checkpoints").iterdir() if not p.name.startswith("."))
    t0 = time.monotonic()
    resumed = TrainRun(tmp / "resumed", None, args=["--resume", str(killed.run_dir)])
    try:
        code = resumed.wait(timeout=300)
    finally:
        resumed.kill()
    same = code == 0 and all(torch.equal(a, b) for a, b in zip(weights(killed.run_dir).values(), reference.values(),
                                                                strict=True))
    return {"survived": same, "lost": 0 if code == 0 else len(before), "seconds": time.monotonic() - t0,
            "note": f"resumed from {before[-1]}; final weights {'equal' if same else 'DIFFER'} (s: the resume)"}


def reward_chaos(tmp: Path) -> dict:
    import os

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "chaos.py").write_text(CHAOS)
    os.environ["CHAOS_COUNTER"] = str(tmp / "calls")
    config = merged(TINY, {"rollout": {"prompts_per_step": 4, "group_size": 4},
                           "reward": {"functions": [{"name": f"{tmp / 'chaos.py'}:chaos"}], "timeout_s": 2,
                                      "memory_mb": 1024}, "run": {"steps": 2}})
    t0 = time.monotonic()
    run = TrainRun(tmp / "t", config)
    try:
        code = run.wait(timeout=300)
    finally:
        run.kill()
    steps = [m for m in map(json.loads, (run.run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in m]
    fails, timeouts = sum(m["reward/failures"] for m in steps), sum(m["reward/timeouts"] for m in steps)
    return {"survived": code == 0 and fails == 5, "lost": 0, "seconds": time.monotonic() - t0,
            "note": f"{fails:.0f} samples failed, {timeouts:.0f} timed out, run finished (s: the whole run)"}


def disk_full(tmp: Path) -> dict:
    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))

    run = TrainRun(tmp, merged(TINY, {"run": {"steps": 2, "save_every": 1}}), preexec=small_files)
    try:
        code = run.wait(timeout=300)
    finally:
        run.kill()
    ckpts = run.run_dir / "checkpoints"
    partial = [p.name for p in ckpts.iterdir()] if ckpts.exists() else []
    return {"survived": code == 2 and len(run.error_lines()) == 1 and not partial, "lost": 0, "seconds": float("nan"),
            "note": f"exit {code}, one line naming the directory and bytes, {len(partial)} partial checkpoints"}


def pytest_cases(path: str, keyword: str = "") -> dict:
    """Faults injected by a test module of tests/faults (files, sockets): how many cases held."""
    import subprocess

    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path] + (["-k", keyword] if keyword else [])
    out = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    passed = int(out.split(" passed")[0].split()[-1]) if " passed" in out else 0
    failed = " failed" in out
    return {"survived": passed > 0 and not failed, "lost": 0, "seconds": time.monotonic() - t0,
            "note": f"{out} (s: all cases)"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["fleet"], default=None, help="only the rollout fleet's faults")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            name = f"{'kill -9' if sig == signal.SIGKILL else 'SIGSTOP'} of one of 2 rollout replicas"
            rows.append((name, fleet_fault(root / f"fleet-{sig}", sig)))
            print(rows[-1], flush=True)
        rows.append(("kill -9 of both rollout replicas, no restarts left", fleet_exhausted(root / "fleet-none")))
        print(rows[-1], flush=True)
        rows.append(("relayrl fleet --replicas 3 on a live run of 2 (elastic)", fleet_grow(root / "fleet-grow")))
        print(rows[-1], flush=True)
        for role in ROLE_PROCESS if a.only is None else ():
            for sig in (signal.SIGKILL, signal.SIGSTOP):
                name = f"{'kill -9' if sig == signal.SIGKILL else 'SIGSTOP'} of the {role} worker"
                rows.append((name, worker_fault(root / f"{role}-{sig}", role, sig)))
                print(rows[-1], flush=True)
        if a.only is not None:
            return finish(rows, a.out)
        ref = TrainRun(root / "ref", merged(TINY, STEPS))
        ref.wait(timeout=300)
        ref.kill()
        reference = weights(ref.run_dir)
        for point, n in (("rollout", 3), ("shards-written", 2), ("before-rename", 2), ("after-save", 2)):
            result = driver_kill(root / f"d-{point}", point, n, reference)
            rows.append((f"kill -9 of the driver ({point}, step {n})", result))
            print(rows[-1], flush=True)
        rows.append(("reward: hang, sys.exit, os._exit, 10**400, 8 GB bomb", reward_chaos(root / "chaos")))
        rows.append(("disk full (RLIMIT_FSIZE) while checkpointing", disk_full(root / "disk")))
        rows.append(("crafted pickle in each checkpoint file (load and export), corrupt and truncated files",
                     pytest_cases("tests/faults/test_checkpoint_faults.py")))
        rows.append(("a peer without the run's token at the rendezvous",
                     pytest_cases("tests/faults/test_network_faults.py")))
    finish(rows, a.out)


def finish(rows: list, out: str | None) -> None:
    lines = ["| fault injected | survived | data lost | seconds | what happened |", "|---|---|---|---|---|"]
    for name, r in rows:
        secs = "" if r["seconds"] != r["seconds"] else f"{r['seconds']:.1f}"
        lines.append(f"| {name} | {'yes' if r['survived'] else 'NO'} | {r['lost']} | {secs} | {r['note']} |")
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
