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

The fleet's service and faults meet it at two seams: among() (the replicas that may take episodes) and
lost(r, e, n) (replica r's worker was lost, a RunFault, while it ran n examples' episodes). Here every replica
serves and a loss is raised as any rollout worker's; once the fleet takes lost replicas out of service, among()
gives those in service and lost() hands the replica to the fleet, and its examples are routed again to the others:
seeded, they give the same episodes, none lost or duplicated (tests/fleet/test_fleet_episodes.py). A replica's
worker gets its agent loop the first time it is asked for episodes, so a restarted or added replica (a new
process) gets one too.

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from relayrl.data import DataConfig, Example
from relayrl.engine.sampling_params import SamplingParams
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import Trajectory
from relayrl.errors import RunFault
from relayrl.roles.fleet import RolloutFleet, settle
from relayrl.roles.rollout_worker import EpisodeRole
from relayrl.rollout.config import RolloutConfig
from relayrl.rollout.prompts import encode_prompt


class FleetEpisodes:
    """Episodes on every replica of a fleet, each example's on the replica the router picks (an EpisodeRunner,
    relayrl.rollout.agent_loop)."""

    def __init__(self, fleet: RolloutFleet, cfg: EnvConfig | RolloutConfig, data: DataConfig, max_total_tokens: int):
        """cfg: what each replica's worker runs (EpisodeRole); data: how a prompt is encoded into its routing key;
        max_total_tokens: an episode's budget (prompt + every turn), for the work estimate."""
        self.fleet, self.cfg, self.data, self.budget = fleet, cfg, data, max_total_tokens
        self._roles: list[EpisodeRole] = []  # one per rollout role whose worker has its agent loop started
        for r in self.among():
            self.episode_role(r)

    def among(self) -> list[int]:
        """The replicas in service (none: the fleet's FleetLostError)."""
        serving = self.fleet.serving
        if not serving:
            raise self.fleet.exhausted()
        return serving

    def episode_role(self, r: int) -> EpisodeRole:
        """Replica r's episodes, its worker's agent loop started the first time its role (a replica's process; a
        restarted or added replica is a new one) is asked."""
        role = self.fleet.replicas[r]
        for er in self._roles:
            if er.rollout is role:
                return er
        er = EpisodeRole(role, self.cfg)
        self._roles.append(er)
        return er

    def lost(self, r: int, error: BaseException, examples: int) -> None:
        """Replica r failed (a RunFault) while it held `examples` examples' episodes: out of service (the fleet
        restarts it), its examples routed again."""
        self.fleet.lose(r, error)
        self.fleet.rerouted += examples

    def work(self, prompt_tokens: int, n: int) -> int:
        """What n episodes of a prompt may compute: the prompt once, and each episode's budget beyond it."""
        return prompt_tokens + n * max(self.budget - prompt_tokens, 0)

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[Trajectory]:
        """params[i].n finished episodes of examples[i], contiguous and in the examples' order. The examples whose
        replica failed (lost(), when it does not raise) are routed again among the others: their seeds give the
        same episodes."""
        if len(examples) != len(params):
            raise ValueError(f"{len(examples)} examples with {len(params)} sampling params")
        router = self.fleet.router
        keys = [encode_prompt(self.fleet.tokenizer, ex, self.data) for ex in examples]
        work = [self.work(len(k), sp.n) for k, sp in zip(keys, params, strict=True)]
        groups: list[list[Trajectory]] = [[] for _ in examples]
        todo = list(range(len(examples)))
        while todo:
            among = self.among()
            shares: dict[int, list[int]] = {}
            for i in todo:
                shares.setdefault(router.route(keys[i], work[i], among), []).append(i)
            try:
                roles = {r: self.episode_role(r) for r in shares}
                with ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="relayrl-episodes") as pool:
                    futures = {r: pool.submit(self._run_on, r, roles[r], [examples[i] for i in share],
                                              [params[i] for i in share]) for r, share in shares.items()}
                done, failed = settle(futures)
            finally:
                for r, share in shares.items():
                    for i in share:
                        router.done(r, work[i])
            todo, other = [], None
            for r, e in failed.items():
                if isinstance(e, RunFault):
                    self.lost(r, e, len(shares[r]))
                    todo += shares[r]
                else:
                    other = other or e
            if other is not None:
                raise other
            for r, trajs in done.items():
                at = 0
                for i in shares[r]:
                    groups[i] = trajs[at:at + params[i].n]
                    at += params[i].n
                if at != len(trajs):
                    raise RuntimeError(f"replica {r} returned {len(trajs)} episodes for {at} asked")
            todo.sort()
        return [t for group in groups for t in group]

    def _run_on(self, r: int, role: EpisodeRole, examples: list[Example],
                params: list[SamplingParams]) -> list[Trajectory]:
        t0 = time.perf_counter()
        try:
            trajs = role.run(examples, params)
        finally:
            self.fleet.busy[r] += time.perf_counter() - t0
        self.fleet.tokens[r] += sum(t.model_tokens for t in trajs)  # the tokens its engine sampled
        return trajs

    def close(self) -> None:
        for role in self._roles:
            role.close()  # each worker's loop closes with the worker, before its engine

