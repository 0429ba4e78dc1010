"""This module runs multi-turn episodes (env: environments, rollout.agent agents) on a rollout fleet: each replica's
rollout worker runs its own agent loop (or agent runner, with its private OpenAI endpoint) beside its engine, and the
fleet's router sends each example's episodes to one replica.

    driver ── FleetEpisodes.run(examples, params) ──> Router (relayrl.rollout.router): example i, keyed by its
              (an EpisodeRunner)                       prompt's ids, with work = prompt + n * (budget - prompt)
                                                    ──> EpisodeRole x N (relayrl.roles.rollout_worker): replica r
                                                        runs its share's episodes in its worker, all replicas at once;
                                                        only finished trajectories travel back

An example's G episodes stay on one replica, and every turn of an episode on the replica that holds its
conversation: the agent endpoint is per worker, so an agent's calls never leave the engine that caches its prefix.
The work estimate mirrors the fleet's single-turn one (prompt + n * max_tokens): the prompt is prefilled once and
cached for its siblings, and each episode may add up to its token budget (env.max_total_tokens, or
rollout.agent_max_total_tokens, or the model's length) beyond it. What is sampled does not depend on the replica:
an episode's seeds derive from its request's seed, its sample and its turn (relayrl.rollout.agent_loop).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from relayrl.data import DataConfig, Example
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import Trajectory
from relayrl.roles.fleet import RolloutFleet, wait_all
from relayrl.roles.rollout_worker import EpisodeRole
from relayrl.rollout.config import RolloutConfig
from relayrl.rollout.prompts import encode_prompt


class FleetEpisodes:
    """Episodes on every replica of a fleet, each example's on the replica the router picks (an EpisodeRunner,
    relayrl.rollout.agent_loop)."""

    def __init__(self, fleet: RolloutFleet, cfg: EnvConfig | RolloutConfig, data: DataConfig, max_total_tokens: int):
        """cfg: what each replica's worker runs (EpisodeRole); data: how a prompt is encoded into its routing key;
        max_total_tokens: an episode's budget (prompt + every turn), for the work estimate."""
        self.fleet, self.data, self.budget = fleet, data, max_total_tokens
        self.roles = [EpisodeRole(replica, cfg) for replica in fleet.replicas]

    def work(self, prompt_tokens: int, n: int) -> int:
        """What n episodes of a prompt may compute: the prompt once, and each episode's budget beyond it."""
        return prompt_tokens + n * max(self.budget - prompt_tokens, 0)

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n finished episodes of examples[i], contiguous and in the examples' order."""
        if len(examples) != len(params):
            raise ValueError(f"{len(examples)} examples with {len(params)} sampling params")
        fleet = self.fleet
        routed: list[tuple[int, int]] = []  # (replica, work) per example
        try:
            for ex, sp in zip(examples, params, strict=True):
                ids = encode_prompt(fleet.tokenizer, ex, self.data)
                work = self.work(len(ids), sp.n)
                routed.append((fleet.router.route(ids, work), work))
            shares: dict[int, list[int]] = {}
            for i, (r, _) in enumerate(routed):
                shares.setdefault(r, []).append(i)
            which = sorted(shares)
            with ThreadPoolExecutor(max_workers=max(len(which), 1), thread_name_prefix="relayrl-episodes") as pool:
                results = wait_all([pool.submit(self._run_on, r, [examples[i] for i in shares[r]],
                                                [params[i] for i in shares[r]]) for r in which])
        finally:
            for r, work in routed:
                fleet.router.done(r, work)
        per_example: list[list[Trajectory]] = [[] for _ in examples]
        for r, trajs in zip(which, results, strict=True):
            at = 0
            for i in shares[r]:
                per_example[i] = trajs[at:at + params[i].n]
                at += params[i].n
            if at != len(trajs):
                raise RuntimeError(f"replica {r} returned {len(trajs)} episodes for {at} asked")
        return [t for group in per_example for t in group]

    def _run_on(self, r: int, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        t0 = time.perf_counter()
        try:
            trajs = self.roles[r].run(examples, params)
        finally:
            self.fleet.busy[r] += time.perf_counter() - t0
        self.fleet.tokens[r] += sum(t.model_tokens for t in trajs)  # the tokens its engine sampled
        return trajs

    def close(self) -> None:
        for role in self.roles:
            role.close()  # each worker's loop closes with the worker, before its engine
