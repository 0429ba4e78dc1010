"""The `python` environment: the model writes a function; hidden tests run it in the sandbox.

    user       Write a Python function f(x) that returns x*3+1.
    assistant  ```python\\ndef f(x):\\n    return x*3+1\\n```      reward = share of hidden tests passed

The tests (example.meta["tests"]: calls and expected values) never enter the sandbox: each runs there on
its own and its result is compared outside (relayrl.rewards.code.run_tests), so the model's code cannot
forge a pass. With `attempts` > 1 a failing answer is told how many tests failed and may try again.
Without bubblewrap the environment cannot be built (one line saying what to install).

It imports relayrl.data, relayrl.rewards (the code reward), relayrl.sandbox and the envs' own modules only.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from relayrl.data.chat import prompt_messages
from relayrl.data.tasks import Example
from relayrl.envs.base import StepResult, register_env
from relayrl.errors import EnvError
from relayrl.rewards.code import DEFAULT_TEST_LIMITS, extract_code, run_tests
from relayrl.sandbox import SandboxUnavailable, sandbox_available


@register_env("python")
class PythonEnv:
    tools: list = []

    def __init__(self, attempts: int = 1, wall_s: float = 5.0, memory_mb: int = 512):
        reason = sandbox_available()
        if reason is not None:
            raise SandboxUnavailable(f"the python environment runs code in the sandbox: {reason}")
        if not isinstance(attempts, int) or attempts < 1:
            raise EnvError(f"environment 'python': attempts must be an integer >= 1 (got {attempts!r})")
        # few processes: the address-space limit is per process, so processes x memory_mb bounds a run
        self.attempts = attempts
        self.limits = replace(DEFAULT_TEST_LIMITS, wall_s=wall_s, cpu_s=max(1, math.ceil(wall_s)), memory_mb=memory_mb)
        self.tries = 0

    def reset(self, example: Example) -> list[dict[str, Any]]:
        self.tests = example.meta.get("tests")
        if not self.tests:
            raise EnvError("environment 'python' needs examples with meta['tests'] (task: python)")
        self.tries = 0
        return prompt_messages(example.prompt)

    def step(self, message: dict[str, Any]) -> StepResult:
        self.tries += 1
        result = run_tests(extract_code(message["content"]), self.tests, limits=self.limits)
        passed = result.passed == result.total
        if passed or self.tries >= self.attempts:
            return StepResult(None, result.passed / result.total, True, {"success": passed})
        feedback = f"{result.total - result.passed} of {result.total} tests failed. Try again."
        return StepResult([{"role": "user", "content": feedback}], 0.0, False, {"success": False})
