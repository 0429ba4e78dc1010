"""This module finds the tool calls in a model's reply, in the Hermes/Qwen format:

    Let me compute that.
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

Every <tool_call> block is read in order. It is lenient where models are known to vary and strict where a
guess would run the wrong thing:
  - "arguments" may be an object or a string holding a JSON object (some models emit that); a missing
    "arguments" means no arguments, and "parameters" (Llama's spelling) is read when "arguments" is absent;
  - a final block without its closing tag counts when its JSON parses (generation stopped at the tag);
  - malformed JSON, a missing or non-string name, or arguments that are not an object give one short error
    per block, never an exception: the runner shows them to the model so it can correct itself. JSON nested
    past relayrl.config.MAX_JSON_DEPTH or a number of thousands of digits is malformed JSON too (a model can
    write either; they raised RecursionError and ValueError out of the environment step).

It imports the standard library and relayrl.config's bounded JSON parser only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from relayrl.config import parse_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedCalls:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one message per malformed block


def has_tool_call(text: str) -> bool:
    """Whether the reply tries to call a tool at all (a reply without an opening tag is an answer)."""
    return OPEN in text


def parse_tool_calls(text: str) -> ParsedCalls:
    """The well-formed calls and the errors of the malformed blocks in `text` (see the module docstring)."""
    parsed = ParsedCalls()
    for item in parse_in_order(text):
        if isinstance(item, ToolCall):
            parsed.calls.append(item)
        else:
            parsed.errors.append(item)
    return parsed


def parse_in_order(text: str) -> list[ToolCall | str]:
    """Each block of `text` in order: a ToolCall, or a str saying why the block is malformed.

    The runner answers calls and errors in the order the model wrote them, which ParsedCalls' two lists lose.
    """
    items: list[ToolCall | str] = []
    pos = text.find(OPEN)
    number = 0
    while pos != -1:
        number += 1
        start = pos + len(OPEN)
        close = text.find(CLOSE, start)
        reopen = text.find(OPEN, start)
        if close != -1 and (reopen == -1 or close < reopen):
            items.append(_read_block(text[start:close], f"block {number}"))
        else:  # no closing tag before the next block (or the end): lenient if the JSON parses on its own
            end = reopen if reopen != -1 else len(text)
            items.append(_read_block(text[start:end], f"block {number} (no closing {CLOSE})"))
        pos = reopen
    return items


def _read_block(body: str, block: str) -> ToolCall | str:
    body = body.strip()
    if not body:
        return f'{block}: empty (expected {{"name": ..., "arguments": {{...}}}})'
    try:
        obj = parse_json(body)
    except json.JSONDecodeError as e:
        return f"{block}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno})"
    if not isinstance(obj, dict):
        return f'{block}: expected a JSON object with "name" and "arguments", got {_kind(obj)}'
    name = obj.get("name")
    if name is None:
        return f'{block}: missing "name"'
    if not isinstance(name, str) or not name:
        return f'{block}: "name" must be a non-empty string, got {_kind(name)}'
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # a JSON object serialized into a string
        try:
            args = parse_json(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f'{block}: "{key}" is a string that is not valid JSON ({e.msg})'
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f'{block}: "{key}" must be a JSON object, got {_kind(args)}'
    return ToolCall(name=name, arguments=args)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}
    return names.get(type(value), "an object" if isinstance(value, dict) else type(value).__name__)
