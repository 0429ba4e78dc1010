"""The `guess` environment: a multi-turn game without tools. The model guesses a secret number; the
environment answers "Higher." or "Lower." until it is found (reward 1) or the turns run out (reward 0).

`demonstration(example)` plays a binary search, for an SFT warm-start on traces.
It imports the standard library, relayrl.data and the envs' own modules only.
"""

from __future__ import annotations

from typing import Any

from relayrl.data.agent_tasks import last_int
from relayrl.data.chat import prompt_messages
from relayrl.data.tasks import Example
from relayrl.envs.base import StepResult, register_env


@register_env("guess")
class GuessEnv:
    tools: list = []

    def reset(self, example: Example) -> list[dict[str, Any]]:
        self.secret = int(example.answer)
        return prompt_messages(example.prompt)

    def step(self, message: dict[str, Any]) -> StepResult:
        guess = last_int(message["content"])
        if guess is None:
            return StepResult([{"role": "user", "content": "Answer with a number."}], 0.0, False, {"success": False})
        if int(guess) == self.secret:
            return StepResult(None, 1.0, True, {"success": True})
        hint = "Higher." if int(guess) < self.secret else "Lower."
        return StepResult([{"role": "user", "content": hint}], 0.0, False, {"success": False})

    def demonstration(self, example: Example) -> list[dict[str, Any]]:
        messages = self.reset(example)
        low, high = int(example.meta.get("low", 1)), int(example.meta.get("high", max(self.secret, 2)))
        while True:
            mid = (low + high) // 2
            messages.append({"role": "assistant", "content": str(mid)})
            obs, _, done, _ = self.step(messages[-1])
            if done:
                return messages
            messages += obs
            low, high = (mid + 1, high) if mid < self.secret else (low, mid - 1)
