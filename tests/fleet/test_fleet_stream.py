"""The rollout stream over a fleet (relayrl.roles.fleet_stepper): the replicas stepped as one StepEngine sample what one
engine samples; a replica behind the staleness bound takes and runs nothing until it is synced; one_step_off and async
runs on 2 replicas, each in a rollout worker of its own, against one engine; configs still refused, in one line.

The stepper's own cases use inline replicas (engines in this process, seconds); the runs use worker processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relayrl.controller.config import RunConfig
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.errors import ConfigError
from relayrl.models.tokenizer import load_tokenizer
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.fleet_replicas import DRAINING, RETIRED, FleetLostError
from relayrl.roles.fleet_stepper import FleetStepper, serving_replicas
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.rollout.router import Router
from relayrl.single_controller.liveness import WorkerLostError

from helpers import assert_same_metrics, cfg_for, step_metrics

BLOCK = 4
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 32, 33, 34], [3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)
    return str(build_tiny_model(tmp_path_factory.mktemp("stream") / "m", "0123456789+=abcdefghijklmnopqrstuvwxyz", cfg))


def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, num_blocks=64, block_size=BLOCK, seed=0)


def fleet(model_dir, n: int) -> RolloutFleet:
    tok = load_tokenizer(model_dir)
    return RolloutFleet([RolloutRole.inline(lambda: engine(model_dir), tok) for _ in range(n)], Router(n, BLOCK))


def params(k: int = len(PROMPTS), max_tokens: int = 8) -> list[SamplingParams]:
    """A seed per request, as relayrl's sources give them (relayrl.rollout.source.sampling_params)."""
    return [SamplingParams(n=3, temperature=1.0, top_k=20, max_tokens=max_tokens, seed=100 + i, ignore_eos=True)
            for i in range(k)]


def weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return list(load_file(str(Path(model_dir) / "model.safetensors")).items())


def drain(stepper: FleetStepper) -> tuple[dict, int]:
    """step() until nothing is left: every finished output by request id, and the step() calls it took."""
    out, calls = {}, 0
    while stepper.has_unfinished():
        for o in stepper.step():
            out[o.request_id] = o
        calls += 1
    return out, calls


@pytest.mark.equivalence
def test_stepped_replicas_sample_what_one_engine_samples(model_dir):
    want = engine(model_dir).generate(PROMPTS, params())
    f = fleet(model_dir, 2)
    try:
        s = FleetStepper(f, max_steps=3)
        s.partial = "keep_kv"  # what the stream sets: it reaches every replica's engine
        assert [role.local_engine().partial for role in f.replicas] == ["keep_kv", "keep_kv"]
        ids = [s.add_request(p, sp) for p, sp in zip(PROMPTS, params(), strict=True)]
        assert ids == [0, 1, 2, 3, 4]
        # routed at once by least outstanding work (prompt + 3 * 8 tokens each): 27, 34 | 25, 29 | 31
        assert [f.router.load(r) for r in range(2)] == [27 + 25 + 31, 34 + 29]
        got, calls = drain(s)
        assert sorted(got) == ids
        for rid, a in enumerate(want):
            b = got[rid]
            assert b.prompt_token_ids == a.prompt_token_ids
            assert [x.token_ids for x in b.samples] == [x.token_ids for x in a.samples]
            for xa, xb in zip(a.samples, b.samples, strict=True):  # another batch: the same tokens, rounding apart
                assert xb.logprobs == pytest.approx(xa.logprobs, abs=1e-5)
        # 8 tokens each, one step a token (the first with the prefill): an advance stops at max_steps = 3, so 3 calls
        # of 3, 3 and 2 steps
        assert calls == 3
        stats = f.stats()
        assert [stats[f"fleet/replica{r}/requests"] for r in range(2)] == [3, 2]
        tokens = [stats[f"fleet/replica{r}/tokens"] for r in range(2)]
        assert tokens == [sum(len(x.token_ids) for i in (0, 2, 4) for x in want[i].samples),
                          sum(len(x.token_ids) for i in (1, 3) for x in want[i].samples)]
        assert all(stats[f"fleet/replica{r}/{k}"] == 0 for r in range(2) for k in ("queue", "running"))
        assert [f.router.load(r) for r in range(2)] == [0, 0] and not s.placed
    finally:
        f.close()


@pytest.mark.unit
def test_an_advance_returns_when_a_request_finishes_and_reports_the_queue(model_dir):
    f = fleet(model_dir, 1)
    try:
        s = FleetStepper(f, max_steps=100)
        s.add_request(PROMPTS[0], params(1, max_tokens=2)[0])
        s.add_request(PROMPTS[1], params(2, max_tokens=6)[1])
        first = s.step()  # both prefilled in one step, then one decode: request 0 is done, request 1 runs on
        assert [o.request_id for o in first] == [0]
        assert [len(x.token_ids) for x in first[0].samples] == [2, 2, 2]
        assert f.live[0] == {"queue": 0.0, "running": 3.0}  # request 1's 3 samples
        assert f.router.load(0) == 10 + 3 * 6
        assert [o.request_id for o in s.step()] == [1] and not s.has_unfinished()
    finally:
        f.close()


@pytest.mark.unit
def test_abort_returns_what_requests_produced_wherever_they_are(model_dir):
    f = fleet(model_dir, 2)
    try:
        s = FleetStepper(f, max_steps=2)
        a = s.add_request(PROMPTS[0], params(1)[0])
        s.step()  # request a ran 2 steps on replica 0: 2 tokens a sample
        b = s.add_request(PROMPTS[1], params(2)[1])  # routed to replica 1, not yet sent
        out = {o.request_id: o for o in s.abort([a, b, 99])}  # 99: unknown, ignored
        assert sorted(out) == [a, b]
        assert [len(x.token_ids) for x in out[a].samples] == [2, 2, 2]
        assert all(x.finish_reason == "abort" for x in out[a].samples + out[b].samples)
        assert [x.token_ids for x in out[b].samples] == [[], [], []]
        assert not s.has_unfinished() and [f.router.load(r) for r in range(2)] == [0, 0]
        assert not any(role.local_engine().has_unfinished() for role in f.replicas)
    finally:
        f.close()


@pytest.mark.unit
@pytest.mark.parametrize("versions, serving", [
    ([3, 3, 3], [0, 1, 2]),  # after a verified sync all agree
    ([3, 3, 1, 2], [0, 1]),  # replica 2 two syncs behind, replica 3 one: neither takes a new request
    ([0, 5], [1]),  # a replica restarted from the base weights joins a run five syncs on
    ([4], [0]),
])
def test_only_replicas_with_the_newest_weights_take_new_requests(versions, serving):
    assert serving_replicas(versions) == serving


@pytest.mark.unit
def test_a_replica_behind_takes_nothing_new_and_runs_what_it_holds_within_the_bound(model_dir):
    """Both replicas at version 1 take a request each; a sync reaches replica 0 alone (version 2). Replica 1 takes no
    new request until synced, though it is the least loaded; the request it took at version 1, the newest then, runs
    on at version 1 (the stream admitted it when the engine held version 1: within the bound)."""
    f = fleet(model_dir, 2)
    w = weights(model_dir)
    try:
        s = FleetStepper(f, max_steps=2)
        s.partial = "keep_kv"  # requests in flight across a sync keep their KV
        for role in f.replicas:
            role.load_weights(w)  # version 1 each
        a = s.add_request(PROMPTS[0], params(1)[0])
        b = s.add_request(PROMPTS[1], params(2)[1])
        assert [s.placed[a].replica, s.placed[b].replica] == [0, 1]  # one each, by load
        s.step()  # 2 tokens a sample of a and b, by version 1
        f.replicas[0].load_weights(w)  # a sync reached replica 0 alone: 2 against 1
        assert s.in_service() == [0]
        c = s.add_request(PROMPTS[3], params(4)[3])
        d = s.add_request(PROMPTS[4], params(5)[4])
        assert [s.placed[c].replica, s.placed[d].replica] == [0, 0]  # not replica 1, though it is the least loaded
        s.step()  # replica 1, behind, runs on what it took when it held the newest weights: tokens 3, 4 of b
        f.replicas[1].load_weights(w)  # synced: it takes new requests again
        assert s.in_service() == [0, 1]
        e = s.add_request(PROMPTS[2], params(3)[2])
        assert s.placed[e].replica == 1
        got, _ = drain(s)
        assert sorted(got) == [a, b, c, d, e]
        for rid, want in [(a, [1, 1] + [2] * 6), (b, [1] * 4 + [2] * 4), (c, [2] * 8), (d, [2] * 8), (e, [2] * 8)]:
            assert [x.versions for x in got[rid].samples] == [want] * 3, rid
    finally:
        f.close()


# ---------------------------------------------------------------------------- runs: replicas in rollout workers
FLEET = {"backend": "local", "placement": "disaggregated", "rollout_worker": True}
P, G = 4, 4  # helpers.SMALL's prompts per step and group size


def run(tmp_path, name: str, parallel: dict, steps: int = 2, **rollout):
    cfg = cfg_for(tmp_path, name, algo={"kl_coef": 0.05}, rollout=rollout, parallel=parallel,
                  reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]},
                  run={"steps": steps, "save_every": 0, "samples_every": 1, "samples_per_step": P * G})
    from relayrl.jobs.train import train

    run_dir = Path(train(cfg, show_progress=False)["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    trained = [json.loads(line)["prompts"] for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    return step_metrics(run_dir), [r for r in rows if r["split"] == "train"], trained


@pytest.mark.e2e
def test_one_step_off_on_2_replicas_samples_and_trains_as_one_engine(tmp_path):
    """The same 2 steps as one engine (in this process): drained at batch boundaries, one_step_off does not depend
    on timing, and every request carries its seed, so the replicas change nothing of what is sampled or trained."""
    one, one_samples, one_prompts = run(tmp_path, "one", {}, mode="one_step_off")
    two, samples, prompts = run(tmp_path, "two", FLEET, mode="one_step_off", replicas=2)
    assert len(one_samples) == 2 * P * G
    assert samples == one_samples and prompts == one_prompts  # every prompt, completion, reward and advantage
    assert_same_metrics(two, one)
    assert [m["staleness/max"] for m in two] == [0.0, 1.0]  # batch k sampled by version k - 1
    # every batch routed once, P requests each, spread by load; every token counted on the replica that made it
    assert sum(m[f"fleet/replica{r}/requests"] for m in two for r in range(2)) == 2 * P
    assert all(sum(m[f"fleet/replica{r}/requests"] for m in two) == P for r in range(2))
    assert (sum(m[f"fleet/replica{r}/tokens"] for m in two for r in range(2))
            == sum(m["response_length/mean"] * P * G for m in two))
    for step, m in enumerate(two):
        assert [m[f"fleet/replica{r}/version"] for r in range(2)] == [step + 1, step + 1]
        assert all(f"fleet/replica{r}/{k}" in m for r in range(2) for k in ("queue", "running"))


def sampler_prompts(tmp_path, steps: int) -> list[list[str]]:
    """The prompts the run's sampler draws, P a step: what every mode must train, each once, in order."""
    from relayrl.data import PromptSampler, build_datasets
    from relayrl.jobs.train import prompt_digest

    cfg = cfg_for(tmp_path, "ref")
    sampler = PromptSampler(build_datasets(cfg.data)[0], cfg.run.seed)
    return [[prompt_digest(ex) for ex in sampler.next_batch(P)] for _ in range(steps)]


@pytest.mark.e2e
@pytest.mark.slow  # ~20 s on 2 shared cores: the one_step_off run and the stepper cases stay in CI; make bench runs it
def test_async_on_2_replicas_keeps_every_token_within_the_bound(tmp_path):
    """async, eta 2, weights changing under requests in flight on both replicas (keep_kv): no trained token was
    sampled more than eta policy versions before its update, every model token has its version, each replica holds
    the step's weights, and every prompt of the sampler is trained once, in order."""
    eta, steps = 2, 3
    got, _, prompts = run(tmp_path, "async", FLEET, steps=steps, mode="async", max_staleness=eta, replicas=2,
                          max_tokens=12)
    assert len(got) == steps
    assert all(m["staleness/max"] <= eta for m in got)
    assert max(m["staleness/max"] for m in got) >= 1  # it did overlap
    for step, m in enumerate(got):
        counted = sum(v for k, v in m.items() if k.startswith("staleness/tokens_at_"))
        assert counted == pytest.approx(m["response_length/mean"] * P * G)  # per-token versions, all of them
        assert [m[f"fleet/replica{r}/version"] for r in range(2)] == [step + 1, step + 1]
    assert sum(m[f"fleet/replica{r}/requests"] for m in got for r in range(2)) == steps * P
    assert prompts == sampler_prompts(tmp_path, steps)


# ---------------------------------------------------------------------------- config
@pytest.mark.unit
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_a_fleet_streams_in_rollout_workers(mode):
    cfg = RunConfig.from_dict({"rollout": {"replicas": 2, "mode": mode}, "parallel": FLEET})
    assert (cfg.rollout.replicas, cfg.rollout.mode, cfg.rollout.staleness) == (2, mode, 1)


@pytest.mark.unit
@pytest.mark.parametrize("rollout, parallel, more, says", [
    # a fleet still needs its replicas in rollout workers of their own, on local processes
    ({"replicas": 2}, {"backend": "local", "placement": "disaggregated"}, {},
     "rollout.replicas=2 runs each engine replica in a rollout worker of its own (local processes or Ray actors): set "
     "parallel.rollout_worker=true (or rollout.replicas=1)"),
    # one engine in a rollout worker cannot be stepped from the driver
    ({"replicas": 1}, FLEET, {}, "drop parallel.rollout_worker and set parallel.placement=disaggregated"),
    ({"replicas": 2, "sleep_level": 1}, FLEET, {}, "so it never sleeps; set rollout.sleep_level=0"),
    ({"replicas": 2}, FLEET, {"algo": {"filter_groups": True}}, "set algo.filter_groups=false"),
    ({"replicas": 2}, FLEET, {"env": {"name": "tests.fixtures.envs:TwoTurns"},
                              "data": {"task": "calculator", "chat_template": "always"}},
     "multi-turn episodes (env:, rollout.agent) on its replicas' agent loops in lockstep: set rollout.mode=sync"),
])
def test_what_a_streaming_fleet_cannot_run_is_refused_in_one_line(rollout, parallel, more, says):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict({"rollout": {"mode": "async", **rollout}, "parallel": parallel, **more})
    assert "\n" not in str(info.value) and says in str(info.value)


# ---------------------------------------------------------------------------- replicas leaving and coming back
@pytest.mark.equivalence
def test_a_lost_replica_s_requests_run_on_the_others_and_sample_the_same(model_dir):
    """Replica 1 is lost mid-generation: what it held (sent or not) is routed again and resumed from what it had
    reported on replica 0 — the same tokens as one engine, as every request carries its seed; replica 1 is never
    stepped again."""
    want = engine(model_dir).generate(PROMPTS, params())
    f = fleet(model_dir, 2)
    try:
        s = FleetStepper(f, max_steps=3)
        ids = [s.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params()[:3], strict=True)]
        s.step()  # 3 tokens a sample of requests 0..2, on replicas 0, 1, 0 (loads 52, 34)
        ids += [s.add_request(p, sp) for p, sp in zip(PROMPTS[3:], params()[3:], strict=True)]  # not yet sent
        assert [s.placed[i].replica for i in ids] == [0, 1, 0, 1, 0]
        stuck = f.replicas[1].local_engine()
        f.lose(1, WorkerLostError("rollout1 worker rank 0 (pid 1) died"))  # as an advance reports it; no restarts
        assert s.reroute(1) == 2 and f.rerouted == 2  # request 1 (3 tokens in) and request 3 (not sent)
        # request 1 resumes on replica 0 from the 3 tokens each of its 3 samples had (re-prefilled, its streams
        # advanced past them): the same samples as one engine's below
        assert f.reprefilled == 9 and [len(t) for t, _, _ in s.placed[ids[1]].prior] == [3, 3, 3]
        assert [s.placed[i].replica for i in ids] == [0, 0, 0, 0, 0] and s.in_service() == [0]
        assert f.router.load(1) == 0 and f.stats()["fleet/rerouted_requests"] == 2
        got, _ = drain(s)
        assert sorted(got) == ids
        for rid, a in enumerate(want):
            assert [x.token_ids for x in got[rid].samples] == [x.token_ids for x in a.samples]
        assert stuck.has_unfinished()  # replica 1 still holds its old copies: nobody stepped it since
    finally:
        f.close()


@pytest.mark.unit
def test_a_draining_replica_finishes_what_it_holds_and_takes_nothing_new(model_dir):
    f = fleet(model_dir, 2)
    try:
        s = FleetStepper(f, max_steps=2)
        a, b = (s.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params()[:2], strict=True))
        s.step()
        f.resize(1)  # the highest-numbered, replica 1, drains
        c = s.add_request(PROMPTS[2], params()[2])  # replica 1 is the least loaded, but draining
        assert (s.placed[b].replica, s.placed[c].replica) == (1, 0) and s.holds(1) == 1
        f.maintain()  # a sync point while it holds a request: it stays, draining
        assert f.slots[1].state == DRAINING
        got, _ = drain(s)
        assert sorted(got) == [a, b, c] and s.holds(1) == 0  # b finished on replica 1
        assert [len(x.token_ids) for x in got[b].samples] == [8, 8, 8]
        f.maintain()  # now it holds nothing: closed
        assert f.slots[1].state == RETIRED
        with pytest.raises(FleetLostError, match="every rollout replica is lost"):
            s.add_request(PROMPTS[3], params()[3])  # -> replica 0
            f.lose(0, WorkerLostError("rollout0 worker rank 0 (pid 1) died"))
            s.reroute(0)  # replica 1 is gone: nothing may take request 3
    finally:
        f.close()
