"""Reward functions by name: built-ins registered here, user functions imported by spec.

A reward function is `fn(completion: str, example: Example, **params) -> float`, where params
come from the config entry (`{name: format, params: {pattern: ...}}`); a user function may also have
TRL's batch form `fn(completions, prompts, **columns) -> list[float]` or verl's
`fn(data_source, solution_str, ground_truth, extra_info)` (relayrl.rewards.calls tells them apart and
calls each its own way). Names resolve as

    "exact_match", "math", ...    a registered built-in
    "pkg.module:function"         imported with importlib (must be importable: on sys.path)
    "path/to/file.py:function"    loaded from that file

It imports the standard library and relayrl.errors only; like all of rewards, it must never import the
trainer, the engine, sync or the controller (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from relayrl.errors import RewardError, UserError
from relayrl.lazy import import_file

RewardFn = Callable[..., float]

_REWARDS: dict[str, RewardFn] = {}

# Built-ins are imported when first named (they import this module to register themselves): a
# worker that scores only exact_match never pays for importing math-verify and sympy.
_BUILTIN_MODULES = {
    "exact_match": "relayrl.rewards.builtin",
    "format": "relayrl.rewards.builtin",
    "task": "relayrl.rewards.builtin",
    "math": "relayrl.rewards.math_answer",
    "code_tests": "relayrl.rewards.code",  # hidden tests run in the sandbox
}


def register_reward(name: str):
    """`@register_reward("math")` makes the function available as `name` in reward configs."""

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward '{name}' is registered twice")
        _REWARDS[name] = fn
        return fn

    return deco


def reward_names() -> list[str]:
    for module in set(_BUILTIN_MODULES.values()):
        importlib.import_module(module)
    return sorted(_REWARDS)


def get_reward_fn(name: str) -> RewardFn:
    if name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name in _REWARDS:
        return _REWARDS[name]
    if ":" in name:
        return load_user_function(name)
    raise RewardError(
        f"unknown reward function '{name}': built-ins are {', '.join(sorted(set(_BUILTIN_MODULES) | set(_REWARDS)))}; "
        f"for your own use 'module:function' or 'path/to/file.py:function'"
    )


def load_user_function(spec: str) -> RewardFn:
    return load_user_object(spec, "reward function", RewardError)


def load_user_object(spec: str, what: str, error: type[UserError]):
    """The callable `spec` names, 'pkg.module:name' (importable) or 'path/file.py:name' (loaded from the
    file under a private module name); every failure is one `error` line saying which and why. Reward
    functions, tools and environments are all loaded here."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise error(f"cannot load {what} '{spec}': expected 'module:name' or 'file.py:name'")
    try:
        module = _import_file(module_part) if _is_path(module_part) else importlib.import_module(module_part)
    except Exception as e:  # a user module can fail in any way while importing; report it, don't crash
        raise error(f"cannot load {what} '{spec}': {type(e).__name__}: {_one_line(e)}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise error(f"cannot load {what} '{spec}': module '{module_part}' has no attribute '{attr}'")
    if not callable(obj):
        raise error(f"cannot load {what} '{spec}': '{attr}' is not a function (its type is {type(obj).__name__})")
    return obj


def _is_path(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or "\\" in module_part


def _import_file(path_str: str):
    return import_file(path_str, "relayrl_user_")


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
