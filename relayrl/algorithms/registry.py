"""This module keeps the name → function registries of the algorithm pieces.

Algorithms are chosen by name in config (`algo.loss: gspo`), so every variant is a small function
registered under its name instead of a string branch inside the trainer:

    @register_loss("ppo")
    def ppo(logp, old_logp, advantages, mask, *, clip_low, clip_high, agg, ...): ...

    loss_fn = get_loss(cfg.loss)

Looking up an unknown name raises ValueError listing the known names, so a typo in a config is
reported with the alternatives. The built-in names are declared here with the module that registers each
(BUILTINS), so a config's names are checked without importing any of those modules (or torch): the module is
imported the first time its function is looked up.

It imports the standard library only; it must never import another relayrl layer: the algorithms are a
leaf, which the trainer and the controller import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A named table of functions of one kind (advantage, loss, aggregation, kl). `builtins` declares the
    built-in names and the module that registers each, imported on the first look-up of one of its names."""

    def __init__(self, kind: str, builtins: Mapping[str, str] = {}) -> None:
        self.kind = kind
        self.builtins = dict(builtins)
        self._fns: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            if name in self.builtins and fn.__module__ != self.builtins[name]:
                raise ValueError(f"{self.kind} '{name}' is already registered (built in: {self.builtins[name]})")
            self._fns[name] = fn
            return fn

        return deco

    def get(self, name: str) -> Callable:
        if name not in self._fns and name in self.builtins:
            importlib.import_module(self.builtins[name])  # registers it
        try:
            return self._fns[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} '{name}'; known: {', '.join(self.names())}") from None

    def check(self, name: str) -> str:
        """`name` when it is known (built in or registered), else the ValueError get() raises; imports nothing."""
        if name not in self:
            self.get(name)
        return name

    def names(self) -> list[str]:
        return sorted(set(self._fns) | set(self.builtins))

    def __contains__(self, name: object) -> bool:
        return name in self._fns or name in self.builtins


_A = "relayrl.algorithms."
ADVANTAGES = Registry("advantage", dict.fromkeys(("grpo", "dr_grpo", "rloo", "remax", "reinforce_pp",
                                                  "reinforce_pp_baseline", "gae"), _A + "estimate"))
LOSSES = Registry("loss", {"ppo": _A + "policy_loss", "gspo": _A + "policy_loss"})
AGGREGATIONS = Registry("aggregation", dict.fromkeys(("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
                                                      _A + "aggregation"))
KL_ESTIMATORS = Registry("kl estimator", dict.fromkeys(("k1", "k2", "k3"), _A + "kl"))
# how the driver calls each built-in estimator (register_advantage's flags), known without importing it; its
# registration must say the same
BUILTIN_ADVANTAGE_FLAGS = {"remax": {"needs_greedy_baseline": True}, "reinforce_pp": {"token_level": True},
                           "reinforce_pp_baseline": {"token_level": True},
                           "gae": {"token_level": True, "needs_critic": True}}


def register_advantage(name: str, *, token_level: bool = False, needs_greedy_baseline: bool = False,
                       needs_critic: bool = False):
    """Register an advantage estimator: fn(x: AdvantageInputs, algo: AlgoConfig) -> Advantages, every one alike
    (relayrl.algorithms.estimate). The flags say what it takes and gives, and are set as attributes on it:

    token_level=True (reinforce_pp, reinforce_pp_baseline, gae): [N, T] advantages from token rewards (the KL
        may be in them: algo.kl_in_reward); else one advantage per sample, [N]
    needs_greedy_baseline=True (remax): the driver also generates one greedy sample per prompt, scores it,
        and passes its rewards as x.baseline [N/G]
    needs_critic=True (gae): from the critic's values (x.values); the run trains a critic beside the actor
    """
    reg = ADVANTAGES.register(name)
    flags = {"token_level": token_level, "needs_greedy_baseline": needs_greedy_baseline, "needs_critic": needs_critic}
    if name in ADVANTAGES.builtins and {k: v for k, v in flags.items() if v} != BUILTIN_ADVANTAGE_FLAGS.get(name, {}):
        raise ValueError(f"advantage '{name}' registers {flags}, but BUILTIN_ADVANTAGE_FLAGS says otherwise")

    def deco(fn: F) -> F:
        fn.token_level = token_level  # type: ignore[attr-defined]
        fn.needs_greedy_baseline = needs_greedy_baseline  # type: ignore[attr-defined]
        fn.needs_critic = needs_critic  # type: ignore[attr-defined]
        return reg(fn)

    return deco


def get_advantage(name: str) -> Callable:
    return ADVANTAGES.get(name)


def _flag(name: str, flag: str) -> bool:
    if name in ADVANTAGES.builtins:  # known without importing the estimator's module
        return BUILTIN_ADVANTAGE_FLAGS.get(name, {}).get(flag, False)
    return bool(getattr(ADVANTAGES.get(name), flag, False))


def advantage_is_token_level(name: str) -> bool:
    """True when `name` takes token-level inputs (outcome, mask, KL) and returns [B, T] advantages."""
    return _flag(name, "token_level")


def advantage_needs_greedy_baseline(name: str) -> bool:
    """True when `name` needs the rewards of one greedy (temperature 0) sample per prompt as `baseline=`."""
    return _flag(name, "needs_greedy_baseline")


def advantage_needs_critic(name: str) -> bool:
    """True when `name` needs a critic's values (gae): the run then trains one."""
    return _flag(name, "needs_critic")


def register_loss(name: str):
    return LOSSES.register(name)


def get_loss(name: str) -> Callable:
    return LOSSES.get(name)


def register_aggregation(name: str):
    return AGGREGATIONS.register(name)


def get_aggregation(name: str) -> Callable:
    return AGGREGATIONS.get(name)


def register_kl(name: str):
    return KL_ESTIMATORS.register(name)


def get_kl(name: str) -> Callable:
    return KL_ESTIMATORS.get(name)
