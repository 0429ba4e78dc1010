"""One reward call, the same in a worker process and in the driver: load the configured functions,
call one on one sample, and accept only a finite real number as its value.

    load_functions([(name, params), ...]) -> [fn, ...]   RewardError / ConfigError naming the entry
    call_reward(fn, completion, example) -> (value, None) or (None, "what went wrong")

What counts as a value:
    int, float, fractions.Fraction, numpy's real scalars   float(v), if finite
    bool                                                    1.0 / 0.0 (`return pred == gold` is common)
    NaN, +-inf, an int too large for a float (10**400)      a failure
    complex, str (even "1.0"), None, anything else          a failure

A failure's message is one short line; it is what a RewardError quotes when every sample fails.

It imports the reward registry and relayrl.errors only; like all of rewards, it must never import the
trainer, the engine, sync or the controller (rewards may use relayrl.data and the ground floor only).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any

from relayrl.errors import ConfigError
from relayrl.rewards.registry import RewardFn, get_reward_fn

MAX_MESSAGE = 300


def load_functions(specs: list[tuple[str, dict[str, Any]]]) -> list[RewardFn]:
    """The functions of `reward.functions` in order, their params bound; raises on the first bad entry."""
    out = []
    for i, (name, params) in enumerate(specs):
        fn = get_reward_fn(name)
        _check_params(fn, name, params, i)
        out.append(functools.partial(fn, **params) if params else fn)
    return out


def _check_params(fn: RewardFn, name: str, params: dict[str, Any], i: int) -> None:
    """Fail at startup, naming the key, if the params do not fit the function's signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some callables (builtins, C functions) have no signature
        return
    try:
        sig.bind("", None, **params)
    except TypeError as e:
        raise ConfigError(f"config error: reward.functions.{i}.params: {e} (function '{name}')") from None


def call_reward(fn: RewardFn, completion: str, example: Any) -> tuple[float | None, str | None]:
    """(value, None) on success, (None, message) when the call raises or returns a non-value.

    BaseException is caught on purpose: a reward calling sys.exit() or raising KeyboardInterrupt
    fails its sample, not the process that scores it."""
    try:
        v = fn(completion, example)
    except SystemExit as e:
        return None, f"called sys.exit({_safe_repr(e.code)})"
    except MemoryError:
        return None, "MemoryError (over reward.memory_mb?)"
    except BaseException as e:  # user code may raise anything on odd output
        return None, f"{type(e).__name__}: {_first_line(e)}"
    return to_reward(v)


def to_reward(v: Any) -> tuple[float | None, str | None]:
    if not isinstance(v, numbers.Real):
        return None, f"returned {_safe_repr(v)} ({type(v).__name__}), expected a finite real number"
    try:
        f = float(v)
    except OverflowError:
        return None, f"returned an {type(v).__name__} too large for a float ({_safe_repr(v)})"
    except BaseException as e:  # a user's Real subclass may fail to convert in any way
        return None, f"returned {type(v).__name__} that float() rejects: {type(e).__name__}: {_first_line(e)}"
    if not math.isfinite(f):
        return None, f"returned {f!r}, expected a finite real number"
    return f, None


def _first_line(e: BaseException) -> str:
    try:
        text = str(e).strip()
    except BaseException:  # a user exception's __str__ may itself fail
        return "(unprintable message)"
    line = text.splitlines()[0] if text else "(no message)"
    return line if len(line) <= MAX_MESSAGE else line[:MAX_MESSAGE] + "..."


def _safe_repr(v: Any) -> str:
    try:
        text = repr(v)
    except BaseException:  # huge ints refuse repr (int max str digits); user objects may raise
        return f"<{type(v).__name__}>"
    text = text.replace("\n", " ")
    return text if len(text) <= 60 else text[:60] + "..."
