"""The code reward: the fraction of hidden tests a completion's Python passes, run in the sandbox and
judged outside it, from results the code cannot forge.

Each test is `{"call": "add(2, 3)", "expected": 5}` and runs in a sandbox run of its own:

    sandbox (one per test)                             host
    /sandbox/solution.py  <- the completion's code
    /code/main.py: import solution
                   value = eval(call)                  stdout ──> exactly one RESULT line, exit 0,
                   print RESULT json(value)                       no timeout, output under the cap
                                                                  ──> json value == expected ?

The expected value never enters the sandbox, so nothing the code does in there (print its own result
line, exit 0 before the call, patch json or print, write files, read everything it can reach) can
make a wrong value pass: a forged line only ever claims a value, and one that claims the right value
had to know it. A second result line, a malformed one, a missing one, a crash, a timeout or an output
flood all fail the test.

It imports the sandbox, relayrl.data and the reward registry; like all of rewards, it must never import
the trainer, the engine, sync or the controller.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from relayrl.data.tasks import Example
from relayrl.errors import DataError, RewardError
from relayrl.rewards.registry import register_reward
from relayrl.sandbox import Limits, RunResult, run

RESULT_MARK = "@@relayrl-result@@ "
SOLUTION_MODULE = "solution"
# A test calls one function: 8 processes/threads is plenty. memory_mb bounds a run's memory in total where the
# sandbox has a memory cgroup; elsewhere the rlimits are per process, so 8 x 512 MB (Limits() would allow 64 x).
DEFAULT_TEST_LIMITS = Limits(wall_s=5.0, cpu_s=5, memory_mb=512, processes=8, output_bytes=65536)
_FLOAT_TOLERANCE = 1e-9

_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[^\n]*\n(.*)\Z", re.DOTALL)
_PYTHON_TAGS = {"python", "python3", "py"}


@dataclass
class TestOutcome:
    """One test's verdict: passed, and why ("ok", "wrong answer", "timeout", "crashed: <line>", ...)."""

    __test__ = False  # not a pytest test class, despite its name

    passed: bool
    reason: str


@dataclass
class CodeResult:
    """The verdicts of every test of one completion, in the order of the tests."""

    passed: int
    total: int
    outcomes: list[TestOutcome] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_code(completion: str) -> str:
    """The last ```python block of the completion; else its last untagged ``` block; else an
    unclosed ```python block running to the end (generation stopped inside it); else the whole text."""
    blocks = [(tag.lower(), body) for tag, body in _BLOCK.findall(completion)]
    for wanted in (lambda tag: tag in _PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    tail = _OPEN_BLOCK.search(completion)
    return tail.group(1) if tail else completion


def run_tests(code: str, tests: list[dict], *, limits: Limits | None = None, workers: int = 2) -> CodeResult:
    """Run each test's call on `code`, each in its own sandbox run, `workers` runs at a time."""
    checked = [_check_test(i, t) for i, t in enumerate(tests)]
    limits = limits or DEFAULT_TEST_LIMITS
    if workers < 1:
        raise ValueError(f"workers must be >= 1 (got {workers})")

    def one(test: tuple[str, Any]) -> TestOutcome:
        call, expected = test
        result = run(harness(call), files={f"{SOLUTION_MODULE}.py": code}, limits=limits)
        return judge(result, expected)

    if workers == 1 or len(checked) <= 1:
        outcomes = [one(t) for t in checked]
    else:
        with ThreadPoolExecutor(max_workers=min(workers, len(checked)), thread_name_prefix="code-test") as pool:
            outcomes = list(pool.map(one, checked))
    return CodeResult(passed=sum(o.passed for o in outcomes), total=len(outcomes), outcomes=outcomes)


def harness(call: str) -> str:
    """The program one test runs in the sandbox: import the solution, evaluate the call in its
    namespace, print the value as one result line. It holds the call only, never the expected value."""
    return (f"import json, sys\n"
            f"import {SOLUTION_MODULE}\n"
            f"value = eval({call!r}, vars({SOLUTION_MODULE}))\n"
            f"sys.stdout.write('\\n' + {RESULT_MARK!r} + json.dumps(value) + '\\n')\n")


def judge(result: RunResult, expected: Any) -> TestOutcome:
    """A test's verdict from its sandbox run, decided here on the host."""
    if result.timed_out:
        return TestOutcome(False, "timeout")
    if result.output_truncated:
        return TestOutcome(False, "output limit exceeded")
    if result.exit_code != 0:
        lines = result.stderr.strip().splitlines()
        return TestOutcome(False, f"crashed: {lines[-1].strip() if lines else result.describe()}")
    records = [line[len(RESULT_MARK):] for line in result.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if len(records) != 1:
        return TestOutcome(False, "no result" if not records else f"{len(records)} result lines (one expected)")
    try:
        value = json.loads(records[0])
    except (ValueError, RecursionError):  # ValueError: bad JSON, or an int past Python's digit limit
        return TestOutcome(False, "malformed result")
    return TestOutcome(True, "ok") if same_value(value, expected) else TestOutcome(False, "wrong answer")


def same_value(got: Any, expected: Any) -> bool:
    """JSON equality with floats compared to a relative/absolute 1e-9, and no bool/number mixing
    (True is not 1). Depth-bounded by the caller's JSON: records are at most output_bytes long."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, int | float) and isinstance(got, int | float):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=_FLOAT_TOLERANCE, abs_tol=_FLOAT_TOLERANCE)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(same_value(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k]) for k in expected)
    if isinstance(expected, str | type(None)):
        return type(got) is type(expected) and got == expected
    return False


@register_reward("code_tests")
def code_tests_reward(completion: str, example: Example, workers: int = 2, **limits: Any) -> float:
    """The fraction of example.meta["tests"] the completion's code passes; `params` may set any
    sandbox limit (wall_s, cpu_s, memory_mb, ...) and how many tests run at once (workers)."""
    tests = example.meta.get("tests")
    if not isinstance(tests, list) or not tests:
        raise DataError("the code_tests reward needs example.meta['tests']: a non-empty list of "
                        "{'call': 'f(1)', 'expected': <JSON value>}")
    try:
        test_limits = Limits(**{**_limits_dict(DEFAULT_TEST_LIMITS), **limits})
    except TypeError:
        unknown = sorted(set(limits) - set(_limits_dict(DEFAULT_TEST_LIMITS)))
        raise RewardError(f"code_tests: unknown parameter(s) {', '.join(unknown)}: use workers or a sandbox "
                          f"limit ({', '.join(_limits_dict(DEFAULT_TEST_LIMITS))})") from None
    return run_tests(extract_code(completion), tests, limits=test_limits, workers=workers).fraction


def _limits_dict(limits: Limits) -> dict[str, Any]:
    return {name: getattr(limits, name) for name in limits.__dataclass_fields__}


def _check_test(index: int, test: Any) -> tuple[str, Any]:
    if not isinstance(test, dict) or not isinstance(test.get("call"), str) or "expected" not in test:
        raise DataError(f"code test {index} must be {{'call': 'f(1)', 'expected': <JSON value>}} (got {test!r:.200})")
    try:
        compile(test["call"], f"<test {index}>", "eval")
    except SyntaxError as e:
        raise DataError(f"code test {index}: call {test['call']!r:.200} is not a Python expression ({e.msg})") from None
    try:  # as the result will be: through JSON (tuples become lists)
        expected = json.loads(json.dumps(test["expected"]))
    except (TypeError, ValueError):
        raise DataError(f"code test {index}: expected {test['expected']!r:.200} is not a JSON value") from None
    return test["call"], expected
