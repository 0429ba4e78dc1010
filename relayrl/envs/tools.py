"""This module defines the tools an agent can call: a Tool is a Python function with the JSON schema a chat
template shows the model, and the built-in `calculator`.

    @tool
    def lookup(word: str) -> str:
        '''Look a word up in the dictionary.

        Args:
            word: The word to look up.
        '''
    lookup.schema()  ->  {"type": "function", "function": {"name": "lookup", "description": ..., "parameters": ...}}
    tokenizer.apply_chat_template(messages, tools=[lookup.schema()], ...)

The schema is derived from the signature and the docstring (relayrl.envs.tool_schema). Tools a config names
load with `load_tool`: a built-in name, "pkg.module:function" or "path/file.py:function". Replies are parsed
by relayrl.envs.tool_calls and run by relayrl.envs.tool_runner; their public names are re-exported here, so
callers import everything about tools from this one module.

It imports the standard library, relayrl.errors, the user-object loader of relayrl.rewards and its sibling
tool modules only.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from relayrl.envs.tool_calls import ParsedCalls, ToolCall, parse_tool_calls
from relayrl.envs.tool_runner import ToolRunner, ToolTurn
from relayrl.envs.tool_schema import function_schema
from relayrl.errors import ConfigError
from relayrl.rewards.registry import load_user_object

__all__ = [
    "BUILTIN_TOOLS",
    "ParsedCalls",
    "Tool",
    "ToolCall",
    "ToolRunner",
    "ToolTurn",
    "calculator",
    "calculator_tool",
    "load_tool",
    "parse_tool_calls",
    "tool",
]

# Hermes/Qwen templates and OpenAI-style APIs accept these; a name with spaces or quotes would not round-trip.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # the JSON schema of the arguments object
    fn: Callable[..., Any]

    def schema(self) -> dict:
        """The tool as HF chat templates take it: `apply_chat_template(messages, tools=[t.schema()])`."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),  # a template or caller may not alter ours
            },
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A decorated function stays callable as itself."""
        return self.fn(*args, **kwargs)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """`@tool`, `@tool(name="calc")` or `tool(fn)`: the function as a Tool, its schema from signature and docstring.

    A parameter without a type hint or a line in the docstring's Args: section is a ConfigError naming it.
    """

    def build(f: Callable[..., Any]) -> Tool:
        if isinstance(f, Tool):
            return f if name is None else replace(f, name=_checked_name(name))
        if not callable(f):
            raise ConfigError(f"a tool must be a function, got {type(f).__name__}")
        tool_name = _checked_name(name or getattr(f, "__name__", ""))
        description, parameters = function_schema(f, tool_name)
        return Tool(tool_name, description, parameters, f)

    return build if fn is None else build(fn)


def _checked_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"tool name {name!r} is not valid: use letters, digits, '_', '.' or '-' "
            f"(at most 64, not starting with a digit)"
        )
    return name


def load_tool(spec: str) -> Tool:
    """The tool named by a config: a built-in ("calculator"), "pkg.module:function" or "path/file.py:function".

    The function may already be a Tool (decorated with @tool) or a plain documented function.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"a tool is given as a name or 'module:function', got {spec!r}")
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise ConfigError(
            f"unknown tool '{spec}': built-ins are {', '.join(sorted(BUILTIN_TOOLS))}; for your own use "
            f"'pkg.module:function' or 'path/file.py:function'"
        )
    obj = load_user_object(spec, "tool", ConfigError)
    return obj if isinstance(obj, Tool) else tool(obj)


# --- the built-in calculator: arithmetic over the AST, never eval() ---------------------------------------

_MAX_CHARS = 500  # longer input is not arithmetic a model needs, and bounds the parser's recursion
_MAX_DIGITS = 100  # |every intermediate value| < 10**100, so no operation can take long or much memory
_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_ALLOWED = "use numbers, + - * / // % ** and parentheses"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic to do, with numbers, + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    return _format_number(evaluate_arithmetic(expression))


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of `expression`; a ValueError (or ZeroDivisionError) that says what is wrong otherwise."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("the expression is empty")
    if len(text) > _MAX_CHARS:
        raise ValueError(f"the expression is too long ({len(text)} characters, at most {_MAX_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {text!r} ({_ALLOWED})") from None
    except (RecursionError, MemoryError, ValueError):  # deep nesting, or a NUL byte
        raise ValueError(f"cannot parse the expression ({_ALLOWED})") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    # Children are evaluated only under an allowed node: `__import__('os')` is refused at the call node,
    # before anything inside it is looked at.
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{value!r} is not a number ({_ALLOWED})")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_OPS[type(node.op)](left, right))
        except OverflowError:
            raise ValueError(f"the result is too large (at most {_MAX_DIGITS} digits)") from None
    if isinstance(node, ast.Name):
        raise ValueError(f"names are not allowed ('{node.id}'); {_ALLOWED}")
    if isinstance(node, ast.Call):
        raise ValueError(f"function calls are not allowed; {_ALLOWED}")
    if isinstance(node, ast.Attribute):
        raise ValueError(f"attribute access is not allowed ('.{node.attr}'); {_ALLOWED}")
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ValueError(f"{what} is not allowed; {_ALLOWED}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would pass the magnitude bound, before computing it (2**99999 would not
    be slow, but 9**9**9 would be)."""
    if base != 0 and abs(base) != 1 and exponent * math.log10(abs(base)) >= _MAX_DIGITS:
        raise ValueError(f"the result of {base}**{exponent} is too large (at most {_MAX_DIGITS} digits)")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number (a fractional power of a negative number)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"the result is too large (at most {_MAX_DIGITS} digits)")
    if abs(value) >= 10**_MAX_DIGITS:
        raise ValueError(f"the result is too large (at most {_MAX_DIGITS} digits)")
    return value


def _format_number(value: int | float) -> str:
    """Integers as integers ("6", also for 12 / 2), other values as a short decimal ("0.333333333333")."""
    if isinstance(value, int):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


calculator_tool = tool(calculator)
BUILTIN_TOOLS: dict[str, Tool] = {"calculator": calculator_tool}
