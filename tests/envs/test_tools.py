"""Tools for agents: the JSON schema derived from a function (checked against a hand-written one and rendered
through real chat templates), loading tools by spec, parsing Hermes/Qwen <tool_call> blocks, the runner's
error observations and counters (each kind of failure, timeouts within their bound), and the calculator's
values and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Literal, Optional

import pytest

from relayrl.envs.tools import (
    BUILTIN_TOOLS,
    Tool,
    ToolCall,
    ToolRunner,
    calculator,
    calculator_tool,
    load_tool,
    parse_tool_calls,
    tool,
)
from relayrl.errors import ConfigError
from relayrl.models.tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def search(
    query: str,
    limit: int = 5,
    sources: Optional[list[str]] = None,  # noqa: UP045 -- the typing spelling must work too
    mode: Literal["fast", "exact"] = "fast",
    threshold: float | None = None,
    verbose: bool = False,
) -> list[str]:
    """Search the notes for a query.

    This paragraph is not part of the description.

    Args:
        query: The words to look for,
            over two lines.
        limit: How many results to return.
        sources (list[str]): Which collections to search.
        mode: Fast or exact matching.
        threshold: The lowest score kept.
        verbose: Whether to explain each result.

    Returns:
        The matching notes.
    """
    return [query] * limit


SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the notes for a query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "The words to look for, over two lines."},
                "limit": {"type": "integer", "description": "How many results to return."},
                "sources": {
                    "type": "array",
                    "items": {"type": "string"},
                    "nullable": True,
                    "description": "Which collections to search.",
                },
                "mode": {"type": "string", "enum": ["fast", "exact"], "description": "Fast or exact matching."},
                "threshold": {"type": "number", "nullable": True, "description": "The lowest score kept."},
                "verbose": {"type": "boolean", "description": "Whether to explain each result."},
            },
            "required": ["query"],
        },
    },
}


@pytest.mark.unit
def test_schema_is_derived_from_signature_and_docstring():
    t = tool(search)
    assert t.schema() == SEARCH_SCHEMA
    assert t(query="x", limit=2) == ["x", "x"]  # a Tool still calls its function
    t.schema()["function"]["parameters"]["required"].append("limit")  # a caller's edit must not reach the tool
    assert t.schema() == SEARCH_SCHEMA


@pytest.mark.unit
def test_decorator_forms_and_names():
    @tool
    def echo(text: str) -> str:
        """Say it back.

        Args:
            text: What to say.
        """
        return text

    @tool(name="shout")
    def loud(text: str) -> str:
        """Say it loudly.

        Args:
            text: What to say.
        """
        return text.upper()

    assert isinstance(echo, Tool) and echo.name == "echo" and echo.description == "Say it back."
    assert loud.name == "shout" and loud("hi") == "HI"
    with pytest.raises(ConfigError, match="not valid"):
        tool(search, name="two words")


def _documented(annotation: str, doc_args: str = "x: A value.", extra: str = "") -> object:
    source = f'def f({annotation}{extra}):\n    """Do it.\n\n    Args:\n        {doc_args}\n    """\n'
    namespace: dict = {}
    exec(source, {"Literal": Literal}, namespace)  # a test-local function with exactly this signature
    return namespace["f"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "fn, fragment",
    [
        (_documented("x"), "parameter 'x' has no type hint"),
        (_documented("x: int", doc_args="y: Another."), "parameter 'x' is not described"),
        (_documented("x: set", doc_args="x: A set."), "parameter 'x' has type set that a JSON schema cannot"),
        (_documented("x: int", extra=", *rest: int"), "parameter 'rest' is variadic positional"),
        (_documented("x: int | str"), "parameter 'x' has type int | str"),
        (_documented("x: Literal['a', 1]"), "a Literal's values must all be"),
    ],
)
def test_schema_errors_name_the_function_and_parameter(fn, fragment):
    with pytest.raises(ConfigError) as err:
        tool(fn)
    message = str(err.value)
    assert fragment in message and "tool 'f'" in message and "\n" not in message


@pytest.mark.unit
def test_function_without_docstring_is_refused():
    def bare(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="tool 'bare' .* has no docstring"):
        tool(bare)


@pytest.mark.unit
def test_load_tool_from_file_module_and_builtin(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        textwrap.dedent(
            '''
            from relayrl.envs.tools import tool

            def add(a: int, b: int) -> int:
                """Add two integers.

                Args:
                    a: The first.
                    b: The second.
                """
                return a + b

            @tool(name="negate")
            def neg(a: int) -> int:
                """Negate an integer.

                Args:
                    a: The integer.
                """
                return -a

            NOT_A_FUNCTION = 3
            '''
        )
    )
    add = load_tool(f"{path}:add")
    assert add.name == "add" and add.parameters["required"] == ["a", "b"] and add(a=2, b=3) == 5
    assert load_tool(f"{path}:neg").name == "negate"  # an already-decorated Tool is kept as it is
    assert load_tool("calculator") is BUILTIN_TOOLS["calculator"] is calculator_tool
    assert load_tool("relayrl.envs.tools:calculator").schema() == calculator_tool.schema()

    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('bad import\\nsecond line')\n")
    for spec, fragment in [
        ("calculater", "unknown tool 'calculater': built-ins are calculator"),
        (f"{tmp_path}/missing.py:f", "FileNotFoundError"),
        (f"{path}:nope", "has no attribute 'nope'"),
        (f"{path}:NOT_A_FUNCTION", "is not a function (its type is int)"),
        (f"{broken}:f", "RuntimeError: bad import"),
        ("no_such_module_xyz:f", "ModuleNotFoundError"),
        ("", "a tool is given as"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_tool(spec)
        assert fragment in str(err.value) and "\n" not in str(err.value), spec


# Qwen2.5's Hermes tool template, shortened: each tool's schema as one JSON line inside <tools></tools>, tool
# results wrapped in <tool_response> inside a user turn.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.' }}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags'"
    " + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.unit
def test_schema_renders_through_chat_templates(tmp_path):
    tok = build_char_tokenizer(tmp_path / "tok", "abcdefghijklmnopqrstuvwxyz0123456789 +-*/()")
    messages = [{"role": "user", "content": "what is 12*7"}]
    tools = [calculator_tool.schema(), tool(search).schema()]

    plain = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "calculator(expression)" in plain and "search(" in plain  # the tiny template: names and arguments

    tok.chat_template = QWEN_STYLE_TEMPLATE
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    listed = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listed] == tools  # the full schema reaches the model, intact
    assert "Evaluate an arithmetic expression and return its value." in text

    # One round trip: the model's call is run, and its result renders as the template's tool response.
    reply = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
    with ToolRunner([calculator_tool]) as runner:
        turn = runner.run(reply)
    conversation = [*messages, {"role": "assistant", "content": reply}, *turn.messages]
    text = tok.apply_chat_template(conversation, tools=tools, tokenize=False)
    assert text.endswith("<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n")


@pytest.mark.unit
def test_parse_tool_calls():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    parsed = parse_tool_calls(call)
    assert parsed.calls == [ToolCall("calculator", {"expression": "1+1"})] and parsed.errors == []

    # Several calls with text around them and newlines inside the tags (as Qwen writes them).
    text = f'I will check.\n<tool_call>\n{{"name": "a", "arguments": {{"x": 1}}}}\n</tool_call>\nand {call} done.'
    parsed = parse_tool_calls(text)
    assert parsed.calls == [ToolCall("a", {"x": 1}), ToolCall("calculator", {"expression": "1+1"})]

    # Arguments as a JSON string holding an object; no arguments at all; Llama's "parameters".
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
        '<tool_call>{"name": "b", "parameters": {"y": 3}}</tool_call>'
    )
    assert parse_tool_calls(text).calls == [ToolCall("a", {"x": 2}), ToolCall("now", {}), ToolCall("b", {"y": 3})]

    # A final block without its closing tag counts when its JSON parses.
    parsed = parse_tool_calls('ok <tool_call>{"name": "a", "arguments": {"x": 1}}\n')
    assert parsed.calls == [ToolCall("a", {"x": 1})] and parsed.errors == []

    assert parse_tool_calls("The answer is 42.") == parse_tool_calls("") and not parse_tool_calls("42").calls


@pytest.mark.unit
@pytest.mark.parametrize(
    "block, fragment",
    [
        ('{"name": "a", "arguments": {"x": 1}', "malformed JSON"),
        ('{"arguments": {"x": 1}}', 'missing "name"'),
        ('{"name": 7, "arguments": {}}', '"name" must be a non-empty string, got a number'),
        ('{"name": "a", "arguments": [1, 2]}', '"arguments" must be a JSON object, got an array'),
        ('{"name": "a", "arguments": "{x: 1}"}', '"arguments" is a string that is not valid JSON'),
        ('["a", {"x": 1}]', "expected a JSON object"),
        ("", "empty"),
    ],
)
def test_malformed_blocks_are_errors_not_exceptions(block, fragment):
    good = '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    parsed = parse_tool_calls(f"{good}<tool_call>{block}</tool_call>{good}")
    assert parsed.calls == [ToolCall("ok", {}), ToolCall("ok", {})]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("block 2:") and fragment in parsed.errors[0]


@pytest.mark.unit
def test_unclosed_blocks():
    # An unclosed block followed by another block is read up to the next opening tag.
    parsed = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}} <tool_call>{"name": "b"}</tool_call>')
    assert parsed.calls == [ToolCall("a", {}), ToolCall("b", {})] and parsed.errors == []
    parsed = parse_tool_calls('<tool_call>{"name": "a", "argu')  # cut mid-JSON: an error, said as unclosed
    assert parsed.calls == [] and parsed.errors[0].startswith("block 1 (no closing </tool_call>): malformed JSON")


def add(a: int, b: int = 0, mode: Literal["sum", "diff"] = "sum") -> int:
    """Add or subtract two integers.

    Args:
        a: The first integer.
        b: The second integer.
        mode: Whether to add or subtract.
    """
    return a + b if mode == "sum" else a - b


def fail(reason: str) -> str:
    """Raise an error.

    Args:
        reason: The message.
    """
    raise KeyError(reason)


def give(kind: str) -> object:
    """Return a value of a kind.

    Args:
        kind: Which value.
    """
    return {"none": None, "empty": "", "dict": {"x": [1, 2]}, "set": {3}, "long": "x" * 250}[kind]


def _call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def runner():
    r = ToolRunner([tool(add), tool(fail), tool(give), calculator_tool], timeout_s=2.0, max_result_chars=200)
    yield r
    r.close()


@pytest.mark.unit
@pytest.mark.parametrize(
    "call, name, content",
    [
        (_call("add", a=2, b=3), "add", "5"),
        (_call("add", a=2, b=3, mode="diff"), "add", "-1"),
        (
            _call("ad", a=1),
            "error",
            "error: unknown tool 'ad' (available: add, calculator, fail, give)",
        ),
        (_call("add", b=1), "add", "error: add() missing argument 'a'"),
        (_call("add", a=1, c=2), "add", "error: add() got an unexpected argument 'c' (arguments: a, b, mode)"),
        (_call("add", a="2"), "add", "error: add() argument 'a' must be an integer, got string '2'"),
        (_call("add", a=True), "add", "error: add() argument 'a' must be an integer, got boolean True"),
        (_call("add", a=1, mode="avg"), "add", "error: add() argument 'mode' must be one of 'sum', 'diff', got 'avg'"),
        (_call("fail", reason="boom"), "fail", "error: fail raised KeyError: 'boom'"),
        (
            _call("calculator", expression="1/0"),
            "calculator",
            "error: calculator raised ZeroDivisionError: division by zero",
        ),
        (_call("give", kind="none"), "give", "(no output)"),
        (_call("give", kind="empty"), "give", "(no output)"),
        (_call("give", kind="dict"), "give", '{"x": [1, 2]}'),
        (_call("give", kind="set"), "give", "{3}"),
        (_call("give", kind="long"), "give", "x" * 200 + "... [50 more characters cut]"),
        (
            "<tool_call>{oops}</tool_call>",
            "error",
            (
                "error: malformed tool call: block 1: malformed JSON "
                "(Expecting property name enclosed in double quotes at line 1 column 2)"
            ),
        ),
    ],
)
def test_runner_answers_every_outcome_with_one_message(runner, call, name, content):
    turn = runner.run(f"Thinking... {call}")
    assert turn is not None and len(turn.messages) == 1
    message = turn.messages[0]
    assert message["role"] == "tool" and message["name"] == name and "\n" not in message["content"]
    assert message["content"] == content
    is_error = content.startswith("error:")
    assert (turn.errors, turn.timeouts) == (int(is_error), 0)
    assert turn.calls == (0 if "malformed" in content else 1)


@pytest.mark.unit
def test_runner_counts_a_mixed_turn_and_caps_calls():
    r = ToolRunner([tool(add)], max_calls=2)
    text = _call("add", a=1) + "<tool_call>not json</tool_call>" + _call("nope") + _call("add", a=2) + _call("add", a=3)
    turn = r.run(text)
    assert [m["content"] for m in turn.messages] == [
        "1",
        turn.messages[1]["content"],
        "error: unknown tool 'nope' (available: add)",
        "error: too many tool calls in one turn (at most 2); 'add' was not run",
        "error: too many tool calls in one turn (at most 2); 'add' was not run",
    ]
    assert turn.messages[1]["content"].startswith("error: malformed tool call: block 2: malformed JSON")
    assert (turn.calls, turn.errors, turn.timeouts) == (4, 4, 0)
    assert r.run("The answer is 3.") is None  # no tool call at all: the model answered
    r.close()


@pytest.mark.faults
def test_timeout_comes_back_within_its_bound_and_abandoned_calls_are_bounded():
    release = threading.Event()

    def wait(seconds: float) -> str:
        """Wait until released.

        Args:
            seconds: Unused.
        """
        release.wait(10)
        return "released"

    r = ToolRunner([tool(wait), tool(add)], timeout_s=0.2, max_workers=1)
    start = time.perf_counter()
    turn = r.run(_call("wait", seconds=1.0))
    elapsed = time.perf_counter() - start
    assert turn.messages[0]["content"] == "error: wait timed out after 0.2s"
    assert (turn.calls, turn.errors, turn.timeouts) == (1, 1, 1)
    assert 0.2 <= elapsed < 0.2 + 0.5
    # The only thread is still held by the abandoned call: refused at once rather than queued behind it.
    turn = r.run(_call("add", a=1))
    assert (
        turn.messages[0]["content"]
        == "error: add was not run: all 1 tool threads are still busy with calls that timed out"
    )
    release.set()
    deadline = time.monotonic() + 5
    while r.run(_call("add", a=1)).messages[0]["content"] != "1":  # the thread comes back once the call returns
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r.close()


@pytest.mark.faults
def test_a_call_queued_behind_others_is_not_timed_out_for_waiting():
    def nap(seconds: float) -> str:
        """Sleep a while.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "rested"

    # One thread, three episodes calling at once: each call runs 0.3 s, the last waits 0.6 s in the queue
    # first; with the timeout counted from submission it would time out at 0.5 s.
    r = ToolRunner([tool(nap)], timeout_s=0.5, max_workers=1)
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(r.run(_call("nap", seconds=0.3)).messages[0]["content"]))
        for _ in range(3)
    ]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == ["rested"] * 3 and time.perf_counter() - start >= 0.9  # they did run one after another
    r.close()


@pytest.mark.faults
def test_a_hung_tool_does_not_keep_the_process_from_exiting():
    script = textwrap.dedent(
        '''
        import time
        from relayrl.envs.tools import ToolRunner, tool

        def hang(x: int) -> int:
            """Never return.

            Args:
                x: Unused.
            """
            while True:
                time.sleep(1)

        r = ToolRunner([tool(hang)], timeout_s=0.1)
        print(r.run('<tool_call>{"name": "hang", "arguments": {"x": 1}}</tool_call>').messages[0]["content"])
        '''
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "error: hang timed out after 0.1s"


@pytest.mark.unit
@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("2 * (3 + 4) - 5", "9"),
        ("-3 ** 2", "-9"),  # ** binds tighter than unary minus
        ("(-3) ** 2", "9"),
        ("2 ** 3 ** 2", "512"),  # ** is right-associative
        ("10 - 4 - 3", "3"),  # - is left-associative
        ("7 / 2", "3.5"),
        ("12 / 4", "3"),  # an integral quotient prints as an integer
        ("1 / 3", "0.333333333333"),
        ("17 // 5", "3"),
        ("-7 // 2", "-4"),
        ("17 % 5", "2"),
        ("2 ** -2", "0.25"),
        ("123456789 * 987654321", "121932631112635269"),
        ("0.1 + 0.2", "0.3"),
        ("+4", "4"),
    ],
)
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.unit
@pytest.mark.parametrize(
    "expression, error, fragment",
    [
        ("__import__('os')", ValueError, "function calls are not allowed"),
        ("a.b", ValueError, "attribute access is not allowed"),
        ("x + 1", ValueError, "names are not allowed ('x')"),
        ("2**99999", ValueError, "too large"),
        ("9**9**9", ValueError, "too large"),
        ("10**99 * 10**99", ValueError, "too large"),
        ("1e308 * 10", ValueError, "too large"),
        ("(-8) ** 0.5", ValueError, "not a real number"),
        ("'a' * 3", ValueError, "'a' is not a number"),
        ("True + 1", ValueError, "True is not a number"),
        ("1 < 2", ValueError, "Compare is not allowed"),
        ("1 << 8", ValueError, "LShift is not allowed"),
        ("2 +", ValueError, "not an arithmetic expression"),
        ("", ValueError, "empty"),
        ("1+" * 300 + "1", ValueError, "too long"),
        ("1 / 0", ZeroDivisionError, "division by zero"),
    ],
)
def test_calculator_refuses(expression, error, fragment):
    with pytest.raises(error) as err:
        calculator(expression)
    assert fragment in str(err.value)
