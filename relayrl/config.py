"""This module is the typed config base: pydantic models that forbid unknown keys, load from YAML and take
dotted overrides.

Each layer defines the config of the code it configures (`DataConfig` in `relayrl.data`, ...) by
subclassing `Config`; the run config composes them. Every error names the dotted key:

    config error: trainer.lr: Input should be greater than 0 (got -1)
    config error: trainer.lr: Input should be a finite number (got inf)    (every float; see Config)

It also parses the JSON files and texts relayrl did not write (`parse_json`), within the same kind of bounds.

It is part of relayrl's ground floor: it imports pydantic, PyYAML and relayrl.errors only, and it must
never import any other relayrl module, since every layer imports it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from relayrl.errors import ConfigError

C = TypeVar("C", bound="Config")


# Bounds on a YAML document, checked while it is composed (before anything is built from it): a config is a few
# hundred nodes a few levels deep. Past these it is an attack or a mistake, refused in one line with its position,
# never a RecursionError or an alias bomb (9 anchors of 9 aliases each: 1 KB of text, 9**9 nodes once expanded by
# whatever walks the data next, pydantic, deep_merge or yaml.safe_dump of the run's config)
MAX_YAML_DEPTH = 100
MAX_YAML_NODES = 100_000  # counted with every alias expanded


class _Loader(yaml.SafeLoader):
    """YAML with numbers as people write them (YAML 1.2's rules): PyYAML follows YAML 1.1, where
    `3e-3` and `1e5` (no dot) are strings, `1:30` is 90 (base 60) and `010` is 8 (octal).

    Bounded and strict: nesting past MAX_YAML_DEPTH, a document past MAX_YAML_NODES nodes with its aliases
    expanded, and a key written twice in one mapping (a second `trainer:` block would silently replace the first)
    are YAML errors with the line they are at. A merge key (`<<: *base`) still overrides, as YAML means it to."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                                              self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _check_expanded_size(node)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: SafeConstructor refuses it with its own message
                    continue
                if earlier is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {earlier.start_mark.line + 1}): "
                        "write each key once (merge the two blocks)", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse a document whose node count, every alias expanded, passes MAX_YAML_NODES. Each distinct node is
    sized once (an alias is the same node object as its anchor), so the check is linear in the text."""
    size: dict[int, int] = {}
    open_: set[int] = set()  # nodes whose children are being sized: meeting one again is a cycle
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else
                    list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if not children_done:
            if id(node) in open_:
                raise yaml.composer.ComposerError(None, None, "an alias refers to a node that contains it (a "
                                                  "recursive document)", node.start_mark)
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in size)
            continue
        open_.discard(id(node))
        total = 1 + sum(size.get(id(c), 0) for c in children)
        if total > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(
                None, None, f"the document expands to more than {MAX_YAML_NODES} nodes (aliases of aliases: "
                "an alias bomb?); write the values out or use fewer aliases", node.start_mark)
        size[id(node)] = total


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
    try:
        return int(text, 0) if text[:2] in ("0x", "0o") else int(text)  # 010 is ten, not eight
    except ValueError:  # past Python's digit limit (4300): no setting needs a number that long
        raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(text)} digits is too long",
                                                node.start_mark) from None


def _float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    text = loader.construct_scalar(node).replace("_", "").lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_Loader.add_constructor("tag:yaml.org,2002:int", _int)
_Loader.add_constructor("tag:yaml.org,2002:float", _float)


def parse_yaml(text: str) -> Any:
    """yaml.safe_load, with numbers as people write them: 3e-3, 1E-5, .5, 1_000 (never code: safe)."""
    return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader


MAX_JSON_DEPTH = 100  # a dataset row, a tool call's arguments or a config.json is a few levels deep
_LONG_NUMBER = re.compile(r"[0-9]{4301,}")  # past Python's int-from-string digit limit (sys.int_info)


def parse_json(text: str | bytes) -> Any:
    """json.loads of a file or text we did not write, bounded: nesting past MAX_JSON_DEPTH and an integer past
    Python's digit limit are json.JSONDecodeError like any malformed text (so a caller's one line for malformed
    JSON covers them, with its file and line), never a RecursionError or a ValueError traceback."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    try:
        value = json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", text, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # the int conversion of a number with thousands of digits
        m = _LONG_NUMBER.search(text)
        if m is None:
            raise json.JSONDecodeError(str(e).split(":")[0], text, 0) from None
        raise json.JSONDecodeError(f"a number of {m.end() - m.start()} digits is too long", text, m.start()) from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise json.JSONDecodeError(f"nested deeper than {MAX_JSON_DEPTH} levels", text, 0)
    return value


def _depth(value: Any) -> int:
    """The nesting depth of parsed JSON (a scalar 0, [] 1), iteratively: it may be deeper than the recursion limit."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:  # one level past the bound is enough to refuse
                stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


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
