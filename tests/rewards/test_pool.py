"""The reward pool: results equal to in-process scoring, the per-call bound across chunks, worker
replacement, and no worker process left behind (after close, a dead starting thread, or a SIGKILLed driver)."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from relayrl.data import Example, get_task
from relayrl.rewards import RewardPool

from helpers import importable, scorer

USER_MODULE = '''
import time

def length_bonus(completion, example, scale=1.0):
    return scale * len(completion)

def hang(completion, example):
    if completion.startswith("hang"):
        time.sleep(3600)
    return float(len(completion))

def picky(completion, example):
    if "x" in completion:
        raise ValueError("no x please")
    if completion.endswith(" "):
        return 10**400
    return completion == example.answer  # a bool counts as 1.0 / 0.0

def spawns(completion, example):
    import subprocess
    child = subprocess.Popen(["sleep", "3600"])
    with open(example.meta["pid_file"], "w") as f:
        f.write(str(child.pid))
    time.sleep(3600)

def slow(completion, example):
    time.sleep(0.001 * (len(completion) % 3))  # uneven call times: chunks finish out of order
    return len(completion) / 7
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("pool_rewards"), "pool_rewards", USER_MODULE) as d:
        yield d


def alive(pid: int) -> bool:
    """A pid that exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def random_batch(rng: random.Random, n: int):
    examples = get_task("arith").generate(8, seed=rng.randrange(1000)) + [Example("q", "1/2"), Example("q", "7")]
    exs = [rng.choice(examples) for _ in range(n)]
    pieces = ["", "7", "0.5", "\\boxed{1/2}", "12", "x", "\n", "ab c", "\\frac{1}{2}"]
    comps = [rng.choice([ex.answer, *pieces]) + rng.choice(["", "\nmore", " ", rng.choice(pieces)]) for ex in exs]
    return comps, exs


@pytest.mark.equivalence
def test_pool_results_equal_in_process_on_random_inputs(user_dir):
    functions = [{"name": "task"}, {"name": "format", "weight": 0.5}, {"name": "exact_match", "weight": 2.0},
                 {"name": "pool_rewards:length_bonus", "params": {"scale": 0.25}}, {"name": "pool_rewards:slow"},
                 {"name": "pool_rewards:picky"}, {"name": "math", "weight": 0.3}]
    rng = random.Random(0)
    with scorer(functions, workers=0) as local, scorer(functions, workers=2) as pooled:
        for n in (1, 7, 300):
            comps, exs = random_batch(rng, n)
            want, got = local.score(comps, exs, check=False), pooled.score(comps, exs, check=False)
            assert got == want  # every value, per function and summed, in order; failures and accuracy too
        # the inputs are not all alike: varied rewards, some correct, some failures (with their messages)
        assert len(set(want.rewards)) > 5 and 0 < sum(want.correct) < n
        assert 0 < want.failures_per_function["pool_rewards:picky"] < n and want.failures == want.failures_per_function[
            "pool_rewards:picky"]
        assert pooled.runner.restarts == 0


@pytest.mark.faults
def test_a_hang_is_one_timeout_and_the_rest_of_its_chunk_is_scored(user_dir):
    # One worker, so the hang sits in the middle of one chunk: the calls after it must be requeued, not lost.
    comps = ["a", "bb", "hang", "ccc", "dddd", "eeeee"]
    with scorer([{"name": "pool_rewards:hang"}], workers=1, timeout_s=1.0, on_failure=-1.0) as s:
        old = s.pids()
        t = time.monotonic()
        r = s.score(comps, [Example("q", "1")] * len(comps))
        took = time.monotonic() - t
        assert r.per_function["pool_rewards:hang"] == [1.0, 2.0, -1.0, 3.0, 4.0, 5.0]
        assert (r.failures, r.timeouts) == (1, 1) and r.timeouts_per_function == {"pool_rewards:hang": 1}
        assert r.first_errors["pool_rewards:hang"] == "timed out after 1 s (reward.timeout_s)"
        assert r.metrics()["reward/timeouts"] == 1.0 and r.metrics()["reward/failures"] == 1.0
        assert 1.0 <= took < 4.0
        assert s.pids() != old and not alive(old[0])  # the hung worker was killed and replaced
        t = time.monotonic()
        r = s.score(["x", "yy"], [Example("q", "1")] * 2)  # the next call only waits for the new worker to start
        assert r.rewards == [1.0, 2.0] and time.monotonic() - t < 3.0


@pytest.mark.faults
def test_a_killed_worker_takes_what_its_reward_started_with_it(user_dir, tmp_path):
    pid_file = tmp_path / "child.pid"
    with scorer([{"name": "pool_rewards:spawns"}], workers=1, timeout_s=1.0) as s:
        r = s.score(["x"], [Example("q", "1", meta={"pid_file": str(pid_file)})], check=False)
        assert r.timeouts == 1
        child = int(pid_file.read_text())
        deadline = time.monotonic() + 3.0
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)  # the worker's whole process group was killed


@pytest.mark.faults
def test_an_interrupted_run_leaves_a_working_pool(user_dir):
    def interrupt(*_):
        raise KeyboardInterrupt

    with scorer([{"name": "pool_rewards:hang"}], workers=1, timeout_s=60.0) as s:
        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(KeyboardInterrupt):
                s.score(["a", "hang", "b"], [Example("q", "1")] * 3)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        hung = s.pids()[0]
        t = time.monotonic()
        assert s.score(["abc", "de"], [Example("q", "1")] * 2).rewards == [3.0, 2.0]  # not the stale answers
        assert time.monotonic() - t < 3.0 and not alive(hung) and s.runner.restarts == 1


@pytest.mark.faults
def test_every_sample_timing_out_stops_the_run_in_one_line(user_dir):
    from relayrl.errors import RewardError

    with scorer([{"name": "pool_rewards:hang"}], workers=2, timeout_s=0.5) as s:
        with pytest.raises(RewardError) as e:
            s.score(["hang1", "hang2"], [Example("q", "1")] * 2)
        assert str(e.value) == ("every sample failed to score in reward function pool_rewards:hang: "
                                "timed out after 0.5 s (reward.timeout_s)")
        r = s.score(["ok"], [Example("q", "1")])  # the pool still works after the error
        assert r.rewards == [2.0]


@pytest.mark.unit
def test_close_leaves_no_worker_and_refuses_more_work(user_dir):
    s = scorer([{"name": "exact_match"}], workers=2)
    pids = s.pids()
    assert len(pids) == 2 and all(alive(p) for p in pids)
    assert s.score(["1"], [Example("q", "1")]).rewards == [1.0]
    s.close()
    assert not any(alive(p) for p in pids)
    s.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        s.score(["1"], [Example("q", "1")])


@pytest.mark.faults
def test_workers_started_from_a_thread_outlive_it():
    # PR_SET_PDEATHSIG fires when the forking *thread* exits: the pool forks from a thread of its own.
    box = []
    t = threading.Thread(target=lambda: box.append(RewardPool([("exact_match", {})], workers=1, timeout_s=5,
                                                              memory_mb=None, cpu_s=None)))
    t.start()
    t.join()
    pool = box[0]
    try:
        time.sleep(0.3)
        assert all(alive(p) for p in pool.pids())
        out = pool.run([(0, "7", Example("q", "7")), (0, "8", Example("q", "7"))])
        assert [o.value for o in out] == [1.0, 0.0] and pool.restarts == 0
    finally:
        pool.close()


KILLED_DRIVER = '''
import sys, threading
sys.path.insert(0, {dir!r})
from relayrl.data import Example
from relayrl.rewards import RewardConfig, build_scorer
s = build_scorer(RewardConfig.from_dict({{"functions": [{{"name": "pool_rewards:hang"}}], "timeout_s": 600}}))
print(" ".join(map(str, s.pids())), flush=True)
s.score(["hang", "a", "b"], [Example("q", "1")] * 3)  # one worker hangs in a call, the other goes idle
'''


@pytest.mark.faults
def test_no_worker_outlives_a_sigkilled_driver(user_dir):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER.format(dir=str(user_dir))], stdout=subprocess.PIPE,
                            text=True, cwd=os.getcwd())
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        time.sleep(0.5)  # let the calls start
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
