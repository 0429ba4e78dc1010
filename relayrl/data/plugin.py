"""This module runs a user's task generator as a relayrl task: `data.task: "pkg.module:factory"`.

    data:
      task: my_tasks:make_task        # 'pkg.module:factory' (importable) or 'path/to/file.py:factory'
      task_params: {level: 2}         # factory(**task_params) builds the task object

The object the factory returns must have

    generate(n, seed)            -> exactly n examples, deterministic in (task_params, n, seed); each a relayrl
                                    `Example` or a dict {"prompt": str | chat messages, "answer": str, "meta": {...}}
    score(completion, example)   -> a number (1.0 or more means correct); `example` is the relayrl Example it
                                    generated (dicts are turned into Examples: .prompt, .answer, .meta)
    alphabet (optional)          a string of every character its prompts and answers use; without it the tiny
                                 model's tokenizer is built over the characters of the generated data

`PluginTask` wraps it with relayrl's task protocol (relayrl.data.tasks): every example it yields carries
meta["task"] = the spec and meta["params"] = task_params, so a reward worker (a separate process) rebuilds
the task by importing the factory there too (`task_for_example`). The user's own meta goes along beside
those two keys, pickled between relayrl's own processes (it may hold any picklable value, not only JSON).

Every failure names the factory in one line: an import error, a factory that raises or returns an object
without generate/score (ConfigError), generate returning the wrong thing or the wrong number (DataError),
score returning a non-number (RewardError).

Config validation checks the spec's form only: the factory is imported when the task is built (the first
thing a run does, before any model is loaded), since a user module may import torch or take seconds, and
loading a config must stay torch-free and fast.

It imports the standard library, the task registry and the ground floor (relayrl.errors, relayrl.lazy) only; it
must never import another relayrl layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import importlib
import importlib.util
import numbers
import pickle
import re
from typing import Any

from relayrl.data.tasks import Example
from relayrl.errors import ConfigError, DataError, RewardError
from relayrl.lazy import import_file

_IDENT = r"[A-Za-z_]\w*"
_MODULE_SPEC = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}")
_FILE_SPEC = re.compile(rf"[^:]+\.py:{_IDENT}")
RESERVED_META = ("task", "params")


def is_plugin_spec(name: str) -> bool:
    """Whether `name` has the form of a factory spec: 'pkg.module:factory' or 'path/to/file.py:factory'."""
    return bool(_MODULE_SPEC.fullmatch(name) or _FILE_SPEC.fullmatch(name))


def check_plugin_spec(name: str) -> None:
    """The config-time check: the spec's form (nothing is imported)."""
    if not is_plugin_spec(name):
        raise ConfigError(f"task '{name}': a task factory is named 'pkg.module:factory' or 'path/to/file.py:factory'")


class PluginTask:
    """A user's task object behind relayrl's task protocol (see the module docstring)."""

    def __init__(self, spec: str, params: dict[str, Any]):
        check_plugin_spec(spec)
        if not isinstance(params, dict):
            raise ConfigError(f"task '{spec}': task_params must be a mapping of keyword arguments")
        self.name = spec
        self.params = dict(params)
        factory = _load_factory(spec)
        try:
            obj = factory(**self.params)
        except Exception as e:  # user code: any failure is reported, not a crash
            raise ConfigError(f"task '{spec}': {spec}(**{self.params}) raised {type(e).__name__}: {_one_line(e)}"
                              ) from None
        missing = [m for m in ("generate", "score") if not callable(getattr(obj, m, None))]
        if missing:
            raise ConfigError(f"task '{spec}': the factory returned a {type(obj).__name__} without "
                              f"{' and '.join(m + '()' for m in missing)}; it must return an object with "
                              "generate(n, seed) and score(completion, example)")
        alphabet = getattr(obj, "alphabet", None)
        if alphabet is not None and (not isinstance(alphabet, str) or not alphabet):
            raise ConfigError(f"task '{spec}': alphabet must be a non-empty string of characters (got "
                              f"{type(alphabet).__name__}); leave it out to build it from the generated examples")
        self.task = obj
        self.alphabet: str | None = alphabet
        self.tool_tokens = bool(getattr(obj, "tool_tokens", False))

    def generate(self, n: int, seed: int) -> list[Example]:
        try:
            rows = self.task.generate(n, seed)
        except Exception as e:
            raise DataError(f"task '{self.name}': generate({n}, {seed}) raised {type(e).__name__}: {_one_line(e)}"
                            ) from None
        if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__"):
            raise DataError(f"task '{self.name}': generate({n}, seed) returned a {type(rows).__name__}; it must "
                            "return a list of examples (relayrl Example or dicts with prompt, answer, meta)")
        rows = list(rows)
        if len(rows) != n:
            raise DataError(f"task '{self.name}': generate({n}, seed) returned {len(rows)} examples; it must return "
                            f"exactly n={n}")
        out = [self._example(row, i) for i, row in enumerate(rows)]
        if out:
            try:  # examples cross to the reward workers pickled; find out here, with the culprit named
                pickle.dumps(out[0].meta)
            except Exception as e:
                raise DataError(f"task '{self.name}': an example's meta cannot be pickled ({type(e).__name__}: "
                                f"{_one_line(e)}); keep plain data in meta") from None
        return out

    def _example(self, row: Any, i: int) -> Example:
        where = f"task '{self.name}': example {i} of generate()"
        if isinstance(row, Example):
            prompt, answer, meta = row.prompt, row.answer, row.meta
        elif isinstance(row, dict):
            unknown = sorted(set(row) - {"prompt", "answer", "meta"})
            if unknown or "prompt" not in row or "answer" not in row:
                raise DataError(f"{where} has keys {sorted(row)}; a dict example has 'prompt', 'answer' and "
                                "optionally 'meta'")
            prompt, answer, meta = row["prompt"], row["answer"], row.get("meta", {})
        else:
            raise DataError(f"{where} is a {type(row).__name__}; return relayrl Examples or dicts with prompt, "
                            "answer, meta")
        _check_prompt(prompt, where)
        if not isinstance(answer, str):
            raise DataError(f"{where}: answer must be a string (got {type(answer).__name__}: {answer!r})")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise DataError(f"{where}: meta must be a dict (got {type(meta).__name__})")
        clash = [k for k in RESERVED_META if k in meta]
        if clash:
            raise DataError(f"{where}: meta key(s) {clash} are relayrl's (the task's name and params); rename them")
        return Example(prompt=prompt, answer=answer, meta={**meta, "task": self.name, "params": dict(self.params)})

    def score(self, completion: str, example: Example) -> float:
        value = self.task.score(completion, example)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"task '{self.name}': score() returned {type(value).__name__} {value!r}; it must "
                              "return a number")
        return float(value)


def _check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: the prompt is empty")
        return
    ok = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    if not ok:
        raise DataError(f"{where}: the prompt must be a string or a non-empty list of chat messages "
                        "[{'role': ..., 'content': ...}] (got " + type(prompt).__name__ + ")")


def _load_factory(spec: str):
    module_part, _, attr = spec.rpartition(":")
    try:
        module = _import_file(module_part) if module_part.endswith(".py") else importlib.import_module(module_part)
    except Exception as e:  # a user module can fail in any way while importing
        raise ConfigError(f"task '{spec}': cannot import {module_part}: {type(e).__name__}: {_one_line(e)}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"task '{spec}': module '{module_part}' has no attribute '{attr}'")
    if not callable(factory):
        raise ConfigError(f"task '{spec}': '{attr}' is not callable (its type is {type(factory).__name__}); "
                          "name a function or class that builds the task")
    return factory


def _import_file(path_str: str):
    return import_file(path_str, "relayrl_task_")


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
