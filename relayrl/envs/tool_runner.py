"""This module runs the tool calls of one assistant turn and turns each outcome into a `tool` message.

    reply text ──parse──> [call | malformed] ──check args──> thread pool ──result──> {"role": "tool", ...}
                                                           (timeout_s)   or error

Whatever goes wrong comes back to the model as one line starting "error: " (a malformed block, an unknown
tool, wrong or missing arguments, an exception in the tool, a timeout, too many calls), never as an exception
out of `ToolRunner.run`: the model can read the error and correct itself, and one bad reply never stops a
rollout. The runner counts, per turn, the calls, the errors and the timeouts (the tools/* metrics).

Why threads and not processes: tools are the user's own trusted Python functions (untrusted code, the
model's, goes to relayrl.sandbox instead), and calling them in-process keeps their imports and state warm.
A thread cannot be killed, so a call that times out is abandoned: its thread may finish later, and until
then it occupies one of the pool's `max_workers` threads. The pool is bounded, so a tool that hangs forever
costs at most `max_workers` threads; when every thread is held by such calls, further calls are refused
with an error instead of queueing behind them. The threads are daemons, so a hung tool never keeps the
process from exiting (concurrent.futures' pool would join it at exit). Calls of one `run` go one after
another; a runner may be shared by many threads (episodes), whose calls then queue for the `max_workers`
threads: a call's timeout counts from when it starts running, so queueing costs time but is never reported
as the tool's timeout.

It imports the standard library, relayrl.errors and its sibling tool modules only.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relayrl.envs.threads import DaemonPool
from relayrl.envs.tool_calls import ToolCall, has_tool_call, parse_in_order
from relayrl.envs.tool_schema import argument_error
from relayrl.errors import ConfigError

if TYPE_CHECKING:
    from relayrl.envs.tools import Tool


@dataclass
class ToolTurn:
    messages: list[dict]  # one {"role": "tool", "name": <tool name or "error">, "content": ...} per call/error
    calls: int  # well-formed calls the model made (including ones refused for going over max_calls)
    errors: int  # error messages of any kind: malformed, unknown tool, bad arguments, raised, timeout, over limit
    timeouts: int
    seconds: float


class ToolRunner:
    """Runs the tool calls in a reply (see the module docstring for the threading and timeout contract)."""

    def __init__(
        self,
        tools: list[Tool],
        *,
        timeout_s: float = 5.0,
        max_calls: int = 4,
        max_result_chars: int = 2000,
        max_workers: int = 4,
    ):
        if not timeout_s > 0:
            raise ConfigError(f"tool timeout_s must be > 0, got {timeout_s}")
        for key, value in (
            ("max_calls", max_calls),
            ("max_result_chars", max_result_chars),
            ("max_workers", max_workers),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"tool {key} must be an integer >= 1, got {value!r}")
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ConfigError(f"two tools are named '{t.name}'; tool names must be unique")
            self.tools[t.name] = t
        self.timeout_s = float(timeout_s)
        self.max_calls = max_calls
        self.max_result_chars = max_result_chars
        self._pool = DaemonPool(max_workers, name="relayrl-tool")
        self._abandoned: set[Future] = set()  # timed-out calls whose threads still run
        self._lock = threading.Lock()

    def run(self, text: str) -> ToolTurn | None:
        """The tool messages answering `text`'s calls, or None when `text` calls no tool (it is an answer)."""
        if not has_tool_call(text):
            return None
        start = time.perf_counter()
        messages: list[dict] = []
        calls = errors = timeouts = 0
        for item in parse_in_order(text):
            if isinstance(item, str):
                messages.append(self._message("error", f"error: malformed tool call: {item}"))
                errors += 1
                continue
            calls += 1
            if calls > self.max_calls:
                limit = f"at most {self.max_calls}"
                content = f"error: too many tool calls in one turn ({limit}); '{item.name}' was not run"
                messages.append(self._message(item.name, content))
                errors += 1
                continue
            name, content, failed, timed_out = self._call(item)
            messages.append(self._message(name, content))
            errors += failed
            timeouts += timed_out
        return ToolTurn(messages, calls, errors, timeouts, time.perf_counter() - start)

    def close(self) -> None:
        """Stop the idle threads (a thread still running an abandoned call ends when that call returns)."""
        self._pool.close()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, call: ToolCall) -> tuple[str, str, bool, bool]:
        """(message name, content, is an error, timed out) for one well-formed call."""
        t = self.tools.get(call.name)
        if t is None:
            available = ", ".join(sorted(self.tools)) or "none"
            return "error", f"error: unknown tool '{call.name}' (available: {available})", True, False
        reason = argument_error(t.name, t.fn, t.parameters, call.arguments)
        if reason:
            return t.name, f"error: {reason}", True, False
        busy = (
            f"error: {t.name} was not run: all {self._pool.size} tool threads are still busy with calls that timed out"
        )
        if self._all_threads_hung():
            return t.name, busy, True, False
        job = self._pool.submit(t.fn, call.arguments)
        # The timeout counts from the moment the call starts running, not from its submission: a call queued
        # behind other episodes' calls is not the tool's fault. While it waits, it gives up only if every
        # thread is held by an abandoned call (then nothing would ever run it).
        while not job.started.wait(0.02):
            if self._all_threads_hung() and job.future.cancel():
                return t.name, busy, True, False
        future = job.future
        try:
            result = future.result(timeout=max(0.0, job.started_at + self.timeout_s - time.monotonic()))
        except FutureTimeout:
            with self._lock:
                self._abandoned.add(future)
            future.add_done_callback(self._forget)
            return t.name, f"error: {t.name} timed out after {self.timeout_s}s", True, True
        except (Exception, SystemExit) as e:  # the tool's own failure is the model's to read (Ctrl-C is not)
            message = _first_line(e)
            raised = f"{type(e).__name__}: {message}" if message else type(e).__name__
            return t.name, f"error: {t.name} raised {raised}", True, False
        try:
            return t.name, _render(result), False, False
        except Exception as e:  # a result whose __str__ itself fails
            return t.name, f"error: {t.name} returned a {type(result).__name__} that cannot be shown ({e})", True, False

    def _all_threads_hung(self) -> bool:
        with self._lock:
            return len(self._abandoned) >= self._pool.size

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._abandoned.discard(future)

    def _message(self, name: str, content: str) -> dict:
        if len(content) > self.max_result_chars:
            cut = len(content) - self.max_result_chars
            content = content[: self.max_result_chars] + f"... [{cut} more characters cut]"
        return {"role": "tool", "name": name, "content": content}


def _render(result: Any) -> str:
    """A tool's result as the text the model reads: strings as they are, other values as JSON or str()."""
    if result is None or (isinstance(result, str) and not result.strip()):
        return "(no output)"
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON-able (a set, an object): its str() is the best we can show
        return str(result)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
