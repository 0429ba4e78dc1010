"""Typed config: pydantic models that forbid unknown keys, load from YAML, take dotted overrides.

Each layer defines the config of the code it configures (`DataConfig` in `relayrl.data`, ...) by
subclassing `Config`; the run config composes them. Every error names the dotted key:

    config error: trainer.lr: Input should be greater than 0 (got -1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from relayrl.errors import ConfigError

C = TypeVar("C", bound="Config")


class Config(BaseModel):
    """Base for every config section: unknown keys and wrong types are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, frozen=False)

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(describe_validation_error(e)) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def describe_validation_error(e: ValidationError) -> str:
    """One line per problem, each naming its dotted key; joined with '; '."""
    parts = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown key '{key}'")
        else:
            got = err.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {got!r})"
            parts.append(f"{key}: {err['msg']}{got_s}")
    return "config error: " + "; ".join(parts)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"malformed YAML in {p}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"malformed config {p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.path=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return data


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out
