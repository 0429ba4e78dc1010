"""An episode's tokens, built so that the trained ids are exactly the sampled ones (token-in, token-out).

    prompt_ids   the chat template's rendering of the first messages (+ tools), with the generation prompt
    then per turn:
      generated  the ids the engine sampled, as they came (mask 1, with the engine's logprobs)
      observed   the ids of the template's continuation after that turn (mask 0): the rest of the
                 assistant turn's closing text, then the new messages, then the next generation prompt

Generated text is decoded only to be read (by the environment, the tool-call parser); it is never
encoded again, so a tokenizer for which decode-then-encode changes ids cannot change what is trained.

The continuation is the template's delta, computed on a fixed probe conversation so it depends on the
template alone:

    base  = render([user "U", assistant "A"])                   "...user: U\nassistant: A<eos>\n"
    delta = render(base messages + new, generation prompt)[len(base):]   "tool: ...\nassistant: "
    close = what base puts after "A"                             "<eos>\n"    (Qwen: "<|im_end|>\n")

A turn that ended with the end-of-turn token already holds the start of `close` ("<eos>"): only the rest
("\n") is observed. A turn that ended otherwise (at a closed tool call, or out of tokens) observes all
of it, so the sequence reads as the template would render it.

Bounded before it is sized: messages (a reset's, an observation) are measured in characters before any
tokenizer sees them. No token stands for more characters than the longest entry of the vocabulary (K), so
messages of more than room x K x 2 characters (2: slack for a normaliser that composes characters) cannot fit
the tokens left within env.max_total_tokens: the episode ends there (max_total_tokens), as it would have after
tokenizing them (a 10 MB observation took minutes to tokenize, outside env.step_timeout_s). A reset that does not
return a non-empty list of {role, content} messages, and a chat template that raises on the messages, are
EnvErrors: that episode fails (env_error), counted, and the run goes on.

It imports the standard library, relayrl.data.chat and relayrl.errors only (the tokenizer is duck-typed); like all
of envs, it
must never import the engine, the trainer, sync or the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relayrl.data.chat import max_token_chars
from relayrl.errors import EnvError

TOOL_CLOSE = "</tool_call>"
PROBE = "\u2063A\u2063"  # invisible separators: no real message contains it, so its position is unambiguous


class ChatFormat:
    """How one tokenizer's chat template starts a conversation and continues it after a turn."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise EnvError("multi-turn environments need a tokenizer with a chat template; this model's has none "
                           "(add a chat_template to its tokenizer_config.json)")
        self.tokenizer, self.tools = tokenizer, tools or None
        self._base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": PROBE}]
        base_text = self.render(self._base)
        self._base_text = base_text
        self.close_text = base_text[base_text.index(PROBE) + len(PROBE):]
        self.eos_id = tokenizer.eos_token_id
        self.turn_end_ids = self._turn_end_ids()
        self.token_chars = max_token_chars(tokenizer)  # K: the most characters one token stands for
        self._tool_close: list[int] | None = None

    def max_chars(self, tokens: int) -> int:
        """More characters of messages than this cannot fit in `tokens` tokens (module docstring)."""
        return max(tokens, 0) * self.token_chars * 2

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja2's TemplateError (raise_exception in the template), a TypeError, ...
            said = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise EnvError(f"the chat template raised {type(e).__name__}{': ' + said if said else ''} while "
                           f"rendering {len(messages)} message(s) (roles: "
                           f"{', '.join(str(m.get('role')) for m in messages[:8])})") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _turn_end_ids(self) -> list[int]:
        """The token(s) that end an assistant turn: the first token of the closing text when it is one
        whole token (Qwen's <|im_end|>, the tiny template's <eos>; it comes first), and EOS."""
        first = self.encode(self.close_text)[:1]
        said = self.tokenizer.decode(first) if first else ""
        ids = list(first) if said.strip() and self.close_text.startswith(said) and len(said) > 1 else []
        if self.eos_id is not None and self.eos_id not in ids:
            ids.append(self.eos_id)
        return ids

    def turn_stops(self, with_tools: bool) -> tuple[list[str], list[int]]:
        """(stop strings, stop ids) that end a turn: the end-of-turn token, or (with tools) right after a
        closed tool call: a stop token when the tag is one token (Qwen, the tiny tokenizer), else a string."""
        if not with_tools:
            return [], list(self.turn_end_ids)
        if self._tool_close is None:  # encoded once per format: the endpoint asks on every call
            self._tool_close = self.encode(TOOL_CLOSE)
        close = list(self._tool_close)
        if len(close) == 1:
            return [], list(self.turn_end_ids) + close
        return [TOOL_CLOSE], list(self.turn_end_ids)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages, generation_prompt=True))

    def observation_ids(self, messages: list[dict], last_generated: int | None) -> list[int]:
        """The ids that follow a turn whose last sampled id is `last_generated`: the rest of its closing
        text, then `messages` and the next generation prompt (all from the template)."""
        full = self.render(self._base + list(messages), generation_prompt=True)
        if not full.startswith(self._base_text):
            raise EnvError("the chat template renders earlier messages differently once more follow, so a turn's "
                           "continuation cannot be computed as a delta; use a template that only appends")
        return self.encode(self._rest_of_close(last_generated) + full[len(self._base_text):])

    def _rest_of_close(self, last_generated: int | None) -> str:
        if last_generated is not None and last_generated in self.turn_end_ids:
            said = self.tokenizer.decode([last_generated])
            if self.close_text.startswith(said):
                return self.close_text[len(said):]
        return self.close_text


@dataclass
class Trajectory:
    """One finished episode, as plain data (it crosses process boundaries)."""

    prompt_ids: list[int]
    response_ids: list[int]  # every id after the prompt: generated and observed, in order
    mask: list[int]  # 1 where the model sampled the id (the only ids trained on)
    logprobs: list[float]  # the engine's logprob where mask is 1, 0.0 elsewhere
    reward: float
    success: bool
    turns: int
    finish: str  # done | max_turns | max_total_tokens | env_error | env_timeout
    last_text: str  # the last assistant message (what an evaluator reads)
    counters: dict[str, float] = field(default_factory=dict)  # tool_calls, tool_errors, tool_timeouts, env_s
    error: str | None = None
    # per response id, the weights version that sampled it; -1 where no policy did (observed ids, and
    # the assistant turns of a written demonstration). Asynchronous training reads its staleness here:
    # with generation interrupted for new weights, one turn's tokens may come from several versions.
    versions: list[int] = field(default_factory=list)
    # an agent function's episode that returned an answer (last_text) for the run's reward functions to score
    needs_score: bool = False

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)


@dataclass
class Episode:
    """An episode in progress: its environment, messages and ids so far."""

    index: int
    env: Any
    fmt: ChatFormat
    messages: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    success: bool | None = None
    turns: int = 0
    finish: str | None = None
    last_text: str = ""
    counters: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    max_total_tokens: int | None = None  # env.max_total_tokens: a reset's messages past it end the episode

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def done(self) -> bool:
        return self.finish is not None

    def start(self, messages: list[dict]) -> None:
        """Begin with a reset's messages; EnvError when they are not a non-empty list of {role, content} strings.
        Messages too long for max_total_tokens (in characters, before tokenizing) end the episode."""
        if not isinstance(messages, list) or not messages:
            raise EnvError(f"reset() must return a non-empty list of messages, got {_kind(messages)}")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise EnvError(f"reset() message {j} must be an object with a string 'role' and 'content', got "
                               f"{_kind(m)}")
        self.messages = list(messages)
        if self.max_total_tokens is not None and _chars(messages) > self.fmt.max_chars(self.max_total_tokens):
            self.end("max_total_tokens")
            return
        self.prompt_ids = self.fmt.prompt_ids(self.messages)

    def add_generated(self, ids: list[int], logprobs: list[float], text: str,
                      versions: list[int] | None = None) -> dict:
        """Record a sampled turn (`versions`: the weights version that sampled each id; None: no policy
        did, as in a written demonstration); returns the assistant message the environment reads."""
        if versions is not None and len(versions) != len(ids):
            raise ValueError(f"a turn of {len(ids)} ids came with {len(versions)} weights versions")
        self.response_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions] if versions is not None else [-1] * len(ids)
        self.turns += 1
        self.last_text = text
        message = {"role": "assistant", "content": text}
        self.messages.append(message)
        return message

    def observe(self, messages: list[dict], max_total_tokens: int) -> bool:
        """Append the observation's ids, unless the episode would then have no room for a generated
        token within `max_total_tokens` (then nothing is appended and it returns False). Messages that
        cannot fit by their length in characters are refused before they are tokenized."""
        if _chars(messages) > self.fmt.max_chars(max_total_tokens - len(self.prompt_ids) - len(self.response_ids)):
            return False
        ids = self.fmt.observation_ids(messages, self.response_ids[-1] if self.response_ids else None)
        if len(self.prompt_ids) + len(self.response_ids) + len(ids) >= max_total_tokens:
            return False
        self.messages += messages
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        return True

    def count(self, info: dict) -> None:
        for key in ("tool_calls", "tool_errors", "tool_timeouts"):
            if key in info:
                self.counters[key] = self.counters.get(key, 0.0) + float(info[key])

    def end(self, finish: str, error: str | None = None) -> None:
        self.finish, self.error = finish, error

    def trajectory(self) -> Trajectory:
        success = self.success if self.success is not None else self.reward >= 1.0
        return Trajectory(prompt_ids=self.prompt_ids, response_ids=self.response_ids, mask=self.mask,
                          logprobs=self.logprobs, reward=self.reward, success=bool(success), turns=self.turns,
                          finish=self.finish or "done", last_text=self.last_text, counters=dict(self.counters),
                          error=self.error, versions=self.versions)


def _chars(messages: list[dict]) -> int:
    """The characters of the messages' contents (what their rendering holds besides the template's own text)."""
    return sum(len(m["content"]) if isinstance(m.get("content"), str) else len(str(m.get("content") or ""))
               for m in messages)


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else f"a {type(value).__name__}"


def encode_conversation(fmt: ChatFormat, messages: list[dict], stop_ids: list[int] = ()) -> Trajectory:
    """A written conversation (e.g. a demonstration for SFT) as the ids an episode would hold: each
    assistant message is encoded as if generated (mask 1), ending with the end-of-turn token unless its
    last token already ends a turn (a closed tool call in `stop_ids`); everything else is observed
    through the template (mask 0). Training on it teaches exactly the turns the agent loop samples."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise EnvError("a conversation to train on (a demonstration) needs messages before its first assistant message")
    ep = Episode(index=0, env=None, fmt=fmt)
    ep.start(messages[:first])
    pending: list[dict] = []
    for m in messages[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if ep.turns:  # what follows a turn, even with no message between (the next generation prompt)
            ep.observe(pending, max_total_tokens=1 << 30)
            pending = []
        ids = fmt.encode(m["content"])
        if not ids or ids[-1] not in stop_ids:
            ids = ids + fmt.turn_end_ids[:1]
        ep.add_generated(ids, [0.0] * len(ids), m["content"])
    return ep.trajectory()
