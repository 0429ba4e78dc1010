"""This module lets a package export names that are imported on first use (PEP 562), so that importing
one light module of a package (its config, say) does not import the package's heavy modules too.

    # relayrl/models/__init__.py
    __getattr__, __dir__ = lazy_exports(__name__, {"CausalLM": "relayrl.models.transformer", ...})
    if TYPE_CHECKING:   # what editors and type checkers follow to the definitions
        from relayrl.models.transformer import CausalLM

Loading a run's config therefore imports config modules, not the engine, trainer or torch.distributed
(tests/test_layering.py checks it). It is part of relayrl's ground floor: it imports the standard library
only, and it must never import another relayrl module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module __getattr__ and __dir__ for `package` that import `table[name]` (a module path) the
    first time `name` is looked up, and keep the value in the package for later lookups."""

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
