"""This module keeps the name → function registries of the algorithm pieces.

Algorithms are chosen by name in config (`algo.loss: gspo`), so every variant is a small function
registered under its name instead of a string branch inside the trainer:

    @register_loss("ppo")
    def ppo(logp, old_logp, advantages, mask, *, clip_low, clip_high, agg, ...): ...

    loss_fn = get_loss(cfg.loss)

Looking up an unknown name raises ValueError listing the known names, so a typo in a config is
reported with the alternatives.

It imports the standard library only; it must never import another relayrl layer: the algorithms are a
leaf, which the trainer and the controller import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A named table of functions of one kind (advantage, loss, aggregation, kl)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._fns[name] = fn
            return fn

        return deco

    def get(self, name: str) -> Callable:
        try:
            return self._fns[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} '{name}'; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns


ADVANTAGES = Registry("advantage")
LOSSES = Registry("loss")
AGGREGATIONS = Registry("aggregation")
KL_ESTIMATORS = Registry("kl estimator")


def register_advantage(name: str, *, token_level: bool = False, needs_greedy_baseline: bool = False,
                       needs_critic: bool = False):
    """Register an advantage estimator. The two flags tell the driver how to call it, and are set as
    attributes on the function:

    token_level=False (grpo, dr_grpo, rloo, remax):  fn(rewards [N], group_size, norm_std=True) -> [N]
    token_level=True  (reinforce_pp, reinforce_pp_baseline):
        fn(outcome [B], mask [B, T], *, group_size, kl=None, kl_coef=0.0, gamma=1.0, norm_std=True) -> [B, T]
    needs_greedy_baseline=True (remax): the driver also generates one greedy sample per prompt, scores it,
        and passes its rewards as `baseline=` [N/G].
    needs_critic=True (gae): token-level, from the critic's values; the run trains a critic beside the actor.
    """
    reg = ADVANTAGES.register(name)

    def deco(fn: F) -> F:
        fn.token_level = token_level  # type: ignore[attr-defined]
        fn.needs_greedy_baseline = needs_greedy_baseline  # type: ignore[attr-defined]
        fn.needs_critic = needs_critic  # type: ignore[attr-defined]
        return reg(fn)

    return deco


def get_advantage(name: str) -> Callable:
    return ADVANTAGES.get(name)


def advantage_is_token_level(name: str) -> bool:
    """True when `name` takes token-level inputs (outcome, mask, KL) and returns [B, T] advantages."""
    return bool(getattr(ADVANTAGES.get(name), "token_level", False))


def advantage_needs_greedy_baseline(name: str) -> bool:
    """True when `name` needs the rewards of one greedy (temperature 0) sample per prompt as `baseline=`."""
    return bool(getattr(ADVANTAGES.get(name), "needs_greedy_baseline", False))


def advantage_needs_critic(name: str) -> bool:
    """True when `name` needs a critic's values (gae): the run then trains one."""
    return bool(getattr(ADVANTAGES.get(name), "needs_critic", False))


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
