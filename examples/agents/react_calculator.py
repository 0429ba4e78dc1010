"""A ReAct-style calculator agent, written only against the `openai` client: it knows nothing of relayrl.

    user       What is 48*37+95?
    assistant  (a tool call)  calculator({"expression": "48*37+95"})
    tool       1871                                   evaluated here, by `evaluate` (an AST walk, never eval)
    assistant  1871                                   no tool call: the final answer

`run(example, client, model)` plays one episode: up to MAX_TURNS chat calls with the calculator offered as an OpenAI
tool (`tools=[CALCULATOR]`); while a reply carries `tool_calls`, the assistant message goes back as returned,
followed by one `{"role": "tool", "tool_call_id", "content"}` message per call; a reply without one is the answer.
It returns 1.0 when the answer's last integer equals `example.answer`, else 0.0 (the reward relayrl trains on).

Train it (relayrl's agent-function contract: the client is bound to the episode, sampling set by the run):

    rollout:
      agent: examples/agents/react_calculator.py:run

Try it against any OpenAI-compatible server, e.g. a model served by `relayrl serve --model DIR`:

    python examples/agents/react_calculator.py --base-url http://127.0.0.1:8000/v1 [--episodes 50] [--show 3]
    python examples/agents/react_calculator.py --base-url http://127.0.0.1:8000/v1 --question "What is 48*37+95?"

Each standalone episode sends an `X-Episode-Id` header (other servers ignore it): relayrl's endpoint then continues
the conversation from the token ids it sampled. Without one, a server renders the assistant's tool call afresh from
its JSON, and a tiny model that never saw that rendering answers worse after it. In training the client is already
bound to the episode.

The standalone run draws its own questions ("What is A op B op C?", two-digit operands, ops from * + -: the shape
of relayrl's `calculator` task) and answers them greedily; it prints each shown transcript and the success rate.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
from fractions import Fraction
from types import SimpleNamespace

import openai

MAX_TURNS = 3  # model calls per episode: a tool call, the answer, one spare
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": 'Integers, + - * / and parentheses, e.g. "(12 + 7) * 3".'}},
            "required": ["expression"],
        },
    },
}

# ---- the tool: integer arithmetic over the syntax tree ---------------------------------------------------------

MAX_CHARS = 200  # longer is not arithmetic this task needs; it also bounds the parser's recursion
MAX_DIGITS = 60  # every intermediate value stays below 10**60 (there is no power: growth is bounded by length)
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}
ALLOWED = "use integers, + - * / and parentheses"


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression` (integers, + - * /, unary minus, parentheses); ValueError otherwise,
    ZeroDivisionError on a division by zero. Nothing is executed: the expression is parsed, and only those node
    types are walked."""
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("the expression is empty")
    if len(text) > MAX_CHARS:
        raise ValueError(f"the expression is too long ({len(text)} characters, at most {MAX_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {text!r} ({ALLOWED})") from None
    return _walk(tree.body)


def _walk(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: refused by `is`
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _walk(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _bounded(_BINARY[type(node.op)](_walk(node.left), _walk(node.right)))
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    raise ValueError(f"{what} is not allowed; {ALLOWED}")


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= 10**MAX_DIGITS or value.denominator >= 10**MAX_DIGITS:
        raise ValueError(f"a value is too large (at most {MAX_DIGITS} digits)")
    return value


def format_value(value: Fraction) -> str:
    """An integer as itself ("6", also for 12/2); otherwise a short decimal ("0.333333333333")."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.12g}"


def calculator(expression: str) -> str:
    """The tool's reply: the value, or an error message the model can read (never an exception)."""
    try:
        return format_value(evaluate(expression))
    except ZeroDivisionError:
        return "error: division by zero"
    except ValueError as e:
        return f"error: {e}"


def tool_result(call) -> str:
    """The content answering one OpenAI tool call (an unknown tool or bad arguments: an error message)."""
    if call.function.name != "calculator":
        return f"error: unknown tool {call.function.name!r}; the only tool is calculator"
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return 'error: give the arguments as {"expression": "..."}'
    return calculator(args["expression"])


# ---- the agent ----------------------------------------------------------------------------------------------------

_INT = re.compile(r"-?\d+")


def last_int(text: str) -> str | None:
    found = _INT.findall(text or "")
    return found[-1] if found else None


def messages_of(prompt) -> list[dict]:
    """The first messages: a string prompt is one user message; a list of chat messages is taken as is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def episode(example, client: openai.OpenAI, model: str, max_turns: int = MAX_TURNS, **sampling) -> list[dict]:
    """One episode's conversation, ending with the final answer (or with the last tool results when the model was
    still calling the tool after `max_turns` calls, or when the conversation left no room for another reply).
    `sampling`: extra create() arguments (temperature, ...)."""
    messages = messages_of(example.prompt)
    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=[CALCULATOR], **sampling)
        except openai.BadRequestError as e:
            if e.code == "context_length_exceeded":  # no room left for a reply (a training run's episode budget)
                break
            raise
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # as returned: the server reuses its tokens
        if not message.tool_calls:
            break
        messages += [{"role": "tool", "tool_call_id": call.id, "content": tool_result(call)}
                     for call in message.tool_calls]
    return messages


def answer_of(messages: list[dict]) -> str:
    """The final answer: the last message when it is the assistant's without tool calls, else ''."""
    last = messages[-1]
    return (last.get("content") or "") if last["role"] == "assistant" and not last.get("tool_calls") else ""


def run(example, client: openai.OpenAI, model: str) -> float:
    """relayrl's agent function: one episode, 1.0 when its answer's last integer is the example's answer."""
    return 1.0 if last_int(answer_of(episode(example, client, model))) == str(example.answer) else 0.0


# ---- standalone ---------------------------------------------------------------------------------------------------

def questions(n: int, seed: int) -> list[SimpleNamespace]:
    """n questions shaped like relayrl's calculator task with digits [2, 2, 2] (its own draw, not relayrl's)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = (rng.randint(10, 99) for _ in range(3))
        expr = f"{a}{rng.choice('*+-')}{b}{rng.choice('*+-')}{c}"
        out.append(SimpleNamespace(prompt=f"What is {expr}?", answer=format_value(evaluate(expr))))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True, help="the server's /v1 URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="unused", help="the server's token, if it has one")
    ap.add_argument("--model", help="the model name to send (default: the server's first model)")
    ap.add_argument("--question", help="ask this one question and show the transcript")
    ap.add_argument("--episodes", type=int, default=20, help="questions to draw (default 20)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=2, help="transcripts to print (default 2)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    a = ap.parse_args(argv)
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0)
    model = a.model or client.models.list().data[0].id
    if a.question:
        exs = [SimpleNamespace(prompt=a.question, answer=None)]
    else:
        exs = questions(a.episodes, a.seed)
    wins = 0
    for i, ex in enumerate(exs):
        # one episode id per conversation (a header other servers ignore): relayrl's endpoint then continues each
        # call from the ids it sampled instead of re-rendering the tool call's text (see the module docstring)
        bound = client.with_options(default_headers={"X-Episode-Id": f"react-{a.seed}-{i}"})
        msgs = episode(ex, bound, model, temperature=a.temperature, max_tokens=a.max_tokens)
        ok = ex.answer is not None and last_int(answer_of(msgs)) == ex.answer
        wins += ok
        if a.question or i < a.show:
            for m in msgs:
                said = m.get("content") or ""
                calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls") or []]
                print(f"  {m['role']:9s} {said}{' -> ' if said and calls else ''}{', '.join(calls)}")
            print(f"  {'expected ' + ex.answer + (': right' if ok else ': wrong') if ex.answer else ''}\n")
    if not a.question:
        print(f"success {wins}/{len(exs)} = {wins / len(exs):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
