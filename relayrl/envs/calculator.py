"""The `calculator` environment: arithmetic too long to do in one's head, with a calculator tool.

    user       What is 482*37+905?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "482*37+905"}}</tool_call>
    tool       18739
    assistant  18739                                   reward 1 when the last integer equals the answer

`demonstration(example)` writes that conversation (the tool really runs), for the SFT warm-start on traces.
It imports the standard library, relayrl.data and the envs' own modules only.
"""

from __future__ import annotations

import json
from typing import Any

from relayrl.data.agent_tasks import last_int
from relayrl.data.chat import prompt_messages
from relayrl.data.tasks import Example
from relayrl.envs.base import register_env
from relayrl.envs.tool_env import ToolEnv
from relayrl.envs.tools import BUILTIN_TOOLS


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@register_env("calculator")
class CalculatorEnv(ToolEnv):
    def __init__(self):
        self.tools = [BUILTIN_TOOLS["calculator"]]

    def answer(self, text: str) -> tuple[float, bool]:
        ok = last_int(text) == self.example.answer
        return (1.0 if ok else 0.0), ok

    def demonstration(self, example: Example) -> list[dict[str, Any]]:
        expression = example.meta.get("expression") or example.prompt
        result = BUILTIN_TOOLS["calculator"].fn(expression)
        return prompt_messages(example.prompt) + [
            {"role": "assistant", "content": tool_call_text("calculator", {"expression": expression})},
            {"role": "tool", "name": "calculator", "content": str(result)},
            {"role": "assistant", "content": str(result)},
        ]
