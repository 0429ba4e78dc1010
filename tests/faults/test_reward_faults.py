"""Fault injection into reward functions: a hang, sys.exit, os._exit, a SIGKILL (what the OOM killer
does), a memory bomb, a CPU spin, and values that are not finite reals each fail only their sample
(scored reward.on_failure and counted) while the scorer goes on; a function failing everywhere, or one
that cannot load, stops the run in one line; math-verify on a pathological input returns in time."""

import time
from fractions import Fraction

import pytest

from relayrl.data import Example
from relayrl.errors import ConfigError, RewardError

from helpers import importable, scorer

pytestmark = pytest.mark.faults

CHAOS = '''
import math, os, signal, sys, time
from fractions import Fraction

def chaos(completion, example):
    if completion == "exit":
        sys.exit(3)
    if completion == "_exit":
        os._exit(7)
    if completion == "oom":
        os.kill(os.getpid(), signal.SIGKILL)
    if completion == "bomb":
        block = bytearray(10 * 2**30)  # 10 GB, far over reward.memory_mb
    if completion == "spin":
        while True:
            pass
    if completion == "hang":
        time.sleep(3600)
    values = {"big": 10**400, "nan": math.nan, "inf": -math.inf, "complex": 1 + 2j, "str": "1.0", "none": None,
              "true": True, "half": Fraction(1, 2)}
    return values.get(completion, 1.0)

def always_exits(completion, example):
    os._exit(1)
'''

CASES = {  # completion: (value, the start of its failure message or None)
    "ok": (1.0, None),
    "exit": (-0.5, "called sys.exit(3)"),
    "_exit": (-0.5, "the reward worker exited with code 7"),
    "oom": (-0.5, "the reward worker was killed by SIGKILL during the call (out of memory?)"),
    "bomb": (-0.5, "MemoryError"),
    "spin": (-0.5, "used more than 1 s of CPU time (reward.cpu_s)"),
    "big": (-0.5, "returned an int too large for a float"),
    "nan": (-0.5, "returned nan, expected a finite real number"),
    "inf": (-0.5, "returned -inf, expected a finite real number"),
    "complex": (-0.5, "returned (1+2j) (complex), expected a finite real number"),
    "str": (-0.5, "returned '1.0' (str), expected a finite real number"),
    "none": (-0.5, "returned None (NoneType)"),
    "true": (1.0, None),
    "half": (0.5, None),
}


@pytest.fixture(scope="module")
def chaos_module(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("chaos"), "chaos_rewards", CHAOS) as d:
        yield d


def test_each_fault_fails_only_its_sample_and_the_scorer_goes_on(chaos_module):
    comps = list(CASES) + ["ok"]
    exs = [Example("q", "1")] * len(comps)
    cfg = dict(workers=2, timeout_s=20.0, cpu_s=1, memory_mb=512, on_failure=-0.5)
    with scorer([{"name": "chaos_rewards:chaos"}, {"name": "exact_match"}], **cfg) as s:
        r = s.score(comps, exs)
        assert r.per_function["chaos_rewards:chaos"] == [v for v, _ in CASES.values()] + [1.0]
        n_fail = sum(m is not None for _, m in CASES.values())
        assert r.failures == n_fail and r.failures_per_function == {"chaos_rewards:chaos": n_fail, "exact_match": 0}
        assert r.timeouts == 0  # the spin is stopped by its CPU limit, long before the timeout
        expected = [v + (1.0 if c == "1" else 0.0)
                    for c, (v, _) in zip(comps, [*CASES.values(), (1.0, None)], strict=True)]
        assert r.rewards == expected
        assert s.runner.restarts == 3  # _exit, oom and spin cost their workers; the others do not
        # each failure's own message (the pool's outcomes, in order)
        outs = s.runner.run([(0, c, ex) for c, ex in zip(comps, exs, strict=True)])
        for c, o in zip(comps, outs, strict=True):
            want = CASES[c][1]
            assert (o.error is None) if want is None else o.error.startswith(want), (c, o)
        assert s.score(["1"], [Example("q", "1")]).rewards == [2.0]


def test_a_hang_is_a_timeout_and_the_run_goes_on(chaos_module):
    with scorer([{"name": "chaos_rewards:chaos"}], workers=2, timeout_s=1.0) as s:
        t = time.monotonic()
        r = s.score(["hang", "ok", "half"], [Example("q", "1")] * 3)
        assert time.monotonic() - t < 4.0
        assert r.per_function["chaos_rewards:chaos"] == [0.0, 1.0, 0.5]
        assert (r.failures, r.timeouts) == (1, 1)
        assert s.score(["half"], [Example("q", "1")]).rewards == [0.5]


def test_a_function_failing_on_every_sample_stops_in_one_line(chaos_module):
    with scorer([{"name": "task"}, {"name": "chaos_rewards:always_exits"}], workers=2) as s:
        with pytest.raises(RewardError) as e:
            s.score(["1", "2"], [Example("q", "1")] * 2)
    assert str(e.value) == ("every sample failed to score in reward function chaos_rewards:always_exits: "
                            "the reward worker exited with code 1 during the call (os._exit or a crash)")


def test_functions_that_cannot_load_fail_at_start_in_one_line(tmp_path):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(5)\ndef f(c, e):\n    return 1.0\n")
    cases = [
        ([{"name": f"{tmp_path}/exits_on_import.py:f"}], {}, RewardError, "SystemExit"),
        ([{"name": "no_such_module_xyz:f"}], {}, RewardError, "ModuleNotFoundError"),
        ([{"name": "format", "params": {"nope": 1}}], {}, ConfigError, "reward.functions.0.params"),
        ([{"name": "exact_match"}], {"memory_mb": 64}, ConfigError, "reward.memory_mb: 64 is less than"),
    ]
    for functions, kw, error, text in cases:
        with pytest.raises(error) as e:
            scorer(functions, **kw)
        assert text in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_math_verify_on_a_pathological_input_returns_in_time():
    tower = "\\boxed{9^{9^{9^{9}}}}"
    exs = [Example("q", "1"), Example("q", "1/2")]
    # the pool's bound: killed at timeout_s, counted, the other sample scored
    with scorer([{"name": "math"}], workers=2, timeout_s=1.5) as s:
        t = time.monotonic()
        r = s.score([tower, "0.5"], exs)
        assert time.monotonic() - t < 4.0
        assert r.per_function["math"] == [0.0, 1.0] and (r.failures, r.timeouts) == (1, 1)
    # with the default timeout, math-verify's own alarm (in the worker's main thread) gives up first: a plain 0
    with scorer([{"name": "math"}], workers=1) as s:
        t = time.monotonic()
        r = s.score([tower, "0.5"], exs)
        assert time.monotonic() - t < 8.0
        assert r.per_function["math"] == [0.0, 1.0] and (r.failures, r.timeouts) == (0, 0)
        assert s.runner.restarts == 0


def test_values_are_checked_the_same_in_process():
    from relayrl.rewards.calls import to_reward

    assert to_reward(True) == (1.0, None) and to_reward(Fraction(3, 4)) == (0.75, None) and to_reward(7) == (7.0, None)
    for bad in (10**400, float("nan"), float("inf"), 1j, "1.0", None, [1.0]):
        value, error = to_reward(bad)
        assert value is None and "\n" not in error
