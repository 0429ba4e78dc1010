"""The asynchronous driver: rollout and training overlap, under a bound on how stale a sample may be.

    step k:  sync ──> set_version(k) ──> take(batch k) ──> learn (the same code as the synchronous driver)
               │                            ^
               └── the rollout stream keeps generating batches k+1 .. k+eta meanwhile (relayrl.controller.
                   rollout_stream), and scores each group as soon as its G samples finish

    rollout.mode      staleness  in flight        weights change
    sync              0          one batch        between batches (relayrl.controller.driver)
    one_step_off      1          one batch        between batches: a sync waits for the batch in flight
    async             eta        max_inflight     between two engine steps; in-flight samples keep their
                                                  KV or recompute it (rollout.partial)

Each token records the weights version that sampled it; `staleness/*` measures the distance to the update
that trains it. The loss is decoupled PPO: the trainer's weights before the update are the proximal policy
and TIS / MIS weight pi_prox / pi_behaviour per token / sequence (algo.proximal=behaviour is plain PPO).
With eta = 0 the stream admits a batch only once its own step's weights have arrived, so every engine step
batches exactly what the synchronous driver's generate() does: the metrics are identical.

A checkpoint after step k saves the sampler's state from before batch k was drawn: batches admitted past k
are discarded at a stop and regenerated on resume, by the resumed weights, so no prompt is lost or trained
twice and the bound holds from the first resumed step.

Like the rest of the loop's package, it reaches the layers below through their protocols; it never
imports the roles, the jobs or relayrl.cli.
"""

from __future__ import annotations

import time

from relayrl.algorithms import group_has_signal
from relayrl.controller.driver import Driver, Rollout, rollout_from_outputs, rollout_from_trajectories
from relayrl.errors import EnvError
from relayrl.rewards.result import ScoreResult
from relayrl.rollout.agent_loop import AgentLoop
from relayrl.rollout.prompts import encode_prompt
from relayrl.rollout.stream import RolloutStream


class AsyncDriver(Driver):
    """Driver with a rollout stream; `rollout.mode` one_step_off or async."""

    def __init__(self, cfg, **roles):
        super().__init__(cfg, **roles)
        r = cfg.rollout
        self.interrupt = r.mode == "async"
        self.engine.partial = r.partial if self.interrupt else None
        episodes = AgentLoop(self.engine, cfg.env) if cfg.env is not None else None
        self.stream = RolloutStream(
            self.engine, sampler=self.sampler, prompts_per_step=r.prompts_per_step, total_batches=cfg.run.steps,
            staleness=r.staleness, max_inflight=r.prompts_per_step if r.mode == "one_step_off" else r.max_inflight,
            make_params=lambda batch, i, ex: self._params(batch, 0, i, ex),
            encode=lambda ex: encode_prompt(self.engine.tokenizer, ex, cfg.data),
            scorer=self.scorer if episodes is None else None, agent=episodes)

    def sync_weights(self) -> dict[str, float]:
        """Move the trainer's weights into the engine: it pauses between two steps (one_step_off: once the
        batch in flight is done), takes them by the plan, is verified, and resumes. Admission moves on at
        the next train_step (set_version), so an evaluation's sync admits nothing new."""
        with self.stream.paused(drain=not self.interrupt):
            return super().sync_weights()

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        with self.timer.stage("sync"):
            sync_metrics = self.sync_weights()
        self.stream.set_version(self.step)  # batches up to step + eta may now be admitted
        t1 = time.perf_counter()
        groups, queue_len = self.stream.take(self.step)  # the trainer waits for the oldest batch
        t_wait = time.perf_counter() - t1
        self.timer.add("rollout", t_wait)
        ro = self._assemble(groups)
        signal = group_has_signal(ro.rewards, self.cfg.rollout.group_size)
        extra = {**sync_metrics, "time/wait_rollout": t_wait, "time/wait_train": self.stream.pop_idle(),
                 "rollout/queue_len": float(queue_len)}
        out = self.learn(ro, 1.0 - float(signal.float().mean()), t0=t0, extra=extra)
        # generation runs beside the step, so tokens per second of the trainer's wait would mean nothing:
        # the pipeline's pace is the model's tokens trained per second of step
        out.pop("throughput/gen_tokens_per_s", None)
        out["throughput/tokens_per_s"] = out["response_length/mean"] * len(ro.response_ids) / max(out["time/step"],
                                                                                                   1e-9)
        return out

    def _engine_stats(self) -> dict[str, float]:
        with self.stream.paused():  # the rollout thread updates these counters as it steps
            return super()._engine_stats()

    def _assemble(self, groups) -> Rollout:
        examples = [g.example for g in groups]
        if groups[0].trajectories is not None:
            trajs = [t for g in groups for t in g.trajectories]
            if all(t.finish == "env_error" for t in trajs):  # judged per step, as the synchronous loop does
                raise EnvError(f"environment '{self.cfg.env.name}' failed on every episode of the step, "
                               f"e.g.: {trajs[0].error}")
            return rollout_from_trajectories(examples, trajs)
        # scored group by group without the every-sample-failed check: it applies to the step, as in sync mode
        res = ScoreResult.merge([g.score for g in groups])
        if self.cost is not None:
            self.cost.add([g.output for g in groups])
        return rollout_from_outputs(examples, [g.output for g in groups], res)

    def sampler_state(self) -> dict:
        return self.stream.sampler_state(self.step)

    def stream_record(self) -> dict:
        return self.stream.describe(self.step)

    def restored(self) -> None:
        self.stream.start_at(self.step)

    def evaluation(self):
        """An evaluation has the engine to itself: admissions stop and the groups in flight finish first."""
        return self.stream.paused(drain=True)

    def close(self) -> None:
        self.stream.close()
