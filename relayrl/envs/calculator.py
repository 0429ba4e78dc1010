"""The `calculator` environment: arithmetic too long to do in one's head, with a calculator tool.

    user       What is 482*37+905?
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "482*37+905"}}</tool_call>
    tool       18739
    assistant  18739                                   reward 1 when the last integer equals the answer

`demonstration(example)` writes that conversation (the tool really runs), for the SFT warm-start on traces.
With `direct_share` > 0 that share of the demonstrations answer at once, in the head, without the tool
(chosen per example by a hash of its prompt): a model warm-started on them uses the tool only sometimes,
and RL has to find out that the tool pays.
It imports the standard library, relayrl.data and the envs' own modules only.
"""

from __future__ import annotations

import json
import random
from typing import Any

from relayrl.data.agent_tasks import last_int
from relayrl.data.chat import prompt_messages
from relayrl.data.tasks import Example
from relayrl.envs.base import register_env
from relayrl.envs.tool_env import ToolEnv
from relayrl.envs.tools import BUILTIN_TOOLS
from relayrl.errors import EnvError


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@register_env("calculator")
class CalculatorEnv(ToolEnv):
    def __init__(self, direct_share: float = 0.0):
        if not isinstance(direct_share, (int, float)) or not 0.0 <= direct_share <= 1.0:
            raise EnvError(f"environment 'calculator': direct_share must be a number in [0, 1] (got {direct_share!r})")
        self.tools = [BUILTIN_TOOLS["calculator"]]
        self.direct_share = float(direct_share)

    def answer(self, text: str) -> tuple[float, bool]:
        ok = last_int(text) == self.example.answer
        return (1.0 if ok else 0.0), ok

    def demonstration(self, example: Example) -> list[dict[str, Any]]:
        expression = example.meta.get("expression") or example.prompt
        if random.Random(f"direct/{example.prompt}").random() < self.direct_share:
            return prompt_messages(example.prompt) + [{"role": "assistant", "content": example.answer}]
        result = BUILTIN_TOOLS["calculator"].fn(expression)
        return prompt_messages(example.prompt) + [
            {"role": "assistant", "content": tool_call_text("calculator", {"expression": expression})},
            {"role": "tool", "name": "calculator", "content": str(result)},
            {"role": "assistant", "content": str(result)},
        ]
