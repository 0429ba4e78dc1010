"""ToolEnv is the base of environments where the model may call tools before it answers.

    model turn holds <tool_call>...</tool_call>  ──>  each call runs (relayrl.envs.tools.ToolRunner); the results
                                                     come back as tool messages, the episode goes on
    model turn holds no tool call               ──>  it is the answer: `answer(text)` scores it, the episode ends

A malformed call, an unknown tool, wrong arguments, a tool that raises or runs out of time come back to
the model as an error message (never a crash), counted in the step's info (tool_calls, tool_errors,
tool_timeouts). Runners are shared by the episodes of the same tools and timeout, so a step's hundreds of
episodes share one bounded thread pool.

It imports the standard library, relayrl.data and the envs' own modules only; like all of envs, it must
never import the engine, the trainer, sync or the controller.
"""

from __future__ import annotations

import threading
from typing import Any

from relayrl.data.chat import prompt_messages
from relayrl.data.tasks import Example
from relayrl.envs.base import StepResult
from relayrl.envs.tools import ToolRunner

_RUNNERS: dict[tuple, ToolRunner] = {}
_RUNNERS_LOCK = threading.Lock()


def shared_runner(tools: list, timeout_s: float, max_calls: int) -> ToolRunner:
    key = (tuple((t.name, id(t.fn)) for t in tools), timeout_s, max_calls)
    with _RUNNERS_LOCK:
        if key not in _RUNNERS:
            _RUNNERS[key] = ToolRunner(tools, timeout_s=timeout_s, max_calls=max_calls)
        return _RUNNERS[key]


class ToolEnv:
    """Subclasses set `tools` and define `answer(text) -> (reward, success)`; `reset` may be overridden."""

    tools: list = []
    tool_timeout_s: float = 5.0
    max_calls: int = 4

    def configure_tools(self, *, extra: list, timeout_s: float) -> None:
        """The env section's settings: extra user tools and the per-call timeout."""
        self.tools = list(self.tools) + list(extra)
        self.tool_timeout_s = timeout_s

    def reset(self, example: Example) -> list[dict[str, Any]]:
        self.example = example
        return prompt_messages(example.prompt)

    def answer(self, text: str) -> tuple[float, bool]:
        raise NotImplementedError

    def step(self, message: dict[str, Any]) -> StepResult:
        runner = shared_runner(self.tools, self.tool_timeout_s, self.max_calls)
        turn = runner.run(message["content"])
        if turn is None:
            reward, success = self.answer(message["content"])
            return StepResult(None, reward, True, {"success": success})
        return StepResult(
            turn.messages,
            0.0,
            False,
            {"tool_calls": turn.calls, "tool_errors": turn.errors, "tool_timeouts": turn.timeouts},
        )
