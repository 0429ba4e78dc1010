"""Agents as functions: the user's program drives the model through an OpenAI client; relayrl records every token.

    rollout.agent: pkg.module:run          def run(example, client) -> reward   (or async def, with an AsyncOpenAI)

    driver / rollout-stream thread             agent threads (sync) / one asyncio thread     uvicorn thread
    submit(examples, params, tag) ──────────>  run(example=, client=) per episode ─── HTTP ──> Endpoint (episodes only)
    advance(): pump the engine loop <──────────────────────────────── commands: add, abort <──┘
               settle ended episodes: the recorder's tokens -> Trajectory

AgentRunner is an EpisodeRunner (relayrl.rollout.agent_loop): the sources, the rollout stream and evaluation drive it
exactly as they drive relayrl's own agent loop. Each episode gets its own base URL (/episodes/{id}/v1) on a private
endpoint bound to 127.0.0.1; the endpoint imposes the run's sampling on it (EpisodePolicy: temperature, top_p,
top_k, max_tokens capped at rollout.max_tokens, a seed per call derived from the sample's seed, a token budget) and
records what the engine sampled (relayrl.serve.capture). The engine is stepped only by advance(), on the caller's
thread, so a weight sync between two advances pauses serving for as long as it takes: the agents' requests wait in
the engine loop's queue and the tokens after it carry the new version.

At most rollout.agent_concurrency episodes run at once (the rest wait their turn); each has rollout.agent_timeout_s
from its start. An agent that raises, passes its deadline (its requests are aborted and its episode closed: later
calls get a 404 body), never calls the model, or returns something that is not a reward is dropped: it trains no
token (its trajectory has no sampled id), is counted (agent/dropped, and its reason), and the run goes on. When every
episode of a submission is dropped before any episode has ever worked, advance() raises: an agent that always fails
stops the run at its first step.

The episode's trajectory is its conversation line that the last call extended (capture.Recorder.trajectory): the
tokens the engine sampled (mask 1), the template's and the tools' tokens between them (mask 0). Other lines (a
client that edited earlier text: agent/retokenize_drift; a side conversation) are counted, never mixed in.

It imports the serve layer, the engine's sampling settings, envs (the trajectory type), rewards (loading user
functions) and the ground floor; the openai client is imported when a runner starts.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from relayrl.data import Example
from relayrl.engine.sampling_params import SamplingParams, turn_seed
from relayrl.envs.episode import Trajectory
from relayrl.envs.threads import DaemonPool
from relayrl.errors import ConfigError, EnvError
from relayrl.rewards.registry import load_user_object
from relayrl.rollout.agent_rewards import DROPPED
from relayrl.serve.app import Endpoint, EpisodePolicy
from relayrl.serve.server import ServerThread

POLL_S = 0.05  # the longest advance(block=True) waits for an agent's request when the engine has no work
ARGS = ("example", "client", "base_url", "model")  # what an agent function may declare
FINISHES = ("done", "max_turns", "max_total_tokens")  # how an agent may say its episode ended


def resolve_agent(ref: str, params: dict | None = None, tokenizer=None) -> Callable:
    """The agent function `ref` names (rollout.agent):

        pkg.module:function | path/file.py:function   the user's function, as is
        verifiers:ENV_ID                             a verifiers environment, by name (relayrl.serve.adapters)
        gym:pkg.module:Class                         a Gymnasium-style text environment
        env:NAME                                     one of relayrl's own environments, through the endpoint
    `params` (rollout.agent_params) go to the adapter; a plain function takes none."""
    params = dict(params or {})
    if not isinstance(ref, str) or not ref.strip():
        raise ConfigError(f"rollout.agent names a function as 'module:function', got {ref!r}")
    kind, _, rest = ref.partition(":")
    if kind == "verifiers":
        from relayrl.serve.adapters.verifiers_env import make_agent
        return make_agent(rest, params)
    if kind == "gym":
        from relayrl.serve.adapters.gym_env import make_agent
        return make_agent(rest, params)
    if kind == "env":
        from relayrl.serve.env_agent import make_agent
        return make_agent(rest, params, tokenizer)
    fn = load_user_object(ref, "agent", ConfigError)
    if params:
        raise ConfigError(f"rollout.agent_params go to an adapter (verifiers:, gym:, env:); the function '{ref}' "
                          "takes only its episode: bind your settings in its module")
    check_signature(fn, ref)
    return fn


def check_signature(fn: Callable, ref: str) -> list[str]:
    """The arguments of ARGS that `fn` declares; one that declares another (without a default) is refused."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ConfigError(f"rollout.agent '{ref}': cannot read the function's arguments") from None
    wanted, bad = [], []
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if name in ARGS:
            wanted.append(name)
        elif p.default is p.empty:
            bad.append(name)
    if bad:
        raise ConfigError(f"rollout.agent '{ref}': argument {bad[0]!r} is not one relayrl passes; an agent takes "
                          f"any of {', '.join(ARGS)} (by name)")
    return wanted


@dataclass
class _Episode:
    id: str
    tag: Hashable
    example: Example
    policy: EpisodePolicy
    future: Future | None = None
    started_at: float = 0.0
    trajectory: Trajectory | None = None


@dataclass
class _Submission:
    episodes: list[_Episode]
    left: int


@dataclass
class Outcome:
    """What an agent's return means: a reward (success optional), or an answer for the run's reward functions."""

    reward: float | None = None
    success: bool | None = None
    answer: str | None = None  # None with reward None: the last assistant message is the answer
    error: str | None = None
    counters: dict[str, float] | None = None  # the episode's own counts (tool_calls, ...), summed over a step
    finish: str = "done"  # or max_turns / max_total_tokens: the agent stopped it short (env/truncated)


def outcome(ret: Any) -> Outcome:
    """An agent function's return value, read (see relayrl.serve.agents' contract)."""
    if isinstance(ret, bool):
        return Outcome(error=f"the agent returned a bool ({ret}); return a number (the reward) or a dict")
    if isinstance(ret, numbers.Real):
        return _reward(ret, None)
    if isinstance(ret, dict):
        if "reward" not in ret:
            return Outcome(error=f"the agent returned a dict without 'reward' (keys: {sorted(ret)[:5]})")
        success = ret.get("success")
        if success is not None and not isinstance(success, bool):
            return Outcome(error=f"the agent's 'success' must be a bool, got {type(success).__name__}")
        unknown = set(ret) - {"reward", "success", "counters", "finish"}
        if unknown:
            return Outcome(error=f"the agent returned a dict with unknown key {sorted(unknown)[0]!r} (it may carry "
                                 "reward, success, counters, finish)")
        counters = ret.get("counters") or {}
        if not isinstance(counters, dict) or not all(
                isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
                and math.isfinite(float(v)) for k, v in counters.items()):
            return Outcome(error="the agent's 'counters' must map names to finite numbers")
        finish = ret.get("finish", "done")
        if finish not in FINISHES:
            return Outcome(error=f"the agent's 'finish' must be one of {', '.join(FINISHES)}, got {finish!r}")
        out = _reward(ret["reward"], success)
        out.counters, out.finish = {k: float(v) for k, v in counters.items()}, finish
        return out
    if isinstance(ret, str):
        return Outcome(answer=ret)
    if ret is None:
        return Outcome()
    return Outcome(error=f"the agent returned a {type(ret).__name__}; return a number (the reward), a dict "
                         "{'reward': ..., 'success': ...}, an answer string, or None")


def _reward(value: Any, success: bool | None) -> Outcome:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return Outcome(error=f"the agent's reward must be a finite number, got {value!r}")
    return Outcome(reward=float(value), success=success)


class AgentRunner:
    """Runs `fn`'s episodes on `engine` through a private endpoint; one instance per engine, reused across steps."""

    check_failures = True  # advance() raises when a whole submission was dropped and nothing ever worked

    def __init__(self, engine, fn: Callable, *, name: str = "agent", concurrency: int = 64, timeout_s: float = 300.0,
                 max_total_tokens: int | None = None, model_name: str = "relayrl"):
        try:
            import openai
        except ImportError:
            raise ConfigError("rollout.agent needs the openai client: pip install 'relayrl[serve]'") from None
        self._openai = openai
        self.engine, self.fn, self.name = engine, fn, name
        self.concurrency, self.timeout_s, self.max_total_tokens = concurrency, timeout_s, max_total_tokens
        self.wanted = check_signature(fn, name)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        self.endpoint = Endpoint(engine, model_name, episodes_only=True, max_n=64)
        self.server = ServerThread(self.endpoint).start(engine_thread=False)
        self.model = model_name
        import httpx

        self._ssl = httpx.create_ssl_context()  # one certificate store for every episode's client (_call_sync)
        # daemon threads: an agent that hangs past its deadline is abandoned and must not keep the process from exiting
        self._threads = None if self.is_async else DaemonPool(concurrency, name="rl-agent")
        self._aloop = asyncio.new_event_loop() if self.is_async else None
        if self._aloop is not None:
            threading.Thread(target=self._aloop.run_forever, name="rl-agent-async", daemon=True).start()
        self._subs: dict[Hashable, _Submission] = {}
        self._queued: deque[_Episode] = deque()
        self._running: dict[str, _Episode] = {}
        self._completed: list[Hashable] = []
        self._next = 0
        self._worked = False  # some episode was not dropped

    # ---- the EpisodeRunner protocol ----
    @property
    def busy(self) -> bool:
        return bool(self._subs)

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n finished episodes of examples[i] (contiguous, in order)."""
        if self.busy:
            raise RuntimeError("AgentRunner.run() while submissions are in flight: their results would be lost")
        tag = object()
        self.submit(examples, params, tag)
        try:
            done: list = []
            while not done:
                done = self.advance(block=True)
        except BaseException:
            self.abort_all()
            raise
        return done[0][1]

    def submit(self, examples: list[Example], params: list[SamplingParams], tag: Hashable) -> None:
        if tag in self._subs:
            raise ValueError(f"a submission tagged {tag!r} is already in flight")
        if len(examples) != len(params):
            raise ValueError(f"{len(examples)} examples with {len(params)} sampling params")
        episodes = []
        for ex, sp in zip(examples, params, strict=True):
            for j in range(sp.n):
                policy = EpisodePolicy(replace(sp, n=1), _seeds(sp.seed, j), self.max_total_tokens)
                episodes.append(_Episode(f"e{self._next}", tag, ex, policy))
                self._next += 1
        self._subs[tag] = _Submission(episodes, len(episodes))
        self._queued.extend(episodes)
        if not episodes:
            self._completed.append(tag)
        self._start_ready()

    def advance(self, block: bool = True) -> list[tuple[Hashable, list[Trajectory]]]:
        """The agents' requests so far and at most one engine step; then the episodes that ended are settled and
        waiting ones started. Returns the submissions whose last episode ended, as (tag, trajectories in order)."""
        self.endpoint.loop.pump(POLL_S if block else 0.0)
        self._settle()
        self._start_ready()
        done, self._completed = self._completed, []
        out = []
        for tag in done:
            sub = self._subs.pop(tag)
            trajs = [ep.trajectory for ep in sub.episodes]
            if self.check_failures and not self._worked and trajs and all(t.finish in DROPPED for t in trajs):
                raise EnvError(f"agent '{self.name}' failed on every episode of the step, e.g.: {trajs[0].error}")
            out.append((tag, trajs))
        return out

    def abort_all(self) -> None:
        """Every episode closed (its requests aborted) and every submission forgotten."""
        for ep in list(self._running.values()):
            self._close(ep)
        self._running.clear()
        self._queued.clear()
        self._subs, self._completed = {}, []

    def close(self) -> None:
        self.abort_all()
        self.server.close()
        if self._threads is not None:
            self._threads.close()
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._aloop.stop)

    # ---- episodes ----
    def _start_ready(self) -> None:
        while self._queued and len(self._running) < self.concurrency:
            ep = self._queued.popleft()
            self.endpoint.open_episode(ep.id, ep.policy)
            ep.started_at = time.monotonic()
            if self._aloop is not None:
                ep.future = asyncio.run_coroutine_threadsafe(self._call_async(ep), self._aloop)
            else:
                ep.future = self._threads.submit(self._call_sync, {"ep": ep}).future
            ep.future.add_done_callback(lambda _: self.endpoint.loop.wake())
            self._running[ep.id] = ep

    def _kwargs(self, ep: _Episode, client) -> dict:
        given = {"example": ep.example, "client": client, "base_url": self._url(ep), "model": self.model}
        return {k: given[k] for k in self.wanted}

    def _url(self, ep: _Episode) -> str:
        return self.server.episode_url(ep.id)

    # Each episode's client has a connection pool of its own (one agent's threads or tasks use it; httpcore's sync
    # pool shared by threads can close a connection it has just handed to another thread's request, encode/httpcore
    # #1110), built over the runner's one SSL context: a client left to build its own loads the certificate store,
    # 20-150 ms of CPU per episode, most of a 128-episode step's rollout on the calculator demo
    # (benchmarks/bench_agent_endpoint.py --fresh-clients).
    def _call_sync(self, ep: _Episode):
        client = self._openai.OpenAI(
            base_url=self._url(ep), api_key="relayrl", max_retries=0, timeout=self.timeout_s,
            http_client=self._openai.DefaultHttpxClient(verify=self._ssl)) if "client" in self.wanted else None
        try:
            return self.fn(**self._kwargs(ep, client))
        finally:
            if client is not None:
                client.close()

    async def _call_async(self, ep: _Episode):
        client = self._openai.AsyncOpenAI(
            base_url=self._url(ep), api_key="relayrl", max_retries=0, timeout=self.timeout_s,
            http_client=self._openai.DefaultAsyncHttpxClient(verify=self._ssl)) if "client" in self.wanted else None
        try:
            return await self.fn(**self._kwargs(ep, client))
        finally:
            if client is not None:
                await client.close()

    def _settle(self) -> None:
        now = time.monotonic()
        for ep in list(self._running.values()):
            if ep.future.done():
                try:
                    out = outcome(ep.future.result())
                except Exception as e:
                    out = Outcome(error=f"{type(e).__name__}: {_one_line(e)}")
                self._end(ep, out, "agent_error")
            elif now - ep.started_at > self.timeout_s:
                ep.future.cancel()  # an async agent is cancelled; a thread runs on, but its calls now get a 404
                self._end(ep, Outcome(error=f"the episode took longer than rollout.agent_timeout_s={self.timeout_s}"),
                          "agent_timeout")

    def _close(self, ep: _Episode) -> tuple[list[dict], dict]:
        self.endpoint.close_episode(ep.id)
        counters = self.endpoint.recorder.counters(ep.id)
        lines = self.endpoint.recorder.pop(ep.id)
        return lines, counters

    def _end(self, ep: _Episode, out: Outcome, failure: str) -> None:
        del self._running[ep.id]
        lines, counters = self._close(ep)
        calls = counters.get("calls", 0)
        stats = {"agent/calls": float(calls), "agent/retokenize_drift": float(counters.get("retokenize_drift", 0)),
                 "agent/lines_dropped": float(max(len(lines) - 1, 0))}
        if out.error is None and calls == 0:
            out, failure = Outcome(error="the agent never called the model"), "agent_no_calls"
        line = lines[-1] if lines else {"prompt_ids": [], "response_ids": [], "mask": [], "logprobs": [],
                                        "versions": []}
        if out.error is not None:  # dropped: its tokens are not trained on
            ep.trajectory = Trajectory(prompt_ids=line["prompt_ids"], response_ids=[], mask=[], logprobs=[],
                                       reward=0.0, success=False, turns=0, finish=failure, last_text="",
                                       counters=stats, error=out.error, versions=[])
        else:
            self._worked = True
            needs_score = out.reward is None
            reward = 0.0 if needs_score else out.reward
            success = out.success if out.success is not None else reward >= 1.0
            text = out.answer if out.answer is not None else self._last_reply(line)
            ep.trajectory = Trajectory(prompt_ids=line["prompt_ids"], response_ids=line["response_ids"],
                                       mask=line["mask"], logprobs=line["logprobs"], reward=reward,
                                       success=bool(success), turns=_turns(line["mask"]), finish=out.finish,
                                       last_text=text, counters={**(out.counters or {}), **stats},
                                       versions=line["versions"], needs_score=needs_score)
        sub = self._subs.get(ep.tag)
        if sub is not None:
            sub.left -= 1
            if sub.left == 0:
                self._completed.append(ep.tag)

    def _last_reply(self, line: dict) -> str:
        """The text of the line's last sampled run (the last assistant reply)."""
        mask, ids = line["mask"], line["response_ids"]
        end = len(mask)
        while end > 0 and mask[end - 1] == 0:
            end -= 1
        start = end
        while start > 0 and mask[start - 1] == 1:
            start -= 1
        return self.engine.tokenizer.decode(ids[start:end], skip_special_tokens=True)


def _seeds(seed: int | None, sample: int) -> Callable[[int], int | None]:
    return lambda call: turn_seed(seed, sample, call)


def _turns(mask: list[int]) -> int:
    """Sampled runs in a line: its assistant turns."""
    return sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


__all__ = ["DROPPED", "AgentRunner", "Outcome", "check_signature", "outcome", "resolve_agent"]
