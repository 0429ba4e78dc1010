"""The Env protocol and the environment registry.

    env = make_env(cfg)                    one instance per episode (it may keep the episode's state)
    messages = env.reset(example)          the conversation the model answers first
    repeat:  model writes an assistant message
             obs, reward, done, info = env.step(message)
             obs: the messages that answer it (a tool's result, the game's reply), or None

An episode's reward is the sum of its step rewards, each a finite real number: a step whose reward is NaN,
inf, None, a string or any other non-number ends its episode as an environment error (finish `env_error`,
counted in env/errors; the episode keeps the reward of its earlier steps), as a step that raises does. It
succeeded when the last step's info says `success` (else when that reward is at least 1). `env.tools` lists
the tools the model may call (their schemas go through the chat template's `tools=`); a tool-free environment
has none.

Built-in environments register by name (`@register_env("calculator")`); your own is given as
'module:Class' or 'path/file.py:Class', built with `env.params` as keyword arguments.

It imports the standard library, relayrl's ground floor, relayrl.data and relayrl.rewards' loader and value
check only; like all of envs, it must never import the engine, the trainer, sync or the controller.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from relayrl.data.tasks import Example
from relayrl.envs.config import EnvConfig
from relayrl.errors import EnvError
from relayrl.rewards.calls import to_reward


class StepResult(NamedTuple):
    """What one environment step returns (a plain 4-tuple is accepted too)."""

    observation: list[dict[str, Any]] | None
    reward: float
    done: bool
    info: dict[str, Any]


@runtime_checkable
class Env(Protocol):
    tools: list  # relayrl.envs.tools.Tool; empty for an environment without tools

    def reset(self, example: Example) -> list[dict[str, Any]]:
        """The first messages of the episode (e.g. [system?, user])."""

    def step(self, message: dict[str, Any]) -> StepResult | tuple:
        """Answer the assistant's message: (observation messages or None, reward, done, info)."""


_ENVS: dict[str, Callable[..., Env]] = {}
_BUILTIN_MODULES = {"calculator": "relayrl.envs.calculator", "python": "relayrl.envs.python_env",
                    "guess": "relayrl.envs.guess"}


def register_env(name: str):
    """Class decorator: `@register_env("guess")` makes `env.name: guess` build it."""

    def deco(cls):
        if name in _ENVS and _ENVS[name] is not cls:
            raise ValueError(f"environment '{name}' is registered twice")
        _ENVS[name] = cls
        return cls

    return deco


def env_names() -> list[str]:
    return sorted(set(_BUILTIN_MODULES) | set(_ENVS))


def env_class(name: str) -> Callable[..., Env]:
    """The class `name` stands for: a registered environment, or 'module:Class' / 'file.py:Class'."""
    if name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name in _ENVS:
        return _ENVS[name]
    if ":" not in name:
        raise EnvError(f"unknown environment '{name}': built-ins are {', '.join(env_names())}; "
                       "for your own use 'module:Class' or 'path/to/file.py:Class'")
    from relayrl.rewards.registry import load_user_object  # the same loader: modules, files, one-line errors

    return load_user_object(name, "environment", EnvError)


def make_env(cfg: EnvConfig) -> Env:
    """A fresh environment for one episode; bad params are one line naming them."""
    cls = env_class(cfg.name)
    try:
        env = cls(**cfg.params)
    except TypeError as e:
        raise EnvError(f"environment '{cfg.name}': bad env.params {cfg.params}: {e}") from None
    if not isinstance(env, Env):
        raise EnvError(f"environment '{cfg.name}' is a {type(env).__name__} without reset(example), "
                       "step(message) and a tools list")
    from relayrl.envs.tool_env import ToolEnv
    from relayrl.envs.tools import load_tool

    if isinstance(env, ToolEnv):
        env.configure_tools(extra=[load_tool(spec) for spec in cfg.tools], timeout_s=cfg.tool_timeout_s)
    elif cfg.tools:
        raise EnvError(f"env.tools is set but environment '{cfg.name}' takes no tools (it is not a ToolEnv)")
    return env


def as_step_result(out: Any, name: str) -> StepResult:
    """A step's return value, checked: a user environment that returns something else is named."""
    try:
        obs, reward, done, info = out
    except (TypeError, ValueError):
        raise EnvError(f"environment '{name}': step() must return (observation, reward, done, info), "
                       f"got {type(out).__name__}") from None
    if obs is not None and (not isinstance(obs, list) or not all(isinstance(m, dict) for m in obs)):
        raise EnvError(f"environment '{name}': the observation must be a list of messages or None")
    # the reward functions' rule (relayrl.rewards.calls): a finite real number (numpy's and torch's scalars too);
    # NaN, inf, None or a string would reach the loss, so the step is a failure of its episode instead
    value, error = to_reward(reward)
    if error is not None:
        raise EnvError(f"environment '{name}': the reward step() {error}")
    return StepResult(obs or None, value, bool(done), dict(info or {}))


def demonstration(env: Env, example: Example, name: str) -> list[dict[str, Any]]:
    """The environment's own solved conversation for `example` (for an SFT warm-start on traces)."""
    show = getattr(env, "demonstration", None)  # optional: an environment may have no way to solve its tasks
    if show is None:
        raise EnvError(f"environment '{name}' has no demonstration(example): SFT on its traces needs one")
    return show(example)
