"""A Gymnasium-style text environment as a relayrl agent: `rollout.agent: gym:pkg.module:Class`.

    rollout:
      agent: gym:my_envs.wordle:WordleEnv     # 'pkg.module:Class' or 'path/to/file.py:Class'
      agent_params:
        kwargs: {max_guesses: 6}              # Class(**kwargs), one environment per episode
        max_turns: 8                          # model turns per episode (default 8)
        system_prompt: "Guess the word."      # optional: a system message first
        seed: null                            # reset(seed=...): null, or an integer
        sampling: {max_tokens: 64}            # keyword arguments of every chat.completions.create call

The environment has Gymnasium's API (`gymnasium.Env`, the OpenEnv and SkyRL-Gym shape):

    reset(seed=None, options=None) -> (observation, info)
    step(action) -> (observation, reward, terminated, truncated, info)
    close()                                   (optional)

One episode, driven through the episode's OpenAI client (a sync `agent(example, client, model)`):

    1. env = Class(**kwargs); observation, info = env.reset(seed=seed, options={"prompt": example.prompt,
       "answer": example.answer, "meta": example.meta})
       -- the example reaches the environment through reset's `options` (Gymnasium's channel for per-episode
       settings): an environment ignoring it draws its own task.
    2. the conversation opens with the system prompt (if set) and the observation as a user message; an empty
       observation ("" or None) opens it with the example's prompt instead.
    3. each turn: the model's reply (client.chat.completions.create) is the action, its text;
       env.step(action); the rewards are summed; terminated or truncated ends the episode; else the assistant
       message, as the endpoint returned it, and the new observation (a user message) extend the conversation, so
       the endpoint reuses the ids it sampled (token in, token out).
    4. after max_turns turns without an end the episode stops there (the rewards so far count).

An observation is text (a user message), a chat message {"role", "content"}, or a list of them (SkyRL-Gym's
observations). The episode's reward is the sum of the step rewards; `success` is the last step's info["success"]
when it is a bool (else relayrl's rule: reward >= 1); `finish` is "done" when the environment terminated the
episode, "max_turns" when it truncated it or max_turns ran out (counted as env/truncated). An observation or reward
of another type, or an environment that raises, fails the episode (the runner drops it and counts it).

It imports relayrl's ground floor (relayrl.config, relayrl.errors, relayrl.lazy) and relayrl.data's Example type.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from typing import Any

from pydantic import Field

from relayrl.config import Config
from relayrl.data.tasks import Example
from relayrl.errors import ConfigError, DataError
from relayrl.lazy import import_file

_IDENT = r"[A-Za-z_]\w*"
_SPEC = re.compile(rf"({_IDENT}(\.{_IDENT})*|[^:]+\.py):{_IDENT}")


class GymParams(Config):
    """rollout.agent_params of a `gym:` agent."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    max_turns: int = Field(8, ge=1)
    system_prompt: str | None = None
    seed: int | None = None
    # keyword arguments of every chat.completions.create (max_tokens, temperature, extra_body, ...); during training
    # the endpoint imposes the run's sampling and caps max_tokens at rollout.max_tokens
    sampling: dict[str, Any] = Field(default_factory=dict)


def make_agent(ref: str, params: dict[str, Any] | None = None):
    """The agent function of the Gymnasium-style environment class `ref` ('pkg.module:Class')."""
    where = f"rollout.agent gym:{ref}"
    try:
        cfg = GymParams.from_dict(params or {})
    except ConfigError as e:
        raise ConfigError(f"{where}: agent_params: {str(e).removeprefix('config error: ')}") from None
    cls = load_class(ref, where)

    def agent(example: Example, client, model: str) -> dict[str, Any]:
        return run_episode(cls, cfg, example, client, model, ref)

    agent.__name__ = agent.__qualname__ = f"gym:{ref}"
    return agent


def load_class(ref: str, where: str):
    if not isinstance(ref, str) or not _SPEC.fullmatch(ref):
        raise ConfigError(f"{where}: name the environment class as 'pkg.module:Class' or 'path/to/file.py:Class'")
    module_part, _, attr = ref.rpartition(":")
    try:
        module = (import_file(module_part, "relayrl_gym_env_") if module_part.endswith(".py")
                  else importlib.import_module(module_part))
    except Exception as e:  # a user module can fail in any way while importing
        raise ConfigError(f"{where}: cannot import {module_part}: {type(e).__name__}: {_line(e)}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"{where}: module '{module_part}' has no attribute '{attr}'")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{where}: {attr} has no {' and no '.join(m + '()' for m in missing)}; a Gymnasium-style "
                          "environment has reset(seed=, options=) and step(action)")
    return cls


def run_episode(cls, cfg: GymParams, example: Example, client, model: str, ref: str = "") -> dict[str, Any]:
    """One episode of a new `cls(**cfg.kwargs)` on `example`, the model reached through `client` (see the module
    docstring): {"reward": the summed step rewards, "finish": "done" when the environment terminated it, else
    "max_turns" (truncated by it, or max_turns reached: env/truncated), "success": the last info's bool "success"
    (when given)}."""
    name = f"gym environment {ref or cls.__name__}"
    env = cls(**cfg.kwargs)
    try:
        observation, info = env.reset(seed=cfg.seed, options={"prompt": example.prompt, "answer": example.answer,
                                                               "meta": example.meta})
        messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        opening = _observed(observation, name, "reset()")
        if not opening:
            opening = ([{"role": "user", "content": example.prompt}] if isinstance(example.prompt, str)
                       else list(example.prompt))
        messages += opening
        total, finish = 0.0, "max_turns"  # unless the environment ends it
        for _ in range(cfg.max_turns):
            reply = client.chat.completions.create(**cfg.sampling, model=model, messages=messages)
            message = reply.choices[0].message
            observation, reward, terminated, truncated, info = env.step(message.content or "")
            total += _reward(reward, name)
            if terminated or truncated:
                finish = "done" if terminated else "max_turns"
                break
            messages += [message.model_dump(exclude_none=True), *_observed(observation, name, "step()")]
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()
    out: dict[str, Any] = {"reward": total, "finish": finish}
    if isinstance(info, dict) and isinstance(info.get("success"), bool):
        out["success"] = info["success"]
    return out


def _observed(observation, name: str, call: str) -> list[dict]:
    """An observation as the messages it adds: text is a user message; a message or a list of them as they are."""
    if observation is None or observation == "":
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    items = [observation] if isinstance(observation, dict) else observation
    if isinstance(items, list) and items and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in items):
        return [{"role": m["role"], "content": m["content"]} for m in items]
    raise DataError(f"{name}: {call} returned an observation of type {type(observation).__name__}; a text "
                    "environment returns a string, a chat message {'role', 'content'}, or a list of them")


def _reward(reward, name: str) -> float:
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise DataError(f"{name}: step() returned the reward {reward!r}; it must be a finite number")
    return float(reward)


def _line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] if text else "(no message)"
