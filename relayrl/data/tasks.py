"""This module defines the task protocol and registry: built-in tasks generate their own data from a seed.

A task is a small object with

    name       registry name ("arith", "sort", ...), or a factory's spec "pkg.module:factory" (relayrl.data.plugin)
    params     the keyword arguments it was built with (JSON-able), so it can be rebuilt
    alphabet   every character its prompts and answers use (to build a tiny char tokenizer), or None: the
               tokenizer is then built over the generated examples' characters (relayrl.data.config.tiny_alphabet)
    tool_tokens  whether its tiny tokenizer needs the tool-call tags (an environment with tools)
    generate(n, seed) -> list[Example]     deterministic in (params, n, seed)
    score(completion, example) -> float    in [0, 1]; 1.0 means correct

Every generated example carries `meta["task"]` and `meta["params"]`, so a scorer that sees only
the example can rebuild the task that made it (`task_for_example`). That is how the `task` reward
works without passing task objects through worker boundaries. A user's task, `data.task: "pkg.module:factory"`,
is rebuilt the same way, by importing the factory in the worker (relayrl.data.plugin); `reasoning_gym` is a
registered task over the reasoning-gym library (relayrl.data.reasoning_gym_task), `verifiers` one over a verifiers
v1 environment's taskset (relayrl.data.verifiers_task).

`check_task` is what loading a config runs: a built-in task is built (they are cheap), a task with a
`check_params` static method (reasoning_gym) checks its parameters without importing its library, and a factory
spec is checked for its form only.

It imports the standard library and relayrl.errors only; it must never import another relayrl layer:
data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from relayrl.errors import ConfigError


@dataclass
class Example:
    """One prompt with its reference answer. `meta` holds whatever the scorer may need."""

    prompt: str | list[dict[str, Any]]  # text, or chat messages (TRL conversational format)
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    name: str
    params: dict[str, Any]
    alphabet: str | None
    tool_tokens: bool

    def generate(self, n: int, seed: int) -> list[Example]: ...

    def score(self, completion: str, example: Example) -> float: ...


_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str):
    """Class decorator: `@register_task("arith")` makes `get_task("arith", **params)` build it."""

    def deco(cls):
        if name in _TASKS:
            raise ValueError(f"task '{name}' is registered twice")
        _TASKS[name] = cls
        return cls

    return deco


def task_names() -> list[str]:
    _load_builtins()
    return sorted(_TASKS)


def get_task(name: str, **params: Any) -> Task:
    """Build a registered task, or a user's task from its factory spec ('pkg.module:factory'); unknown names
    and bad params are ConfigErrors naming them."""
    _load_builtins()
    if name not in _TASKS and ":" in name:
        from relayrl.data.plugin import PluginTask

        return PluginTask(name, params)
    if name not in _TASKS:
        raise ConfigError(f"unknown task '{name}': built-in tasks are {', '.join(sorted(_TASKS))}, "
                          "or name your own task factory as 'pkg.module:factory'")
    try:
        return _TASKS[name](**params)
    except TypeError as e:
        # An unknown or missing keyword: report it in terms of the config the user wrote.
        raise ConfigError(f"task '{name}': bad task_params {params}: {e}") from None


def check_task(name: str, params: dict[str, Any]) -> None:
    """The config-time check of a task and its params: fast, and without importing torch or a task library."""
    _load_builtins()
    if name not in _TASKS and ":" in name:
        from relayrl.data.plugin import check_plugin_spec

        check_plugin_spec(name)
        return
    check = getattr(_TASKS.get(name), "check_params", None)
    if check is None:
        get_task(name, **params)
        return
    try:
        check(**params)
    except TypeError as e:
        raise ConfigError(f"task '{name}': bad task_params {params}: {e}") from None


def task_for_example(example: Example) -> Task | None:
    """The task that generated `example`, or None for examples loaded from a file."""
    name = example.meta.get("task")
    if name is None:
        return None
    params = example.meta.get("params") or {}
    return _cached_task(name, json.dumps(params, sort_keys=True))


@lru_cache(maxsize=64)
def _cached_task(name: str, params_json: str) -> Task:
    # Keyed by JSON so dict params are hashable; a reward call per sample must not rebuild tasks.
    return get_task(name, **json.loads(params_json))


def first_line(completion: str) -> str:
    """The answer part of a completion: its first non-blank line, stripped.

    A model may stop at EOS, or keep going after a newline; only the first line counts.
    """
    stripped = completion.strip()
    return stripped.split("\n", 1)[0].strip() if stripped else ""


def _load_builtins() -> None:
    # Imported lazily: the task modules import this one to register themselves.
    from relayrl.data import agent_tasks, arith, reasoning_gym_task, sort, verifiers_task  # noqa: F401 - registrations
