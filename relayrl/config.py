"""This module is the typed config base: pydantic models that forbid unknown keys, load from YAML and take
dotted overrides.

Each layer defines the config of the code it configures (`DataConfig` in `relayrl.data`, ...) by
subclassing `Config`; the run config composes them. Every error names the dotted key:

    config error: trainer.lr: Input should be greater than 0 (got -1)
    config error: trainer.lr: Input should be a finite number (got inf)    (every float; see Config)

It is part of relayrl's ground floor: it imports pydantic, PyYAML and relayrl.errors only, and it must
never import any other relayrl module, since every layer imports it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from relayrl.errors import ConfigError

C = TypeVar("C", bound="Config")


class _Loader(yaml.SafeLoader):
    """YAML with numbers as people write them (YAML 1.2's rules): PyYAML follows YAML 1.1, where
    `3e-3` and `1e5` (no dot) are strings, `1:30` is 90 (base 60) and `010` is 8 (octal)."""


_EXP = r"[eE][-+]?[0-9]+"
_FLOAT = re.compile(rf"""^(?:[-+]?(?:\.[0-9][0-9_]*(?:{_EXP})?               # .5, .5e3
                             |[0-9][0-9_]*(?:\.[0-9_]*(?:{_EXP})?|{_EXP}))  # 1.5, 1., 1.5e-3, 3e-3
                       |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X)
_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+)$")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:int", _INT, list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = loader.construct_scalar(node).replace("_", "")
    return int(text, 0) if text[:2] in ("0x", "0o") else int(text)  # 010 is ten, not eight


def _float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    text = loader.construct_scalar(node).replace("_", "").lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_Loader.add_constructor("tag:yaml.org,2002:int", _int)
_Loader.add_constructor("tag:yaml.org,2002:float", _float)


def parse_yaml(text: str) -> Any:
    """yaml.safe_load, with numbers as people write them: 3e-3, 1E-5, .5, 1_000 (never code: safe)."""
    return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader


class Config(BaseModel):
    """Base for every config section: unknown keys and wrong types are errors."""

    # allow_inf_nan=False: every float setting is finite (`trainer.lr: .inf` passes gt=0 and would train NaN); a
    # field where infinity means something opts out with Field(..., allow_inf_nan=True)
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, frozen=False,
                              allow_inf_nan=False)
    # settings renamed or replaced: the old key -> what to write instead. Refused in one line for a release, so a
    # config written for the old name fails naming the new one instead of as an unknown key
    RENAMED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, instead in cls.RENAMED.items():
                if old in data:
                    raise ValueError(f"'{old}' was replaced: {instead}")
        return data

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
        data = parse_yaml(p.read_text())
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
            value = parse_yaml(raw) if raw != "" else ""
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
