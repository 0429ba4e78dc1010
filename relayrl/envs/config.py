"""The `env:` section of a run config: which environment each episode runs in, and its budgets.

    env:
      name: calculator          a built-in (calculator, python, guess) or your own 'module:Class'
      params: {}                keyword arguments of the environment's constructor
      max_turns: 4              assistant turns per episode
      max_total_tokens: 384     prompt + every turn + every observation, in tokens
      tools: []                 extra tools for tool-using environments, each 'module:function'
      tool_timeout_s: 5         one tool call longer than this comes back to the model as an error
      step_timeout_s: 60        an environment step longer than this ends the episode (env/timeouts)
      workers: 8                threads that run environment steps beside the engine

It imports pydantic and relayrl's ground floor only, so loading a run config imports no environment.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from relayrl.config import Config


class EnvConfig(Config):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    max_turns: int = Field(4, ge=1)
    max_total_tokens: int = Field(384, ge=2)
    tools: list[str] = Field(default_factory=list)
    tool_timeout_s: float = Field(5.0, gt=0)
    step_timeout_s: float = Field(60.0, gt=0)
    workers: int = Field(8, ge=1)
