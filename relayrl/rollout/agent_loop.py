"""The agent loop: episodes that alternate the engine's generation with environment steps, all at once.

    episode:  reset ──> generate ──> env.step ──> generate ──> env.step ... ──> done / max_turns / max_total_tokens
                 pool      engine       pool        engine        pool

One thread drives the engine step by step (continuous batching); environment resets and steps run in a
thread pool beside it. An episode whose turn ended leaves the engine (its request is finished, its KV
blocks return to the prefix cache) and comes back as a new request when its environment has answered:
a slow environment never stalls the batch, and an episode waiting on one holds no engine slot. Its next
request is the whole conversation so far, whose full KV blocks are still cached, so only the new tokens
(the observation and the generation prompt) are prefilled.

Token-in, token-out (relayrl.envs.episode): each turn appends the engine's ids as sampled and the ids of
the template's continuation; generated text is decoded for the environment to read, never re-encoded.

Sampling seeds derive from (the request's seed, the sample, the turn), so an episode draws the same
tokens whatever else runs beside it and however long its environment took.

The loop is incremental: submit() queues a group of episodes under a tag, each advance() runs at most one
engine step and returns the groups whose last episode ended, so an asynchronous driver can load new
weights between two steps and train on a group as soon as it is complete; run() is submit() then advance()
until its one group is back. Each generated token records the weights version that sampled it.

Like the rest of relayrl.rollout, it imports the engine, environments, rewards and data below it; never the
loop, the roles or the jobs.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from typing import Protocol

from relayrl.data import Example
from relayrl.engine.protocols import StepEngine
from relayrl.engine.sampling_params import SamplingParams, turn_seed
from relayrl.envs.base import as_step_result, make_env
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import ChatFormat, Episode, Trajectory
from relayrl.envs.threads import DaemonPool, Job
from relayrl.errors import EnvError
from relayrl.rollout.agent_rewards import agent_metrics

POLL_S = 0.05  # the longest the loop sleeps on environments while no engine work is left


class EpisodeRunner(Protocol):
    """What the driver uses to roll out episodes: an AgentLoop here, or one in the rollout worker."""

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n finished episodes of examples[i], contiguous and in order."""

    def close(self) -> None:
        """Stop the environment threads."""


class StreamingEpisodeRunner(EpisodeRunner, Protocol):
    """An EpisodeRunner driven one engine step at a time (asynchronous training): an AgentLoop."""

    busy: bool  # a submission not returned yet
    check_failures: bool  # advance() raises when a whole submission failed (a stream judges per step instead)

    def submit(self, examples: list[Example], params: list[SamplingParams], tag: Hashable) -> None:
        """Queue params[i].n episodes of examples[i], to be returned together under `tag`."""

    def advance(self, block: bool = True) -> list[tuple[Hashable, list[Trajectory]]]:
        """At most one engine step; the submissions that completed, as (tag, trajectories in order)."""

    def abort_all(self) -> None:
        """Abort this runner's engine requests and forget every submission."""


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """A step's figures over its episodes: reward and success, tool use, turns, how episodes ended, and
    time/env (seconds inside environment steps, summed over episodes: they overlap generation and each other)."""
    n = max(len(trajs), 1)

    def total(key: str) -> float:
        return float(sum(t.counters.get(key, 0.0) for t in trajs))

    def share(*finish: str) -> float:
        return sum(t.finish in finish for t in trajs) / n

    return {"reward/mean": sum(t.reward for t in trajs) / n, "reward/accuracy": sum(t.success for t in trajs) / n,
            "tools/calls": total("tool_calls"), "tools/errors": total("tool_errors"),
            "tools/timeouts": total("tool_timeouts"), "turns/mean": sum(t.turns for t in trajs) / n,
            "time/env": total("env_s"), "env/errors": share("env_error"), "env/timeouts": share("env_timeout"),
            "env/truncated": share("max_turns", "max_total_tokens"), **agent_metrics(trajs)}


@dataclass
class _Submission:
    episodes: list[Episode]  # in submission order
    left: int  # episodes not ended yet


class AgentLoop:
    """Runs episodes of `cfg`'s environment on `engine`; one instance per engine, reused across steps.

    Two ways to drive it: run() (a batch of episodes to completion), or submit() / advance() for a caller
    that does other work between engine steps (asynchronous training: it loads new weights between two
    advance() calls, and trains on each submission as soon as all of its episodes have ended)."""

    def __init__(self, engine: StepEngine, cfg: EnvConfig):
        self.engine, self.cfg = engine, cfg
        self.tokenizer = engine.tokenizer
        # daemon threads: a step that hangs is abandoned after step_timeout_s and must not block exit
        self.pool = DaemonPool(cfg.workers, name="rl-env")
        self._formats: dict[tuple, ChatFormat] = {}
        self._abandoned: set[Future] = set()  # timed-out steps whose threads still run
        self._orphans: dict[Future, Job] = {}  # calls running when abort_all() forgot them
        self._subs: dict[Hashable, _Submission] = {}
        self._tags: dict[int, Hashable] = {}  # episode index -> its submission's tag
        self._plans: dict[int, tuple[SamplingParams, int, list[str], list[int]]] = {}
        self._pending: dict[Future, tuple[Episode, Job]] = {}  # environment calls
        self._inflight: dict[int, Episode] = {}  # engine request id -> its episode
        self._completed: list[Hashable] = []  # submissions whose last episode ended, in that order
        self._next_index = 0
        self._env_worked = False  # some episode ended other than by an environment error
        # advance() raises when a whole submission failed before any episode worked; a caller that judges
        # failures over a step of several submissions (the async rollout stream) turns it off
        self.check_failures = True

    def close(self) -> None:
        self.pool.close()

    def _format(self, env) -> ChatFormat:
        schemas = [t.schema() for t in env.tools]
        key = tuple(repr(s) for s in schemas)
        if key not in self._formats:
            self._formats[key] = ChatFormat(self.tokenizer, schemas)
        return self._formats[key]

    @property
    def busy(self) -> bool:
        """Whether a submission has not been returned by advance() yet."""
        return bool(self._subs)

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n episodes of examples[i] (contiguous, in order); each a finished Trajectory."""
        if self.busy:
            raise RuntimeError("AgentLoop.run() while submissions are in flight: their results would be lost")
        tag = object()
        self.submit(examples, params, tag)
        try:
            done: list[tuple[Hashable, list[Episode]]] = []
            while not done:
                done = self._advance(block=True)
        except BaseException:
            self.abort_all()
            raise
        episodes = done[0][1]
        failed = [ep for ep in episodes if ep.finish == "env_error"]
        if failed and len(failed) == len(episodes):
            raise self._failed_everywhere(failed)
        return [ep.trajectory() for ep in episodes]

    def submit(self, examples: list[Example], params: list[SamplingParams], tag: Hashable) -> None:
        """Queue params[i].n episodes of examples[i]; advance() returns them together, under `tag`."""
        if tag in self._subs:
            raise ValueError(f"a submission tagged {tag!r} is already in flight")
        if len(examples) != len(params):
            raise ValueError(f"{len(examples)} examples with {len(params)} sampling params")
        # every environment is built before anything is queued: one that cannot be leaves no state behind
        episodes, starts = [], []
        for ex, sp in zip(examples, params, strict=True):
            for j in range(sp.n):
                env = make_env(self.cfg)
                fmt = self._format(env)
                episodes.append(Episode(index=self._next_index + len(episodes), env=env, fmt=fmt,
                                        max_total_tokens=self.cfg.max_total_tokens))
                starts.append((ex, (sp, j, *fmt.turn_stops(bool(env.tools)))))
        self._next_index += len(episodes)
        self._subs[tag] = _Submission(episodes, len(episodes))
        if not episodes:
            self._completed.append(tag)
        for ep, (ex, plan) in zip(episodes, starts, strict=True):
            self._tags[ep.index], self._plans[ep.index] = tag, plan
            self._call(ep, ep.env.reset, ex)

    def advance(self, block: bool = True) -> list[tuple[Hashable, list[Trajectory]]]:
        """One turn of the loop: settle the environment calls that finished, start the turns they allow,
        run at most one engine step. Returns the submissions whose last episode ended meanwhile, as
        (tag, trajectories in submission order). With no request of this loop in the engine, it waits up to
        POLL_S for an environment call (if `block`). Raises EnvError when every episode of a submission
        failed in its environment and no episode so far has done better: an environment that always fails
        stops the run at its first submission, one bad submission among good ones does not."""
        done = self._advance(block)
        if self.check_failures and not self._env_worked:
            for _, episodes in done:
                if episodes:  # here every ended episode failed, so every one of these did
                    raise self._failed_everywhere(episodes)
        return [(tag, [ep.trajectory() for ep in episodes]) for tag, episodes in done]

    def _failed_everywhere(self, failed: list[Episode]) -> EnvError:
        return EnvError(f"environment '{self.cfg.name}' failed on every episode of the step, e.g.: {failed[0].error}")

    def abort_all(self) -> None:
        """Abort this loop's engine requests and forget every submission (at shutdown, or after a failure).
        Environment calls still queued are cancelled; one already running finishes on its thread, unread."""
        inflight, self._inflight = list(self._inflight), {}
        for fut, (_, job) in self._pending.items():
            if not fut.cancel() and not fut.done():
                self._orphans[fut] = job
        self._pending, self._subs, self._tags, self._plans, self._completed = {}, {}, {}, {}, []
        self.engine.abort(inflight)

    def _advance(self, block: bool) -> list[tuple[Hashable, list[Episode]]]:
        for ep in self._settle(block=block and not self._inflight):
            self._generate(ep)
        if self._inflight:
            if not self.engine.has_unfinished():
                raise RuntimeError(f"the engine holds none of the agent loop's {len(self._inflight)} requests: "
                                   "their outputs were taken by another caller of step()")
            for out in self.engine.step():
                ep = self._inflight.pop(out.request_id, None)
                if ep is None:  # a request this loop did not add (an evaluation's, say): its caller's
                    continue
                s = out.samples[0]
                # LLMEngine records each token's version (new weights may land mid-turn); a backend that
                # does not say gives the whole turn the version its output came out under
                versions = getattr(s, "versions", None) or [out.weights_version] * len(s.token_ids)
                text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                message = ep.add_generated(s.token_ids, s.logprobs, text, list(versions))
                self._call(ep, ep.env.step, message)
        done, self._completed = self._completed, []
        finished = []
        for tag in done:
            sub = self._subs.pop(tag)
            for ep in sub.episodes:
                del self._tags[ep.index], self._plans[ep.index]
            finished.append((tag, sub.episodes))
        return finished

    def _ended(self, ep: Episode) -> None:
        """Count an episode that just ended towards its submission's completion."""
        self._env_worked |= ep.finish != "env_error"
        sub = self._subs[self._tags[ep.index]]
        sub.left -= 1
        if sub.left == 0:
            self._completed.append(self._tags[ep.index])

    def _generate(self, ep: Episode) -> None:
        """Queue the episode's next turn, or end it if no token is left for one."""
        sp, j, stop, stop_ids = self._plans[ep.index]
        room = self.cfg.max_total_tokens - len(ep.ids)
        if room < 1:
            ep.end("max_total_tokens")
            self._ended(ep)
            return
        turn = replace(sp, n=1, max_tokens=min(sp.max_tokens, room), seed=turn_seed(sp.seed, j, ep.turns),
                       stop=list(sp.stop) + stop, stop_token_ids=list(sp.stop_token_ids) + stop_ids)
        self._inflight[self.engine.add_request(ep.ids, turn)] = ep

    def _call(self, ep: Episode, fn, arg) -> None:
        job = self.pool.submit(_timed, {"fn": fn, "arg": arg})
        self._pending[job.future] = (ep, job)

    def _settle(self, block: bool) -> list[Episode]:
        """Handle every environment call that finished (waiting for one if `block`); returns the episodes
        ready for their next turn. A call running longer than step_timeout_s (from when it started: waiting
        for a thread does not count) ends its episode."""
        pending = self._pending
        if not pending:
            return []
        if block:
            wait(list(pending), timeout=POLL_S, return_when=FIRST_COMPLETED)
        ready, now, limit = [], time.monotonic(), self.cfg.step_timeout_s
        self._abandoned = {f for f in self._abandoned if not f.done()}
        self._orphans = {f: job for f, job in self._orphans.items() if not f.done()}
        late = [f for f, (_, job) in pending.items()
                if not f.done() and job.started.is_set() and now - job.started_at > limit]
        # threads held by a hung step: abandoned ones, and forgotten ones (abort_all) past the deadline
        held = len(self._abandoned) + sum(now - job.started_at > limit for job in self._orphans.values())
        stuck = held + len(late) >= self.pool.size  # every thread holds a hung step
        if stuck:  # so calls still queued would never start: they end too
            late += [f for f, (_, job) in pending.items() if not job.started.is_set() and f not in late]
        for fut in [f for f in pending if f.done()] + late:
            ep, job = pending.pop(fut)
            if not fut.done():  # abandoned: a Python thread cannot be killed, its result is ignored
                if job.started.is_set():
                    self._abandoned.add(fut)
                    ep.counters["env_s"] = ep.counters.get("env_s", 0.0) + (now - job.started_at)
                    why = f"environment step took longer than env.step_timeout_s={self.cfg.step_timeout_s}"
                else:
                    fut.cancel()
                    why = f"every environment thread ({self.pool.size}) is held by a step that timed out"
                ep.end("env_timeout", why)
                self._ended(ep)
                continue
            try:
                out, seconds = fut.result()
            except Exception as e:
                ep.end("env_error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                self._ended(ep)
                continue
            ep.counters["env_s"] = ep.counters.get("env_s", 0.0) + seconds
            try:
                goes_on = self._apply(ep, out)
            except EnvError as e:  # a reset of the wrong type, a template that raises on the messages: one episode
                ep.end("env_error", str(e))
                goes_on = False
            if goes_on and not ep.done:
                ready.append(ep)
            else:
                self._ended(ep)
        return ready

    def _apply(self, ep: Episode, out) -> bool:
        """Apply a reset's or a step's result; True if the episode goes on to another turn."""
        if not ep.messages:  # the reset's messages
            ep.start(out)
            return True
        try:
            obs, reward, done, info = as_step_result(out, self.cfg.name)
        except EnvError as e:  # a step that returned no usable result (a NaN reward, say) fails as one that raised
            ep.end("env_error", str(e))
            return False
        ep.reward += reward
        ep.count(info)
        if "success" in info:
            ep.success = bool(info["success"])
        if done:
            ep.end("done")
        elif ep.turns >= self.cfg.max_turns:
            ep.end("max_turns")
        elif not ep.observe(obs or [], self.cfg.max_total_tokens):
            ep.end("max_total_tokens")
        return not ep.done


def _timed(fn, arg):
    t0 = time.perf_counter()
    out = fn(arg)
    return out, time.perf_counter() - t0
