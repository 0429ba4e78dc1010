"""A fleet of engine replicas (relayrl.roles.fleet) against one engine: the same seeded samples in the prompts' order,
whatever replica each request ran on, per-replica figures that add up, every replica's weights updated and
versioned, and the replicas' generate calls running at once. The replicas are inline rollout roles here (engines in
this process, seconds); tests/fleet/test_fleet_run.py runs them in worker processes of their own."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.models.tokenizer import load_tokenizer
from relayrl.roles.fleet import RolloutFleet
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.rollout.router import Router

BLOCK = 4
# 6 prompts; the 2nd and 5th share their first two blocks (8 tokens of 10)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20], [30, 31, 32, 33, 34],
           [8, 9, 10, 11, 12, 13, 14, 15, 40, 41], [3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from relayrl.models.config import TinyModelConfig
    from relayrl.models.tiny import build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, init_std=0.3)
    return str(build_tiny_model(tmp_path_factory.mktemp("fleet") / "m", "0123456789+=abcdefghijklmnopqrstuvwxyz", cfg))


def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_pretrained(model_dir, num_blocks=64, block_size=BLOCK, seed=0)


def fleet(model_dir, n: int, **router) -> RolloutFleet:
    tok = load_tokenizer(model_dir)
    return RolloutFleet([RolloutRole.inline(lambda: engine(model_dir), tok) for _ in range(n)],
                        Router(n, BLOCK, **router))


def params() -> list[SamplingParams]:
    """A seed per request, as relayrl's sources give them (relayrl.rollout.source.sampling_params)."""
    return [SamplingParams(n=3, temperature=1.0, top_k=20, max_tokens=8, seed=100 + i) for i in range(len(PROMPTS))]


@pytest.mark.equivalence
@pytest.mark.parametrize("n", [2, 3])
def test_a_fleet_samples_what_one_engine_samples(model_dir, n):
    want = engine(model_dir).generate(PROMPTS, params())
    f = fleet(model_dir, n, balance_abs=0, balance_rel=1.0)  # any load difference overrides affinity: spread out
    try:
        got = f.generate(PROMPTS, params())
        for a, b in zip(want, got, strict=True):
            assert a.prompt_token_ids == b.prompt_token_ids  # in the prompts' order
            assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
            for sa, sb in zip(a.samples, b.samples, strict=True):  # another batch: the same tokens, rounding apart
                assert sb.logprobs == pytest.approx(sa.logprobs, abs=1e-5)
        stats = f.stats()
        requests = [stats[f"fleet/replica{r}/requests"] for r in range(n)]
        # work = prompt + 3 * 8 tokens: least outstanding work sends the 6 requests round the replicas
        assert sum(requests) == len(PROMPTS) and min(requests) >= 1
        tokens = sum(stats[f"fleet/replica{r}/tokens"] for r in range(n))
        assert tokens == sum(len(s.token_ids) for o in want for s in o.samples)
        assert all(f.router.load(r) == 0 for r in range(n))  # every request's work left the load when done
        for r, role in enumerate(f.replicas):  # each replica's own engine figures, under its name
            assert stats[f"fleet/replica{r}/kv_peak"] == role.stats()["engine/peak_blocks_used"] > 0
            assert stats[f"fleet/replica{r}/tokens_per_s"] > 0
    finally:
        f.close()


@pytest.mark.unit
def test_a_shared_prefix_runs_where_it_is_cached(model_dir):
    f = fleet(model_dir, 2)  # default bound: 256 tokens of slack, so affinity holds here
    try:
        f.generate(PROMPTS[:2], params()[:2])  # -> replica 0, replica 1 (least loaded)
        f.reset_stats()
        f.generate([PROMPTS[4]], params()[4:5])  # 8 of its 10 tokens are replica 1's cached blocks
        stats = f.stats()
        assert stats["fleet/replica1/requests"] == 1 and stats["fleet/replica0/requests"] == 0
        assert stats["fleet/replica1/router_hit_rate"] == pytest.approx(8 / 10)
        # the engine agrees: 8 of the prompt's 10 tokens were prefix-cache hits there
        assert stats["fleet/replica1/prefix_hit_rate"] == pytest.approx(8 / 10)
    finally:
        f.close()


@pytest.mark.unit
def test_new_weights_reach_every_replica_with_a_version(model_dir):
    f = fleet(model_dir, 2)
    try:
        assert f.versions == [0, 0]
        from safetensors.torch import load_file

        weights = [(name, torch.zeros_like(t) if name.endswith(("lm_head.weight", "embed_tokens.weight")) else t)
                   for name, t in load_file(f"{model_dir}/model.safetensors").items()]
        assert f.load_weights(weights) == 1 and f.versions == [1, 1] and f.weights_version == 1
        # zero embeddings and head: every logit equal, so the greedy token is id 0 everywhere
        outs = f.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3))
        assert [o.samples[0].token_ids for o in outs] == [[0, 0, 0], [0, 0, 0]]
        assert f.stats()["fleet/replica1/version"] == 1.0
    finally:
        f.close()


@pytest.mark.unit
def test_the_replicas_generate_at_once(model_dir):
    f = fleet(model_dir, 2)
    inside, peak, lock = [0], [0], threading.Lock()
    for role in f.replicas:
        real = role.advance  # the fleet's generate calls each replica in rounds (relayrl.roles.fleet_stepper)

        def slow(*args, real=real):
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.3)  # long enough for the other replica's call to start meanwhile, if they run at once
            try:
                return real(*args)
            finally:
                with lock:
                    inside[0] -= 1

        role.advance = slow
    try:
        f.generate(PROMPTS[:2], params()[:2])
        assert peak[0] == 2
    finally:
        f.close()


@pytest.mark.unit
def test_a_bad_call_gets_the_engine_s_own_error(model_dir):
    from relayrl.errors import UserError

    f = fleet(model_dir, 2)
    one = engine(model_dir)
    try:
        for prompts, ps in (("5 6 7", SamplingParams()), (PROMPTS, params()[:2])):
            with pytest.raises(UserError) as want:
                one.generate(prompts, ps)
            with pytest.raises(type(want.value)) as got:
                f.generate(prompts, ps)
            assert str(got.value) == str(want.value)
        assert all(f.router.load(r) == 0 for r in range(2)) and sum(c.requests for c in f.router.counters) == 0
    finally:
        f.close()


@pytest.mark.unit
def test_each_replica_reports_the_most_sequences_it_ran_and_queued(model_dir):
    """max_num_seqs 2: one engine given the 6 prompts (a sample each) runs 2 and queues 4 after its first schedule;
    two replicas get 3 each (least outstanding work) and run 2, queue 1. Fleet-wide: the busiest replica's."""
    one_params = [SamplingParams(n=1, temperature=1.0, max_tokens=8, seed=100 + i) for i in range(len(PROMPTS))]
    one = LLMEngine.from_pretrained(model_dir, num_blocks=64, block_size=BLOCK, seed=0, max_num_seqs=2)
    try:
        one.generate(PROMPTS, one_params)
        st = one.stats()
        assert (st["engine/peak_running"], st["engine/peak_waiting"]) == (2.0, 4.0)
        one.reset_stats()
        assert (one.stats()["engine/peak_running"], one.stats()["engine/peak_waiting"]) == (0.0, 0.0)
    finally:
        one.close()
    tok = load_tokenizer(model_dir)
    f = RolloutFleet([RolloutRole.inline(lambda: LLMEngine.from_pretrained(model_dir, num_blocks=64, block_size=BLOCK,
                                                                           seed=0, max_num_seqs=2), tok)
                      for _ in range(2)], Router(2, BLOCK))
    try:
        f.generate(PROMPTS, one_params)
        stats = f.stats()
        for r in range(2):
            assert stats[f"fleet/replica{r}/requests"] == 3.0
            assert (stats[f"fleet/replica{r}/running_peak"], stats[f"fleet/replica{r}/queue_peak"]) == (2.0, 1.0)
        assert (stats["engine/peak_running"], stats["engine/peak_waiting"]) == (2.0, 1.0)
    finally:
        f.close()
