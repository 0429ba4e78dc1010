"""Episodes on a fleet: each replica's rollout worker runs its own agent loop (env:) or agent runner and endpoint
(rollout.agent) beside its engine, the router sends each example's G episodes to one replica, and the run trains on
the same episodes, with the same step metrics, as on one rollout worker: an episode's seeds are its request's, its
sample's and its turn's, whatever replica runs it. The fast case (CI) runs inline replicas against one agent loop;
the runs put each replica in a worker process of its own (e2e, slow: `make bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.data import DataConfig, get_task
from relayrl.data.agent_tasks import PRINTABLE
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.config import EnvConfig
from relayrl.jobs.train import train
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_episodes import FleetEpisodes
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.rollout.agent_loop import AgentLoop
from relayrl.rollout.router import Router

from helpers import TINY_ENV_MODEL, assert_same_metrics, cfg_for, perturbed_model, small_config, step_metrics

FLEET = {"backend": "local", "placement": "disaggregated", "rollout_worker": True}
P, G = 2, 4
CALC = {"task": "calculator", "task_params": {}, "chat_template": "always", "n_train": 32, "n_eval": 4}


def run(tmp_path, name: str, replicas: int, **sections):
    cfg = cfg_for(tmp_path, f"{name}{replicas}", model=TINY_ENV_MODEL, data=CALC, parallel=FLEET,
                  rollout={"prompts_per_step": P, "group_size": G, "max_tokens": 12, "replicas": replicas,
                           **sections.pop("rollout", {})},
                  eval={"max_tokens": 12}, run={"steps": 2, "save_every": 0, "samples_every": 1,
                                                "samples_per_step": P * G}, **sections)
    run_dir = Path(train(cfg, show_progress=False)["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return step_metrics(run_dir), rows


def same_run(one, two) -> None:
    (a, a_rows), (b, b_rows) = one, two
    train_rows = [r for r in a_rows if r["split"] == "train"]
    assert len(train_rows) == 2 * P * G
    assert b_rows == a_rows  # every episode of both steps (prompt, completion, reward, advantage) and the evaluations
    # the prefix cache's hit rate depends on which prompts share an engine (two replicas cache apart), not on what
    # is sampled: the one figure of the engine's left out
    assert_same_metrics(b, a, skip=("engine/prefix_hit_rate",))
    for m, ref in zip(b, a, strict=True):
        for k in ("turns/mean", "tools/calls", "env/truncated"):
            assert m.get(k) == ref.get(k), k
        assert m["fleet/replicas"] == 2.0
        # the P examples spread by load over both replicas, one each (each example's G episodes on one replica)
        assert [m["fleet/replica0/requests"], m["fleet/replica1/requests"]] == [1.0, 1.0]
        # every token the episodes sampled, counted on the replica that sampled it
        assert m["fleet/replica0/tokens"] > 0 and m["fleet/replica1/tokens"] > 0


ENV = EnvConfig(name="guess", max_turns=3, max_total_tokens=200)


@pytest.fixture(scope="module")
def guess(tmp_path_factory):
    """A tiny model and tokenizer, 4 guess examples x 4 seeded episodes, and one engine's agent loop's episodes."""
    d = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(d, PRINTABLE, tool_tokens=True)
    tok = load_tokenizer(d)
    model = perturbed_model(small_config(vocab_size=len(tok), max_position_embeddings=512,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), seed=3).eval()
    examples = get_task("guess", high=99).generate(4, seed=1)
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=10 + i) for i in range(4)]

    def engine() -> LLMEngine:
        return LLMEngine.from_model(model, tok, kv_cache_bytes=32 << 20, block_size=8)

    one = engine()
    loop = AgentLoop(one, ENV)
    try:
        want = loop.run(examples, params)
    finally:
        loop.close()
        one.close()
    assert len(want) == 16 and max(t.turns for t in want) >= 2
    return tok, engine, examples, params, want


def same_trajectories(want, got) -> None:
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert (b.prompt_ids, b.response_ids, b.mask, b.turns, b.finish, b.reward) == \
            (a.prompt_ids, a.response_ids, a.mask, a.turns, a.finish, a.reward)
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)  # another batch: rounding apart


@pytest.mark.equivalence
def test_a_fleets_episodes_are_one_agent_loops_in_the_examples_order(guess):
    """4 examples x 4 episodes of the guess environment (up to 3 turns) on 2 inline replicas: the same trajectories
    as one engine's agent loop, in the examples' order; each example's episodes on one replica, 2 examples each (the
    router's least outstanding work), the tokens each replica sampled counted on it, every example's work done."""
    tok, engine, examples, params, want = guess
    fleet = RolloutFleet([RolloutRole.inline(engine, tok) for _ in range(2)], Router(2, 8))
    episodes = FleetEpisodes(fleet, ENV, DataConfig(task="guess"), max_total_tokens=ENV.max_total_tokens)
    try:
        got = episodes.run(examples, params)
        stats = fleet.stats()
        managers = [role.local_engine().block_manager for role in fleet.replicas]
        # the fleet's prefix hit rate: every turn's lookups on both replicas, not only the routed prompts
        hits, lookups = sum(m.prefix_hits for m in managers), sum(m.prefix_queries for m in managers)
        assert lookups > sum(len(t.prompt_ids) for t in want[::4])  # later turns looked up their conversations
        assert stats["engine/prefix_hit_rate"] == pytest.approx(hits / lookups) and hits > 0
    finally:
        episodes.close()
        fleet.close()
    same_trajectories(want, got)
    assert [stats["fleet/replica0/requests"], stats["fleet/replica1/requests"]] == [2.0, 2.0]
    assert stats["fleet/replica0/tokens"] + stats["fleet/replica1/tokens"] == sum(t.model_tokens for t in want)
    assert stats["fleet/replica0/tokens"] > 0 and stats["fleet/replica1/tokens"] > 0
    assert fleet.router.load(0) == fleet.router.load(1) == 0


@pytest.mark.faults
def test_the_examples_of_a_replica_lost_mid_rollout_run_again_on_the_others(guess):
    """Replica 1's worker is lost when asked for its examples' episodes: they are routed again to replica 0 and,
    seeded, give the same episodes; every example's work leaves the router's load. Without the fleet's fault
    handling (FleetEpisodes.lost) puts it out of service and counts them."""
    from relayrl.single_controller.liveness import WorkerLostError

    tok, engine, examples, params, want = guess
    fleet = RolloutFleet([RolloutRole.inline(engine, tok) for _ in range(2)], Router(2, 8))

    def lose(*_):
        raise WorkerLostError("rollout1: worker process died (SIGKILL)")

    fleet.replicas[1].run_episodes = lose  # the worker of replica 1 dies under its call
    episodes = FleetEpisodes(fleet, ENV, DataConfig(task="guess"), max_total_tokens=ENV.max_total_tokens)
    try:
        same_trajectories(want, episodes.run(examples, params))
        # replica 1 out of service (a fleet of given roles cannot restart it: retired), its 2 examples counted
        assert fleet.serving == [0] and fleet.status()["retired"] == [1]
        stats = fleet.stats()
        assert stats["fleet/rerouted_requests"] == 2.0 and stats["fleet/lost"] == 1.0
        assert stats["fleet/replica0/requests"] == 4.0  # its own 2, then replica 1's 2
        assert stats["fleet/replica0/tokens"] == sum(t.model_tokens for t in want)
        assert fleet.router.load(0) == 0
    finally:
        episodes.close()
        fleet.close()


@pytest.mark.e2e
@pytest.mark.slow  # ~30 s (two runs with worker processes): the inline case above covers FleetEpisodes in CI
def test_environment_episodes_on_two_replicas_train_as_on_one_rollout_worker(tmp_path):
    env = {"env": {"name": "calculator", "max_total_tokens": 160}}
    same_run(run(tmp_path, "env", 1, **env), run(tmp_path, "env", 2, **env))


@pytest.mark.e2e
@pytest.mark.slow  # ~30 s: as above
def test_agent_function_episodes_on_two_replicas_train_as_on_one_rollout_worker(tmp_path):
    """rollout.agent: each replica's worker serves its engine to the agent at an endpoint of its own; the answers
    the agents return are scored by the run's reward function (the calculator task's)."""
    agent = {"rollout": {"agent": "tests.fixtures.agents:answers"}}
    one, two = run(tmp_path, "agent", 1, **agent), run(tmp_path, "agent", 2, **agent)
    same_run(one, two)
    for m in two[0]:
        assert m["agent/calls"] == 1.0 and m["agent/dropped"] == 0.0
