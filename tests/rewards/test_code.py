"""The code reward: code extraction from completions, the per-test verdicts of run_tests on real
sandbox runs, the host-side comparison, and the registered `code_tests` reward. Attempts to forge a
pass are in tests/sandbox/test_attacks.py."""

from __future__ import annotations

import re

import pytest

from relayrl.data.tasks import Example
from relayrl.errors import DataError, RewardError
from relayrl.rewards.code import (
    CodeResult,
    TestOutcome,
    code_tests_reward,
    extract_code,
    harness,
    run_tests,
    same_value,
)
from relayrl.rewards.registry import get_reward_fn
from relayrl.sandbox import Limits, sandbox_available

UNAVAILABLE = sandbox_available()
needs_sandbox = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"sandbox unavailable: {UNAVAILABLE}")
QUICK = Limits(wall_s=3, cpu_s=3)
ADD_TESTS = [{"call": "add(2, 3)", "expected": 5}, {"call": "add(-1, 1)", "expected": 0},
             {"call": "add(10, 20)", "expected": 30}]


@pytest.mark.unit
def test_extract_code_takes_the_last_python_block():
    text = "Try:\n```python\ndef f(): return 1\n```\nBetter:\n```python\ndef f(): return 2\n```\nDone."
    assert extract_code(text) == "def f(): return 2\n"
    assert extract_code("```py\nx = 1\n```") == "x = 1\n"
    # a python block wins over a later block in another language
    assert extract_code("```python\na = 1\n```\n```bash\nls\n```") == "a = 1\n"
    assert extract_code("Here:\n```\nb = 2\n```") == "b = 2\n"  # untagged block when no python one
    assert extract_code("```python\ndef g():\n    return 3") == "def g():\n    return 3"  # cut off mid-block
    assert extract_code("def h(): return 4") == "def h(): return 4"  # no block: the whole text


@pytest.mark.unit
def test_same_value_compares_json_values_strictly():
    assert same_value(5, 5) and same_value(5.0, 5) and same_value(0.1 + 0.2, 0.3)
    assert not same_value(True, 1) and not same_value(1, True) and same_value(False, False)
    assert not same_value(float("nan"), float("nan")) and not same_value(5.1, 5)
    assert same_value([1, [2, "a"]], [1, [2, "a"]]) and not same_value([1, 2], [1, 2, 3])
    assert same_value({"a": [1.0]}, {"a": [1]}) and not same_value({"a": 1}, {"a": 1, "b": 2})
    assert same_value(None, None) and not same_value("1", 1) and not same_value(None, 0)


@pytest.mark.unit
def test_the_harness_holds_the_call_but_never_an_expected_value():
    program = harness("add(2, 3)")
    assert "'add(2, 3)'" in program and "5" not in program


@pytest.mark.unit
@needs_sandbox
def test_a_correct_solution_passes_every_test():
    result = run_tests("def add(a, b):\n    return a + b\n", ADD_TESTS, limits=QUICK)
    assert isinstance(result, CodeResult)
    assert (result.passed, result.total, result.fraction) == (3, 3, 1.0)
    assert result.outcomes == [TestOutcome(True, "ok")] * 3


@pytest.mark.faults
@needs_sandbox
def test_each_failure_says_why():
    code = ("import time\n"
            "def add(a, b):\n"
            "    if a == 2:\n"
            "        return 6\n"
            "    if a == -1:\n"
            "        return (a + b) / 0\n"
            "    while True:\n"
            "        pass\n")
    result = run_tests(code, ADD_TESTS, limits=Limits(wall_s=1, cpu_s=5))
    assert result.passed == 0 and result.fraction == 0.0
    assert [o.reason for o in result.outcomes] == ["wrong answer", "crashed: ZeroDivisionError: division by zero",
                                                   "timeout"]


@pytest.mark.unit
@needs_sandbox
def test_a_solution_that_does_not_compile_or_floods_output_fails_every_test():
    broken = run_tests("def add(a, b)\n    return a + b\n", ADD_TESTS[:1], limits=QUICK)
    assert broken.outcomes[0].passed is False and broken.outcomes[0].reason.startswith("crashed: SyntaxError")
    flood = run_tests("def add(a, b):\n    print('x' * 100000)\n    return a + b\n", ADD_TESTS[:1],
                      limits=Limits(wall_s=3, output_bytes=4096))
    assert flood.outcomes == [TestOutcome(False, "output limit exceeded")]
    missing = run_tests("def plus(a, b):\n    return a + b\n", ADD_TESTS[:1], limits=QUICK)
    assert missing.outcomes == [TestOutcome(False, "crashed: NameError: name 'add' is not defined")]


@pytest.mark.unit
@needs_sandbox
def test_each_test_runs_in_a_fresh_sandbox():
    # the call counts itself in a file of the working directory: 1 every time only if nothing is shared
    code = ("import os\n"
            "def visits(_):\n"
            "    n = int(open('count').read()) + 1 if os.path.exists('count') else 1\n"
            "    open('count', 'w').write(str(n))\n"
            "    return n\n")
    tests = [{"call": f"visits({i})", "expected": 1} for i in range(4)]
    assert run_tests(code, tests, limits=QUICK, workers=2).passed == 4


@pytest.mark.unit
@needs_sandbox
def test_results_keep_the_order_of_the_tests_with_several_workers():
    code = "def sq(x):\n    return x * x\n"
    tests = [{"call": f"sq({i})", "expected": i * i if i % 2 else -1} for i in range(6)]
    result = run_tests(code, tests, limits=QUICK, workers=3)
    assert [o.passed for o in result.outcomes] == [i % 2 == 1 for i in range(6)]


@pytest.mark.unit
@needs_sandbox
def test_values_go_through_json_on_both_sides():
    code = "def pair(a):\n    return (a, [a])\ndef flag():\n    return True\ndef half():\n    return 0.1 + 0.2\n"
    tests = [{"call": "pair(1)", "expected": (1, [1])}, {"call": "flag()", "expected": 1},
             {"call": "half()", "expected": 0.3}, {"call": "pair(2)", "expected": {"a": 2}}]
    assert [o.passed for o in run_tests(code, tests, limits=QUICK).outcomes] == [True, False, True, False]


@pytest.mark.unit
@needs_sandbox
def test_a_result_that_is_not_json_crashes_the_test():
    result = run_tests("def s():\n    return {1, 2}\n", [{"call": "s()", "expected": [1, 2]}], limits=QUICK)
    assert result.outcomes[0].reason == "crashed: TypeError: Object of type set is not JSON serializable"


@pytest.mark.unit
def test_malformed_tests_are_one_line_data_errors():
    with pytest.raises(DataError, match="code test 1 must be"):
        run_tests("", [{"call": "f()", "expected": 1}, {"call": "f()"}])
    with pytest.raises(DataError, match=re.escape("code test 0: call 'f(' is not a Python expression")):
        run_tests("", [{"call": "f(", "expected": 1}])
    with pytest.raises(DataError, match="code test 0: expected .* is not a JSON value"):
        run_tests("", [{"call": "f()", "expected": {1, 2}}])


@pytest.mark.unit
@needs_sandbox
def test_the_registered_reward_is_the_fraction_of_tests_passed():
    assert get_reward_fn("code_tests") is code_tests_reward
    example = Example(prompt="write add", answer="", meta={"tests": ADD_TESTS})
    completion = "Sure.\n```python\ndef add(a, b):\n    return a + b if a != 10 else 0\n```\n"
    assert code_tests_reward(completion, example, wall_s=3) == pytest.approx(2 / 3)
    assert code_tests_reward("I don't know.", example, wall_s=3) == 0.0


@pytest.mark.unit
def test_the_reward_refuses_unknown_parameters_and_missing_tests():
    example = Example(prompt="p", answer="", meta={"tests": ADD_TESTS})
    with pytest.raises(RewardError, match="unknown parameter.*timeout"):
        code_tests_reward("", example, timeout=3)
    with pytest.raises(DataError, match="needs example.meta\\['tests'\\]"):
        code_tests_reward("", Example(prompt="p", answer=""))


@pytest.mark.unit
def test_code_tests_is_found_by_name_in_a_fresh_interpreter():
    import subprocess
    import sys

    code = "from relayrl.rewards.registry import get_reward_fn; print(get_reward_fn('code_tests').__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "code_tests_reward"
