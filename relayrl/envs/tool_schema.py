"""This module turns a Python function into the JSON schema a chat template shows the model, and checks a
model's arguments against that schema before the function is called.

The schema comes from the signature and a Google-style docstring:

    def calculator(expression: str, precision: int = 6) -> str:
        '''Evaluate an arithmetic expression.            <- first paragraph: the tool's description

        Args:
            expression: The expression, e.g. "2 * (3 + 4)".   <- one description per parameter
            precision: Digits after the point.
        '''

gives {"type": "object", "properties": {"expression": {"type": "string", "description": ...}, "precision":
{"type": "integer", ...}}, "required": ["expression"]}. Types map as str -> string, int -> integer, float ->
number, bool -> boolean, list[X] -> array of X, dict -> object, Literal[...] -> enum, Optional[X] / X | None ->
X with "nullable": true. Anything else (an untyped or undocumented parameter, *args, a type JSON cannot
describe) is a ConfigError naming the function and the parameter: a tool the model cannot be told how to
call is a mistake in the user's setup.

It imports the standard library and relayrl.errors only.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

from relayrl.errors import ConfigError

_BASIC = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields?|Examples?|Notes?|Attributes):\s*$")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


class _Unsupported(Exception):
    """A type hint a JSON schema cannot describe (turned into a ConfigError by the caller)."""


def function_schema(fn: Callable[..., Any], name: str) -> tuple[str, dict]:
    """(description, parameters schema) of `fn`, or a ConfigError naming `name` and the parameter at fault."""
    where = f"tool '{name}' ({_qualname(fn)})"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read its signature: {e}") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve, in the user's module
        raise ConfigError(f"{where}: cannot resolve its type hints: {type(e).__name__}: {e}") from None
    doc = inspect.getdoc(fn)
    if not doc:
        raise ConfigError(f"{where} has no docstring: its first paragraph is the description the model reads")
    description, arg_docs = parse_docstring(doc)
    if not description:
        raise ConfigError(f"{where}: the docstring's first paragraph (the tool's description) is empty")

    properties: dict[str, dict] = {}
    required: list[str] = []
    for pname, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ConfigError(
                f"{where}: parameter '{pname}' is {param.kind.description}; a tool takes named arguments only"
            )
        if pname not in hints:
            raise ConfigError(f"{where}: parameter '{pname}' has no type hint (e.g. '{pname}: str')")
        try:
            prop = type_schema(hints[pname])
        except _Unsupported as e:
            raise ConfigError(
                f"{where}: parameter '{pname}' has type {e} that a JSON schema cannot describe "
                f"(use str, int, float, bool, list[...], dict, Literal[...] or Optional[...])"
            ) from None
        if pname not in arg_docs:
            raise ConfigError(
                f"{where}: parameter '{pname}' is not described in the docstring's Args: section "
                f"(add a line '{pname}: <what it is>')"
            )
        prop["description"] = arg_docs[pname]
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    return description, {"type": "object", "properties": properties, "required": required}


def type_schema(tp: Any) -> dict:
    """The JSON schema of one type hint (raises _Unsupported with the hint's spelling)."""
    if tp in _BASIC:
        return {"type": _BASIC[tp]}
    if tp is list:
        return {"type": "array"}
    if tp is dict:
        return {"type": "object"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if origin is Literal:
        kinds = {_BASIC.get(type(v)) for v in args}
        if len(kinds) != 1 or None in kinds:
            raise _Unsupported(f"{_spell(tp)} (a Literal's values must all be str, all int, ...)")
        return {"type": kinds.pop(), "enum": list(args)}
    if origin is Union or origin is types.UnionType:
        members = [a for a in args if a is not type(None)]
        if len(members) == 1 and len(args) == 2:
            return {**type_schema(members[0]), "nullable": True}
    raise _Unsupported(_spell(tp))


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph joined on one line, {parameter: description} from the Args: section)."""
    lines = doc.expandtabs().splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        first.append(line.strip())
    arg_docs: dict[str, str] = {}
    try:
        start = next(i for i, line in enumerate(lines) if re.match(r"^\s*(Args|Arguments|Parameters):\s*$", line))
    except StopIteration:
        return " ".join(first), arg_docs
    header_indent = _indent(lines[start])
    entry_indent = None
    current = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= header_indent:  # the next section (Returns:, ...) or the end of Args
            break
        if entry_indent is None:
            entry_indent = indent
        m = _ARG_LINE.match(line.strip())
        if indent == entry_indent and m:
            current = m.group(1)
            arg_docs[current] = m.group(2).strip()
        elif current is not None:  # a continuation line of the current entry
            arg_docs[current] = (arg_docs[current] + " " + line.strip()).strip()
    return " ".join(first), arg_docs


def argument_error(tool_name: str, fn: Callable[..., Any], parameters: dict, arguments: dict) -> str | None:
    """Why `arguments` cannot be passed to the tool (one line, without "error: "), or None when they can.

    Checked against the schema (names, required, JSON types of basic values) and then the signature itself,
    so a mistake is told to the model before the function runs.
    """
    props = parameters.get("properties", {})
    for key in arguments:
        if key not in props:
            known = ", ".join(props) or "none"
            return f"{tool_name}() got an unexpected argument '{key}' (arguments: {known})"
    for key in parameters.get("required", []):
        if key not in arguments:
            return f"{tool_name}() missing argument '{key}'"
    for key, value in arguments.items():
        reason = value_error(value, props[key])
        if reason:
            return f"{tool_name}() argument '{key}' {reason}"
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return f"{tool_name}() {e}"
    except ValueError:  # a builtin without a readable signature: the schema check above is all there is
        pass
    return None


def value_error(value: Any, schema: dict) -> str | None:
    """Why a JSON value does not fit a (basic) schema, e.g. "must be an integer, got string '3'"; or None."""
    if value is None:
        return None if schema.get("nullable") else f"must be {_article(schema.get('type'))}, got null"
    kind = schema.get("type")
    if kind is not None and _json_kind(value) not in _ACCEPTS.get(kind, {kind}):
        return f"must be {_article(kind)}, got {_json_kind(value)} {_short(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {', '.join(_short(v) for v in schema['enum'])}, got {_short(value)}"
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            reason = value_error(item, schema["items"])
            if reason:
                return f"item {i} {reason}"
    return None


# A JSON integer is a number too; the other kinds only accept themselves.
_ACCEPTS = {"number": {"number", "integer"}}


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _article(kind: Any) -> str:
    kind = str(kind)
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _spell(tp: Any) -> str:
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")


def _qualname(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"
