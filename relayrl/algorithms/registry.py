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


def register_advantage(name: str):
    return ADVANTAGES.register(name)


def get_advantage(name: str) -> Callable:
    return ADVANTAGES.get(name)


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
