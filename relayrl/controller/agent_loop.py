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

Like the rest of the controller, this module may import any layer below the CLI; it must never import
relayrl.cli.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from typing import Protocol

from relayrl.data import Example
from relayrl.engine.protocols import StepEngine
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.base import as_step_result, make_env
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import ChatFormat, Episode, Trajectory
from relayrl.envs.threads import DaemonPool, Job
from relayrl.errors import EnvError

POLL_S = 0.05  # the longest the loop sleeps on environments while no engine work is left


def turn_seed(seed: int | None, sample: int, turn: int) -> int | None:
    if seed is None:
        return None
    return ((seed * 1_000_003 + sample) * 10_007 + turn) % (1 << 62)


class EpisodeRunner(Protocol):
    """What the driver uses to roll out episodes: an AgentLoop here, or one in the rollout worker."""

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n finished episodes of examples[i], contiguous and in order."""

    def close(self) -> None:
        """Stop the environment threads."""


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
            "env/truncated": share("max_turns", "max_total_tokens")}


class AgentLoop:
    """Runs episodes of `cfg`'s environment on `engine`; one instance per engine, reused across steps."""

    def __init__(self, engine: StepEngine, cfg: EnvConfig):
        self.engine, self.cfg = engine, cfg
        self.tokenizer = engine.tokenizer
        # daemon threads: a step that hangs is abandoned after step_timeout_s and must not block exit
        self.pool = DaemonPool(cfg.workers, name="rl-env")
        self._formats: dict[tuple, ChatFormat] = {}
        self._abandoned: set[Future] = set()  # timed-out steps whose threads still run

    def close(self) -> None:
        self.pool.close()

    def _format(self, env) -> ChatFormat:
        schemas = [t.schema() for t in env.tools]
        key = tuple(repr(s) for s in schemas)
        if key not in self._formats:
            self._formats[key] = ChatFormat(self.tokenizer, schemas)
        return self._formats[key]

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n episodes of examples[i] (contiguous, in order); each a finished Trajectory."""
        cfg = self.cfg
        episodes: list[Episode] = []
        plan: dict[int, tuple[SamplingParams, int, list[str], list[int]]] = {}
        pending: dict[Future, tuple[Episode, Job]] = {}
        for ex, sp in zip(examples, params, strict=True):
            for j in range(sp.n):
                env = make_env(cfg)
                fmt = self._format(env)
                ep = Episode(index=len(episodes), env=env, fmt=fmt)
                episodes.append(ep)
                plan[ep.index] = (sp, j, *fmt.turn_stops(bool(env.tools)))
                self._submit(pending, ep, env.reset, ex)
        inflight: dict[int, Episode] = {}
        try:
            while pending or inflight:
                busy = self.engine.has_unfinished()
                for ep in self._settle(pending, block=not busy):
                    self._generate(ep, plan[ep.index], inflight)
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        ep = inflight.pop(out.request_id)
                        s = out.samples[0]
                        text = self.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                        message = ep.add_generated(s.token_ids, s.logprobs, text)
                        self._submit(pending, ep, ep.env.step, message)
        except BaseException:
            self.engine.abort(list(inflight))
            raise
        failed = [ep for ep in episodes if ep.finish == "env_error"]
        if failed and len(failed) == len(episodes):
            raise EnvError(f"environment '{cfg.name}' failed on every episode of the step, e.g.: {failed[0].error}")
        return [ep.trajectory() for ep in episodes]

    def _generate(self, ep: Episode, plan, inflight: dict) -> None:
        """Queue the episode's next turn, or end it if no token is left for one."""
        sp, j, stop, stop_ids = plan
        room = self.cfg.max_total_tokens - len(ep.ids)
        if room < 1:
            ep.end("max_total_tokens")
            return
        turn = replace(sp, n=1, max_tokens=min(sp.max_tokens, room), seed=turn_seed(sp.seed, j, ep.turns),
                       stop=list(sp.stop) + stop, stop_token_ids=list(sp.stop_token_ids) + stop_ids)
        inflight[self.engine.add_request(ep.ids, turn)] = ep

    def _submit(self, pending: dict, ep: Episode, fn, arg) -> None:
        job = self.pool.submit(_timed, {"fn": fn, "arg": arg})
        pending[job.future] = (ep, job)

    def _settle(self, pending: dict[Future, tuple[Episode, Job]], block: bool) -> list[Episode]:
        """Handle every environment call that finished (waiting for one when the engine is idle);
        returns the episodes ready for their next turn. A call running longer than step_timeout_s (from
        when it started: waiting for a thread does not count) ends its episode."""
        if not pending:
            return []
        if block:
            wait(list(pending), timeout=POLL_S, return_when=FIRST_COMPLETED)
        ready, now = [], time.monotonic()
        self._abandoned = {f for f in self._abandoned if not f.done()}
        late = [f for f, (_, job) in pending.items()
                if not f.done() and job.started.is_set() and now - job.started_at > self.cfg.step_timeout_s]
        stuck = len(self._abandoned) + len(late) >= self.pool.size  # every thread holds a hung step
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
                continue
            try:
                out, seconds = fut.result()
            except Exception as e:
                ep.end("env_error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
                continue
            ep.counters["env_s"] = ep.counters.get("env_s", 0.0) + seconds
            if self._advance(ep, out):
                ready.append(ep)
        return ready

    def _advance(self, ep: Episode, out) -> bool:
        """Apply a reset's or a step's result; True if the episode goes on to another turn."""
        if not ep.messages:  # the reset's messages
            ep.start(out)
            return True
        obs, reward, done, info = as_step_result(out, self.cfg.name)
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
