"""Token capture: what the endpoint sampled for each episode, recorded as the engine produced it.

Every request may name an episode (a per-episode base URL /episodes/{id}/v1, or an X-Episode-Id header). Per call
the recorder keeps the prompt ids, each choice's sampled ids, their logprobs and the weights version that sampled
each token. An episode's calls form lines of conversation:

    line = [prompt ids of its first call] + sampled (mask 1) + continuation (mask 0) + sampled (mask 1) ...

When a chat call's messages extend a line's conversation (that line's messages, then the assistant reply exactly
as the endpoint returned it, then new messages), its prompt is that line's ids as recorded, followed by the chat
template's ids for the new messages (relayrl.envs.episode.ChatFormat.observation_ids: the rest of the assistant
turn's closing text, the new messages, the generation prompt): the sampled ids are reused, never re-encoded from
the text the client sent back (token in, token out). The continued line is extended in place with n=1; a call
with n > 1 forks it into n lines.

A chat call that extends no line starts a new line from the template's rendering. When its messages hold an assistant
turn (the client changed earlier text, or branched from a point no line ends at) in an episode that has lines
already, that assistant text is re-tokenized rather than taken as sampled: counted as `agent/retokenize_drift`, and
the episode is split (the new line is recorded apart), never silently mixed. A call that asks afresh (no assistant
turn: a re-sample, another conversation) is a new line and no drift.
Completions calls are recorded as lines of their own (or extend a line whose ids their token-id prompt starts with).

trajectory(episode) returns the episode's finished lines (those no later call continued): ids, the loss mask (1 on
sampled tokens only), the engine's logprobs (0.0 where the mask is 0), the versions (-1 where no policy sampled).

It imports the standard library only; the chat format is handed in.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

MAX_EPISODES = 100_000  # the oldest episodes are forgotten past this (a server left running for days)


@dataclass
class Line:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict] | None = None  # the normalized conversation so far, the last reply included (chat)
    tools_key: str = ""
    last_sampled: int | None = None
    leaf: bool = True

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def child(self) -> Line:
        return Line(list(self.prompt_ids), list(self.response_ids), list(self.mask), list(self.logprobs),
                    list(self.versions), self.messages, self.tools_key, self.last_sampled)

    def observe(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def sample(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.response_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions] if len(versions) == len(ids) else [-1] * len(ids)
        if ids:
            self.last_sampled = ids[-1]


@dataclass
class Call:
    """One request of an episode, as served."""

    endpoint: str  # "chat" or "completions"
    prompt_ids: list[int]
    samples: list[tuple[list[int], list[float], list[int]]]  # per choice: sampled ids, logprobs, versions
    weights_version: int
    extended: bool  # its prompt reused an earlier line's ids


@dataclass
class Plan:
    """How a call's prompt was built: the line it continues (or None) and the new ids appended to it."""

    prompt_ids: list[int]
    parent: Line | None
    observed: list[int]
    messages: list[dict] | None = None
    tools_key: str = ""
    drift: bool = False


@dataclass
class EpisodeLog:
    lines: list[Line] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: {"calls": 0, "retokenize_drift": 0})


def canonical_message(m: dict) -> dict:
    """What must match for a message to count as the same: role, text, tool calls (arguments as parsed JSON),
    the tool call a tool result answers."""
    out: dict[str, Any] = {"role": m.get("role"), "content": m.get("content") or ""}
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [(c["function"]["name"], _canonical_args(c["function"].get("arguments")))
                             for c in calls]
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    if m.get("name") is not None:
        out["name"] = m["name"]
    return out


def _canonical_args(args) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return json.dumps(args, sort_keys=True, ensure_ascii=False)


class Recorder:
    """Every episode's calls and lines, by episode id (thread-safe: handlers run on one event loop, tests read)."""

    def __init__(self):
        self._episodes: dict[str, EpisodeLog] = {}
        self._lock = threading.Lock()

    def _log(self, episode: str) -> EpisodeLog:
        if episode not in self._episodes:
            if len(self._episodes) >= MAX_EPISODES:
                self._episodes.pop(next(iter(self._episodes)))
            self._episodes[episode] = EpisodeLog()
        return self._episodes[episode]

    def plan_chat(self, episode: str, messages: list[dict], templated: list[dict], tools_key: str, fmt) -> Plan:
        """The prompt ids of a chat call with `messages` (compared through canonical_message) as `fmt` (a ChatFormat
        with the call's tools) renders them (`templated`: the same messages as the template takes them)."""
        canon = [canonical_message(m) for m in messages]
        with self._lock:
            log = self._log(episode)
            for line in reversed(log.lines):
                k = len(line.messages or [])
                if (line.messages is not None and line.tools_key == tools_key and len(canon) > k
                        and canon[:k] == line.messages):
                    try:
                        obs = fmt.observation_ids(templated[k:], line.last_sampled)
                    except Exception:  # a template that does not only append: rendered afresh below, counted
                        break
                    return Plan(line.ids + obs, line, obs, canon, tools_key)
            # assistant text re-tokenized from what the client sent: the tokens the model sampled are lost
            drift = bool(log.lines) and any(m["role"] == "assistant" for m in canon)
        return Plan(fmt.prompt_ids(templated), None, [], canon, tools_key, drift=drift)

    def plan_completion(self, episode: str, ids: list[int]) -> Plan:
        with self._lock:
            log = self._log(episode)
            for line in reversed(log.lines):
                if line.messages is None and len(ids) > len(line.ids) and ids[:len(line.ids)] == line.ids:
                    return Plan(ids, line, ids[len(line.ids):])
        return Plan(ids, None, [])

    def record(self, episode: str, endpoint: str, plan: Plan, out, replies: list[dict] | None = None) -> None:
        """Record the call `plan` built and the engine's output `out` (a RequestOutput); `replies`: per choice,
        the assistant message returned (chat), which a later call must send back to continue the line."""
        samples = [(list(s.token_ids), list(s.logprobs), list(s.versions)) for s in out.samples]
        with self._lock:
            log = self._log(episode)
            log.counters["calls"] += 1
            log.counters["retokenize_drift"] += int(plan.drift)
            log.calls.append(Call(endpoint, list(out.prompt_token_ids), samples, out.weights_version,
                                  plan.parent is not None))
            parent = plan.parent
            for j, (ids, lps, vers) in enumerate(samples):
                if parent is not None and len(samples) == 1:
                    line = parent  # continued in place
                else:
                    line = parent.child() if parent is not None else Line(list(out.prompt_token_ids))
                    log.lines.append(line)
                if parent is not None:
                    line.observe(plan.observed)
                line.sample(ids, lps, vers)
                if plan.messages is not None and replies is not None:
                    line.messages = plan.messages + [canonical_message(replies[j])]
                    line.tools_key = plan.tools_key
                else:
                    line.messages = None
            if parent is not None and len(samples) == 1:  # move it last: the most recent line is tried first
                log.lines.remove(parent)
                log.lines.append(parent)
            elif parent is not None:
                parent.leaf = False

    def counters(self, episode: str) -> dict[str, int]:
        with self._lock:
            log = self._episodes.get(episode)
            return dict(log.counters) if log else {"calls": 0, "retokenize_drift": 0}

    def calls(self, episode: str) -> list[Call]:
        with self._lock:
            log = self._episodes.get(episode)
            return list(log.calls) if log else []

    def trajectory(self, episode: str) -> list[dict]:
        """The episode's lines no later call continued, oldest first: prompt_ids, response_ids, mask (1 on
        sampled ids only), logprobs (the engine's; 0.0 where mask is 0), versions (-1 where mask is 0)."""
        with self._lock:
            log = self._episodes.get(episode)
            lines = [ln for ln in (log.lines if log else []) if ln.leaf]
            return [{"prompt_ids": list(ln.prompt_ids), "response_ids": list(ln.response_ids), "mask": list(ln.mask),
                     "logprobs": list(ln.logprobs), "versions": list(ln.versions)} for ln in lines]

    def pop(self, episode: str) -> list[dict]:
        """trajectory(episode), then forget the episode."""
        out = self.trajectory(episode)
        with self._lock:
            self._episodes.pop(episode, None)
        return out
