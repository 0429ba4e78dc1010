"""The OpenAI-compatible endpoint: a Starlette app over one engine (run by relayrl.serve.engine_loop).

    GET  /v1/models                      the one model served
    POST /v1/completions                 prompt (text or token ids; several prompts without stream)
    POST /v1/chat/completions            messages, tools / tool_choice ("auto", "none"), tool calls parsed back
    the same under /episodes/{id}/v1/... (or any of them with an X-Episode-Id header): the call is recorded for
    that episode (relayrl.serve.capture), and a chat call that continues the episode's conversation reuses the
    ids already sampled

Sampling: n, temperature, top_p, max_tokens / max_completion_tokens, stop, seed, logprobs / top_logprobs, stream
(server-sent events). A seed gives the tokens `LLMEngine.generate` gives for the same ids and SamplingParams.

Tool calls: the request's tools go to the model's chat template (the tiny tokenizers' template prints their
names); the reply is read with relayrl.envs.tool_calls (Hermes/Qwen <tool_call> blocks) into `tool_calls`, with
finish_reason "tool_calls"; generation stops after a closed tool call (relayrl.envs.episode.ChatFormat.turn_stops).
Assistant messages sent back with tool_calls are rendered by the template where it knows tool_calls, else as
Hermes blocks in their content.

During training (relayrl.serve.agents) the endpoint serves episodes only: the runner opens each episode with an
EpisodePolicy (the run's temperature / top_p / top_k, a seed per call, max_tokens capped at rollout.max_tokens, a
token budget per episode) that overrides what the client asks, so the policy samples as the run says whatever the
agent's code sets; a call to no open episode is a 404 body (an episode past its deadline is closed, its requests
aborted).

Closed by default and robust: a bearer token when one is set (required off loopback: check_bind); malformed JSON,
an unknown field, a prompt past the context, n or max_tokens past the limits, a bad message: an OpenAI-style 4xx
body {"error": {"message", "type", "param", "code"}}; anything unexpected a 500 body, never a dead server. A client
that disconnects has its request aborted, its KV blocks freed.

It imports starlette (lazily through relayrl.serve), the engine, envs (the chat format and tool-call parser) and
relayrl's ground floor.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from relayrl.config import parse_json
from relayrl.data.chat import max_token_chars
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.episode import ChatFormat
from relayrl.envs.tool_calls import CLOSE, OPEN, ToolCall, parse_in_order
from relayrl.errors import ConfigError, UserError
from relayrl.serve.capture import Recorder, canonical_message
from relayrl.serve.engine_loop import EngineLoop, Handle
from relayrl.serve.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    ValidationError,
    error_body,
    validation_message,
)

log = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant", "tool")


def check_bind(host: str, token: str | None) -> None:
    """A host off loopback needs a token: the endpoint runs a model for whoever reaches it."""
    if token:
        return
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ConfigError(f"--host {host} is reachable from other machines: give --token T (clients then send "
                      "'Authorization: Bearer T'), or bind 127.0.0.1")


class _Disconnected(Exception):
    pass


@dataclass
class EpisodePolicy:
    """What a training run imposes on an episode's calls (see the module's docstring)."""

    params: SamplingParams  # temperature, top_p, top_k, the max_tokens cap, extra stop strings
    seed_of: Callable[[int], int | None]  # the seed of the episode's k-th call
    max_total_tokens: int | None = None  # prompt + every reply of a call, at most (None: the model's context)
    calls: int = 0


class Endpoint:
    """The app (`.app`), the engine loop and the recorder of one served engine. start() before serving (or pump
    its loop from the caller's thread: `episodes_only`, a training run's private endpoint)."""

    def __init__(self, engine, model_name: str = "relayrl", *, token: str | None = None, max_n: int = 16,
                 max_body_bytes: int = 8 << 20, stop_token_ids: list[int] | None = None, episodes_only: bool = False):
        self.engine, self.model_name, self.token, self.max_n = engine, model_name, token, max_n
        self.max_body_bytes = max_body_bytes
        self.stop_token_ids = list(stop_token_ids or [])
        self.tokenizer = engine.tokenizer
        self.max_len = engine.config.max_position_embeddings
        # more characters than this cannot fit the context, known without tokenizing them (relayrl.data.chat)
        self.max_chars = self.max_len * max_token_chars(self.tokenizer) * 2
        self.loop = EngineLoop(engine)
        self.recorder = Recorder()
        self.episodes_only = episodes_only
        self.policies: dict[str, EpisodePolicy] = {}  # the open episodes (episodes_only)
        self._formats: dict[str, ChatFormat] = {}
        routes = []
        for prefix in ("", "/episodes/{episode}"):
            routes += [Route(prefix + "/v1/models", self._models, methods=["GET"]),
                       Route(prefix + "/v1/completions", self._completions, methods=["POST"]),
                       Route(prefix + "/v1/chat/completions", self._chat, methods=["POST"])]
        app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
        self.app = _Auth(app, token)

    def start(self) -> Endpoint:
        self.loop.start()
        return self

    def close(self) -> None:
        self.loop.close()

    def trajectory(self, episode: str) -> list[dict]:
        """The episode's recorded lines (relayrl.serve.capture.Recorder.trajectory)."""
        return self.recorder.trajectory(episode)

    def open_episode(self, episode: str, policy: EpisodePolicy) -> None:
        self.policies[episode] = policy

    def close_episode(self, episode: str) -> None:
        """No more calls of `episode` are served; those still running are aborted (their KV blocks freed)."""
        self.policies.pop(episode, None)
        self.loop.abort_episode(episode)

    def _recording(self, episode: str | None) -> bool:
        """Whether a call of `episode` that just ended is recorded: not one of a closed training episode."""
        return bool(episode) and (not self.episodes_only or episode in self.policies)

    def _policy(self, episode: str | None) -> EpisodePolicy | None:
        if not self.episodes_only:
            return None
        policy = self.policies.get(episode) if episode else None
        if policy is None:
            raise ApiError(404, f"episode {episode!r} is not running (it ended, passed its deadline, or was never "
                           "started): call the base_url your episode was given", code="episode_not_found")
        return policy

    # ---- handlers ----
    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                         "owned_by": "relayrl", "max_model_len": self.max_len}]})

    async def _completions(self, request: Request) -> Response:
        return await _answered(self._complete(request))

    async def _chat(self, request: Request) -> Response:
        return await _answered(self._chat_complete(request))

    async def _complete(self, request: Request) -> Response:
        req = await self._read(request, CompletionRequest)
        episode = _episode(request)
        policy = self._policy(episode)
        prompts = self._completion_prompts(req.prompt)
        if req.stream and len(prompts) > 1:
            raise ApiError(400, "stream takes one prompt per request", "prompt")
        params = [self._params(req, len(ids), req.max_tokens, req.logprobs or 0, [], "max_tokens", policy=policy)
                  for ids in prompts]
        plans = [self.recorder.plan_completion(episode, ids) if episode else None for ids in prompts]
        if req.stream:
            h = self.loop.submit(prompts[0], params[0], stream=True, episode=episode)
            return self._sse(self._completion_chunks(req, h, plans[0], episode), h)
        handles = [self.loop.submit(ids, p, episode=episode) for ids, p in zip(prompts, params, strict=True)]
        outs = await self._results(request, handles)
        if self._recording(episode):
            for plan, out in zip(plans, outs, strict=True):
                self.recorder.record(episode, "completions", plan, out)
        choices = []
        for i, out in enumerate(outs):
            for j, s in enumerate(out.samples):
                choices.append(self._completion_choice(i * req.n + j, s, req))
        return JSONResponse(self._envelope("text_completion", "cmpl", outs, choices, req))

    async def _chat_complete(self, request: Request) -> Response:
        req = await self._read(request, ChatRequest)
        episode = _episode(request)
        policy = self._policy(episode)
        if isinstance(req.tool_choice, dict):
            raise ApiError(400, "tool_choice naming a function is not supported (the engine does not constrain "
                           "decoding); use 'auto' or 'none'", "tool_choice")
        messages = _messages(req.messages)
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        with_tools = bool(req.tools) and req.tool_choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if with_tools else []
        tools_key = json.dumps(tools, sort_keys=True)
        fmt = self._format(tools_key, tools)
        templated = _for_template(messages, fmt)
        try:
            if episode:
                plan = self.recorder.plan_chat(episode, messages, templated, tools_key, fmt)
                ids = plan.prompt_ids
            else:
                plan, ids = None, fmt.prompt_ids(templated)
        except UserError as e:
            raise ApiError(400, _one_line(e), "messages") from None
        stop_strings, stop_ids = fmt.turn_stops(with_tools)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        which = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self._params(req, len(ids), max_tokens, top, stop_ids, which, stop_strings, policy)
        if req.stream:
            h = self.loop.submit(ids, params, stream=True, episode=episode)
            return self._sse(self._chat_chunks(req, h, with_tools, plan, episode), h)
        (out,) = await self._results(request, [self.loop.submit(ids, params, episode=episode)])
        choices = [self._chat_choice(j, s, req, with_tools) for j, s in enumerate(out.samples)]
        if self._recording(episode):
            self.recorder.record(episode, "chat", plan, out, [c["message"] for c in choices])
        return JSONResponse(self._envelope("chat.completion", "chatcmpl", [out], choices, req))

    # ---- request checks ----
    async def _read(self, request: Request, model):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise ApiError(413, f"the request body is {size} bytes, past the limit of {self.max_body_bytes}")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_body_bytes:
                raise ApiError(413, f"the request body is past the limit of {self.max_body_bytes} bytes")
        try:
            body = parse_json(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)}); send a JSON object"
                           ) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            msg, param = validation_message(e)
            raise ApiError(400, msg, param) from None
        if req.model != self.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this endpoint serves {self.model_name!r}",
                           "model", code="model_not_found")
        if req.n > self.max_n:
            raise ApiError(400, f"n={req.n} is past this endpoint's limit of {self.max_n}", "n")
        return req

    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
                ids = self.tokenizer(p, add_special_tokens=False)["input_ids"]
                bos = self.tokenizer.bos_token_id
                ids = ([bos] if bos is not None else []) + ids
            else:
                ids = list(p)
            if not ids or (isinstance(p, str) and not p):
                raise ApiError(400, "a prompt is empty: give some text (or token ids) to continue", "prompt")
            bad = [t for t in ids if not 0 <= t < self.engine.config.vocab_size]
            if bad:
                vocab = self.engine.config.vocab_size
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
            out.append(ids)
        return out

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"the {param} ({chars} characters) cannot fit the model's maximum context of "
                           f"{self.max_len} tokens; shorten it", param, code="context_length_exceeded")

    def _params(self, req, n_prompt: int, max_tokens: int | None, logprobs: int, stop_ids: list[int], which: str,
                stop_strings: list[str] | None = None, policy: EpisodePolicy | None = None) -> SamplingParams:
        if policy is not None:
            return self._episode_params(req, n_prompt, max_tokens, logprobs, stop_ids, stop_strings, policy)
        room = self.max_len - n_prompt
        if room < 1:
            raise ApiError(400, f"the prompt is {n_prompt} tokens, which leaves no room for a completion within "
                           f"the model's maximum context of {self.max_len} tokens; shorten it", "messages"
                           if isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise ApiError(400, f"{which}={max_tokens} with a prompt of {n_prompt} tokens is past the model's maximum "
                           f"context of {self.max_len} tokens; ask for at most {room}", which,
                           code="context_length_exceeded")
        try:
            return SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  max_tokens=max_tokens, stop=req.stops() + list(stop_strings or []),
                                  stop_token_ids=self.stop_token_ids + list(stop_ids), seed=req.seed,
                                  logprobs=logprobs, ignore_eos=req.ignore_eos)
        except UserError as e:
            raise ApiError(400, _one_line(e)) from None

    def _episode_params(self, req, n_prompt: int, max_tokens: int | None, logprobs: int, stop_ids: list[int],
                        stop_strings: list[str] | None, policy: EpisodePolicy) -> SamplingParams:
        """A training episode's call: the run's sampling and seed, max_tokens clipped to the run's cap and to what
        is left of the episode's budget (as relayrl's own agent loop clips a turn), never refused for asking more."""
        p = policy.params
        budget = min(self.max_len, policy.max_total_tokens or self.max_len)
        room = budget - n_prompt
        if room < 1:
            raise ApiError(400, f"the prompt is {n_prompt} tokens, which leaves no room for a completion within the "
                           f"episode's budget of {budget} tokens", "messages" if isinstance(req, ChatRequest)
                           else "prompt", code="context_length_exceeded")
        seed = policy.seed_of(policy.calls)
        policy.calls += 1
        try:
            return SamplingParams(n=req.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                  max_tokens=min(room, p.max_tokens, max_tokens or room),
                                  stop=list(p.stop) + req.stops() + list(stop_strings or []),
                                  stop_token_ids=self.stop_token_ids + list(p.stop_token_ids) + list(stop_ids),
                                  seed=seed, logprobs=logprobs, ignore_eos=req.ignore_eos)
        except UserError as e:
            raise ApiError(400, _one_line(e)) from None

    def _format(self, key: str, tools: list[dict]) -> ChatFormat:
        if key not in self._formats:
            try:
                self._formats[key] = ChatFormat(self.tokenizer, tools)
            except UserError as e:
                raise ApiError(400, _one_line(e), "messages") from None
        return self._formats[key]

    # ---- awaiting the engine ----
    async def _results(self, request: Request, handles: list[Handle]) -> list:
        """Each handle's RequestOutput; a client that disconnects first has its requests aborted."""
        waiter = asyncio.ensure_future(asyncio.gather(*(_final(h) for h in handles)))
        watcher = asyncio.ensure_future(_disconnect(request))
        try:
            done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the handler was cancelled (server shutdown)
            for h in handles:
                self.loop.abort(h)
            waiter.cancel()
            watcher.cancel()
            raise
        if waiter not in done:
            for h in handles:
                self.loop.abort(h)
            waiter.cancel()
            raise _Disconnected
        watcher.cancel()
        try:
            return waiter.result()
        except UserError as e:
            for h in handles:
                self.loop.abort(h)
            raise ApiError(400, _one_line(e)) from None
        except Exception as e:
            for h in handles:
                self.loop.abort(h)
            raise ApiError(500, f"the engine failed: {_one_line(e)}", type="server_error") from None

    def _sse(self, chunks, handle: Handle) -> Response:
        async def body():
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
                yield "data: [DONE]\n\n"
            except ApiError as e:  # after the 200 was sent: the error goes in the stream, as OpenAI's does
                yield f"data: {json.dumps(e.body())}\n\n"
            except UserError as e:
                yield f"data: {json.dumps(error_body(_one_line(e)))}\n\n"
            finally:  # the client went away (or the stream ended): a request still running is aborted
                self.loop.abort(handle)

        return StreamingResponse(body(), media_type="text/event-stream")

    # ---- responses ----
    def _envelope(self, obj: str, prefix: str, outs: list, choices: list[dict], req) -> dict:
        usage = _usage(outs)
        out: dict[str, Any] = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                               "model": self.model_name, "system_fingerprint": f"relayrl-v{outs[0].weights_version}",
                               "choices": choices, "usage": usage}
        if req.return_token_ids:
            out["prompt_token_ids"] = list(outs[0].prompt_token_ids) if len(outs) == 1 else [
                list(o.prompt_token_ids) for o in outs]
        return out

    def _piece(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def _completion_logprobs(self, ids, lps, tops, offset0: int = 0) -> dict:
        tokens = [self._piece(t) for t in ids]
        offsets, pos = [], offset0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [float(x) for x in lps],
                "top_logprobs": [{self._piece(k): v for k, v in d.items()} for d in tops] if tops else None,
                "text_offset": offsets}

    def _completion_choice(self, index: int, s, req) -> dict:
        choice = {"index": index, "text": s.text, "finish_reason": s.finish_reason,
                  "logprobs": (self._completion_logprobs(s.token_ids, s.logprobs, s.top_logprobs)
                               if req.logprobs is not None else None)}
        if req.return_token_ids:
            choice["token_ids"] = list(s.token_ids)
        return choice

    def _chat_logprobs(self, ids, lps, tops) -> list[dict]:
        out = []
        for i, (t, lp) in enumerate(zip(ids, lps, strict=True)):
            piece = self._piece(t)
            alts = tops[i] if i < len(tops) else {}
            out.append({"token": piece, "logprob": float(lp), "bytes": list(piece.encode()),
                        "top_logprobs": [{"token": self._piece(k), "logprob": float(v),
                                          "bytes": list(self._piece(k).encode())} for k, v in alts.items()]})
        return out

    def _chat_choice(self, index: int, s, req, with_tools: bool) -> dict:
        message, finish = reply_message(s.text, with_tools, s.finish_reason)
        choice = {"index": index, "message": message, "finish_reason": finish,
                  "logprobs": {"content": self._chat_logprobs(s.token_ids, s.logprobs, s.top_logprobs)}
                  if req.logprobs else None}
        if req.return_token_ids:
            choice["token_ids"] = list(s.token_ids)
        return choice

    async def _chat_chunks(self, req, h: Handle, with_tools: bool, plan, episode):
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        n = req.n
        sent_text = [""] * n
        sent_tokens = [0] * n
        ids_so_far: list[list[int]] = [[] for _ in range(n)]
        hold = max((len(x) for x in req.stops()), default=1) - 1
        for j in range(n):
            yield {**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                        "finish_reason": None}]}
        async for kind, payload in _events(h):
            if kind == "tokens":
                for j, (ids, lps, tops) in enumerate(payload):
                    if not ids:
                        continue
                    ids_so_far[j] += ids
                    text = self.tokenizer.decode(ids_so_far[j], skip_special_tokens=True)
                    visible = _visible(text, with_tools, hold)
                    delta = visible[len(sent_text[j]):] if visible.startswith(sent_text[j]) else ""
                    sent_text[j] += delta
                    lp = ({"content": self._chat_logprobs(ids, lps, tops)} if req.logprobs else None)
                    sent_tokens[j] += len(ids)
                    if delta or lp:
                        choice = {"index": j, "delta": {"content": delta}, "logprobs": lp, "finish_reason": None}
                        if req.return_token_ids:
                            choice["token_ids"] = list(ids)
                        yield {**base, "choices": [choice]}
            else:  # done
                out = payload
                replies = []
                for j, s in enumerate(out.samples):
                    message, finish = reply_message(s.text, with_tools, s.finish_reason)
                    replies.append(message)
                    final = message["content"] or ""
                    rest = final[len(sent_text[j]):] if final.startswith(sent_text[j]) else ""
                    k = sent_tokens[j]
                    delta: dict[str, Any] = {"content": rest}
                    if message.get("tool_calls"):
                        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
                    lp = ({"content": self._chat_logprobs(s.token_ids[k:], s.logprobs[k:], s.top_logprobs[k:])}
                          if req.logprobs else None)
                    choice = {"index": j, "delta": delta, "logprobs": lp, "finish_reason": finish}
                    if req.return_token_ids:
                        choice["token_ids"] = list(s.token_ids[k:])
                    yield {**base, "system_fingerprint": f"relayrl-v{out.weights_version}", "choices": [choice]}
                if self._recording(episode):
                    self.recorder.record(episode, "chat", plan, out, replies)
                if (req.stream_options or {}).get("include_usage"):
                    yield {**base, "choices": [], "usage": _usage([out])}
                return

    async def _completion_chunks(self, req, h: Handle, plan, episode):
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        n = req.n
        sent_text, sent_tokens = [""] * n, [0] * n
        ids_so_far: list[list[int]] = [[] for _ in range(n)]
        hold = max((len(x) for x in req.stops()), default=1) - 1
        async for kind, payload in _events(h):
            if kind == "tokens":
                for j, (ids, lps, tops) in enumerate(payload):
                    if not ids:
                        continue
                    ids_so_far[j] += ids
                    visible = _visible(self.tokenizer.decode(ids_so_far[j], skip_special_tokens=True), False, hold)
                    delta = visible[len(sent_text[j]):] if visible.startswith(sent_text[j]) else ""
                    lp = (self._completion_logprobs(ids, lps, tops, len(sent_text[j]))
                          if req.logprobs is not None else None)
                    sent_text[j] += delta
                    sent_tokens[j] += len(ids)
                    choice = {"index": j, "text": delta, "logprobs": lp, "finish_reason": None}
                    if req.return_token_ids:
                        choice["token_ids"] = list(ids)
                    yield {**base, "choices": [choice]}
            else:
                out = payload
                for j, s in enumerate(out.samples):
                    k = sent_tokens[j]
                    rest = s.text[len(sent_text[j]):] if s.text.startswith(sent_text[j]) else ""
                    lp = (self._completion_logprobs(s.token_ids[k:], s.logprobs[k:], s.top_logprobs[k:],
                                                    len(sent_text[j])) if req.logprobs is not None else None)
                    choice = {"index": j, "text": rest, "logprobs": lp, "finish_reason": s.finish_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = list(s.token_ids[k:])
                    yield {**base, "system_fingerprint": f"relayrl-v{out.weights_version}", "choices": [choice]}
                if self._recording(episode):
                    self.recorder.record(episode, "completions", plan, out)
                if (req.stream_options or {}).get("include_usage"):
                    yield {**base, "choices": [], "usage": _usage([out])}
                return


def _usage(outs: list) -> dict:
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_completion = sum(len(s.token_ids) for o in outs for s in o.samples)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def reply_message(text: str, with_tools: bool, finish: str | None) -> tuple[dict, str | None]:
    """The assistant message of a sampled text, and its finish_reason ("tool_calls" when it calls tools)."""
    if with_tools and OPEN in text:
        calls = [c for c in parse_in_order(text) if isinstance(c, ToolCall)]
        if calls:
            content = text[: text.find(OPEN)]
            return ({"role": "assistant", "content": content or None,
                     "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                    for c in calls]}, "tool_calls")
    return {"role": "assistant", "content": text}, finish


def _visible(text: str, with_tools: bool, hold: int) -> str:
    """What of a sample's text so far may be streamed: not a partial character, not what could still turn out to be
    the start of a stop string (cut from the final text), not a tool call (sent parsed at the end)."""
    if with_tools:
        at = text.find(OPEN)
        if at != -1:
            return text[:at]
        for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
            if OPEN.startswith(text[-k:]):
                text = text[:-k]
                break
    text = text.rstrip("\ufffd")
    return text[: len(text) - hold] if hold > 0 else text


async def _final(h: Handle):
    async for kind, payload in _events(h):
        if kind == "done":
            return payload
    raise RuntimeError("the engine loop ended the request without an output")


async def _events(h: Handle):
    while True:
        kind, payload = await h.events.get()
        if kind == "error":
            raise payload if isinstance(payload, UserError) else ApiError(500, f"the engine failed: {payload}",
                                                                          type="server_error")
        yield kind, payload
        if kind == "done":
            return


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone (the body has been read: what remains on the channel is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _episode(request: Request) -> str | None:
    return request.path_params.get("episode") or request.headers.get("x-episode-id") or None


def _text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", "messages")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", "messages")


def _messages(raw: list[dict]) -> list[dict]:
    """The request's messages, checked and normalized: role, content as text, tool calls as the template takes
    them (arguments parsed from their JSON string), tool_call_id / name where given."""
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        # what the openai client's message.model_dump() carries: accepted when empty
        unknown = {k for k in set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"}
                   if m[k] or k not in ("refusal", "annotations", "audio", "function_call")}
        if unknown:
            raise ApiError(400, f"{where}: unknown field {sorted(unknown)[0]!r}", "messages")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text(m.get("content"), where)}
        if m.get("tool_calls"):
            if role != "assistant":
                raise ApiError(400, f"{where}: only assistant messages carry tool_calls", "messages")
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, f"{where}: a tool call needs function.name", "messages")
                args = fn.get("arguments") or "{}"
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    raise ApiError(400, f"{where}: tool call arguments are not JSON", "messages") from None
                calls.append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _for_template(messages: list[dict], fmt: ChatFormat) -> list[dict]:
    """Messages as the chat template renders them: a template that does not know tool_calls gets them as Hermes
    blocks in the assistant's content (how the model wrote them)."""
    if "tool_calls" in (fmt.tokenizer.chat_template or ""):
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = "".join(f"{OPEN}\n{json.dumps(_call_obj(c))}"
                             f"\n{CLOSE}" for c in m["tool_calls"])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = m["content"] + blocks
        out.append(m)
    return out


def _call_obj(c: dict) -> dict:
    return {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


async def _answered(handling) -> Response:
    """A handler's response, or the OpenAI error body of what it raised: a 4xx for the client's mistakes, 499 for a
    client that went away, 500 for a bug of ours (logged; the server goes on)."""
    try:
        return await handling
    except ApiError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except _Disconnected:
        return Response(status_code=499)
    except Exception as e:
        log.exception("the endpoint failed on a request")
        return JSONResponse(error_body(f"internal error: {_one_line(e)}", "server_error"), status_code=500)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}"), status_code=exc.status_code)


class _Auth:
    """Pure ASGI: with a token, every request must carry 'Authorization: Bearer <token>' (compared in constant
    time), else 401 with an OpenAI error body."""

    def __init__(self, app, token: str | None):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if self.token and scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            got = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
                response = JSONResponse(error_body("a valid 'Authorization: Bearer <token>' header is required",
                                                   "authentication_error", code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


__all__ = ["Endpoint", "check_bind", "canonical_message", "reply_message"]
