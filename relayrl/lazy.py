"""This module lets a package export names that are imported on first use (PEP 562), so that importing
one light module of a package (its config, say) does not import the package's heavy modules too.

    # relayrl/models/__init__.py
    __getattr__, __dir__ = lazy_exports(__name__, {"CausalLM": "relayrl.models.transformer", ...})
    if TYPE_CHECKING:   # what editors and type checkers follow to the definitions
        from relayrl.models.transformer import CausalLM

Loading a run's config therefore imports config modules, not the engine, trainer or torch.distributed
(tests/test_layering.py checks it).

    import_file(path, prefix)   a user's .py file as a module of its own (reward files, task factories)

It is part of relayrl's ground floor: it imports the standard library
only, and it must never import another relayrl module.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
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


def import_file(path_str: str, prefix: str):
    """The module of the Python file `path_str`, imported once under a private name per absolute path
    (`prefix` + a hash): two user files of the same name (rewards.py) do not collide, and no installed module is
    shadowed. A file whose top level raises is not kept, so fixing it and importing again works."""
    from pathlib import Path

    path = Path(path_str)
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path}")
    name = prefix + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
