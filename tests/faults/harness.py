"""Running `relayrl train` as a real process tree and breaking it from outside: the harness of the
fault-injection suite (tests/faults) and of benchmarks/bench_reliability.py.

    run = TrainRun(tmp, config, overrides)      python -m relayrl.cli.main train ... (a process group
                                                of its own), stdout / stderr to files
    run.wait_for_step(1)                        metrics.jsonl has that step
    pid = run.find("rl-actor-0")                a descendant by its process name (set by
                                                relayrl.parallel.launch for every worker it starts)
    run.signal(pid, SIGKILL | SIGSTOP)          the fault, and the time it was injected
    code = run.wait()                           the driver's exit status
    run.error_lines()                           stderr without progress bars and warnings
    run.leftovers(pids)                         which of these processes are still alive

Processes are found through /proc, so this runs on Linux only (as the suite does).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

# a tiny run: every step takes a fraction of a second, so faults land mid-run
TINY = {
    "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "init_std": 0.2}},
    "data": {"task": "arith", "n_train": 64, "n_eval": 8},
    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_tokens": 4},
    "trainer": {"micro_batch_size": 8, "lr": 1e-3},
    "eval": {"max_tokens": 2},
    "reward": {"workers": 1},
    "run": {"steps": 1000, "save_every": 0, "loggers": []},
}

# a user reward function whose calls 9-13 of a run misbehave (1-8 are the first held-out evaluation's):
# a hang, sys.exit, os._exit, a value too big for a float, an 8 GB allocation
CHAOS = '''
import os, sys, time

def chaos(completion, example):
    """Calls 9-13 of the run misbehave (1-8 are the first held-out evaluation's): each call appends
    a byte to a counter file first, so the count is exact across the worker processes it kills."""
    fd = os.open(os.environ["CHAOS_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, b".")
    os.close(fd)
    n = os.path.getsize(os.environ["CHAOS_COUNTER"])
    if n == 9:
        time.sleep(3600)
    if n == 10:
        sys.exit(3)
    if n == 11:
        os._exit(7)
    if n == 12:
        return 10**400
    if n == 13:
        block = bytearray(8 * 2**30)
    return 1.0
'''

# every role of the loop in worker processes of its own: actor, reference, rollout, reward
ALL_ROLES = {"algo": {"kl_coef": 0.05},
             "parallel": {"backend": "local", "placement": "disaggregated", "rollout_worker": True,
                          "reward_workers": 1, "heartbeat_timeout_s": 3}}
ROLE_PROCESS = {"actor": "rl-actor-0", "reference": "rl-reference-0", "rollout": "rl-rollout-0",
                "reward": "rl-reward-0"}


def merged(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def process_table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, name) of every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), fields[0], name)
    return table


def descendants(root: int) -> dict[int, str]:
    """pid -> name of every live process below `root`."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if table[pid][1] != "Z":
            out[pid] = table[pid][2]
        todo.extend(children.get(pid, []))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited; only its entry waits to be reaped


class TrainRun:
    """`relayrl <command> CONFIG overrides...` in a process group of its own, watched from outside."""

    def __init__(self, tmp: Path, config: dict | None, overrides: list[str] = (), *, command: str = "train",
                 args: list[str] = (), kill_at: tuple[str, int] | None = None, preexec=None):
        """kill_at=(point, n): the driver SIGKILLs itself there (tests/faults/kill_driver.py)."""
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.run_dir = tmp / "run"
        launcher = ["-m", "relayrl.cli.main"] if kill_at is None else \
            [str(Path(__file__).with_name("kill_driver.py")), kill_at[0], str(kill_at[1])]
        argv = [sys.executable, *launcher, command, *args]
        if config is not None:
            cfg = tmp / "config.yaml"
            cfg.write_text(yaml.safe_dump(config))
            argv += [str(cfg), f"run.out_dir={self.run_dir}"]
        argv += list(overrides)
        self.out, self.err = (tmp / "stdout.txt").open("w"), (tmp / "stderr.txt").open("w")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self.out, stderr=self.err, env=env,
                                     start_new_session=True, preexec_fn=preexec)
        self.injected_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                m = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if "reward/mean" in m:
                out.append(m["step"])
        return out

    def wait_for_step(self, step: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the run exited ({self.proc.returncode}) before step {step}:\n{self.stderr()}")
            if any(s >= step for s in self.steps()):
                return
            time.sleep(0.1)
        raise AssertionError(f"no step {step} within {timeout}s:\n{self.stderr()}")

    def find(self, name: str, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = [p for p, n in descendants(self.pid).items() if n == name]
            if pids:
                return pids[0]
            time.sleep(0.1)
        raise AssertionError(f"no process named {name} under the run: {descendants(self.pid)}")

    def signal(self, pid: int, sig: int) -> None:
        os.kill(pid, sig)
        self.injected_at = time.monotonic()

    def wait(self, timeout: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.out.flush()
            self.err.flush()

    def seconds_since_injection(self) -> float:
        return time.monotonic() - self.injected_at

    def stderr(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return (self.tmp / "stderr.txt").read_text()

    def error_lines(self) -> list[str]:
        """What the run said on stderr, without progress bars, warnings and their source lines."""
        keep = []
        for line in self.stderr().splitlines():
            if not line.strip() or line.startswith(("grpo:", "sft:", "  warnings.warn", "relayrl: skipping")):
                continue
            if "Warning:" in line or line.startswith(("[W", "[E", "Exception raised from", "frame #", "<omitting")):
                continue
            keep.append(line)
        return keep

    def kill(self) -> None:
        """Stop whatever is left of the run (test cleanup)."""
        for pid in [self.pid, *descendants(self.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.out.close()
        self.err.close()


def leftovers(pids, timeout: float = 10.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` seconds for them to go."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left
