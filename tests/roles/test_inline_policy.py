"""parallel.backend none: the trainer is GroupPolicy's workers in a world of 1, inline in the driver's process.
It starts no process and no process group, and computes exactly what the Actor computes on its own (the numbers
of the one-process trainer it replaced); a profiled update reports zero communication without a profiler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from relayrl.algorithms import AlgoConfig
from relayrl.observe.comm_profile import COMM_SHARE, COMM_TIME
from relayrl.trainer.actor import Actor
from relayrl.trainer.config import TrainerConfig

from helpers import inline_policy, perturbed_model, policy_model, random_train_batch, small_config


@pytest.mark.equivalence
def test_an_inline_policy_computes_what_its_actor_computes_alone():
    model = perturbed_model(small_config(), seed=1)
    alone = Actor(copy.deepcopy(model), TrainerConfig(), AlgoConfig(), total_steps=1)
    policy = inline_policy(model)
    try:
        assert policy.inline and not dist.is_initialized()  # no process group was made for a world of 1
        assert policy_model(policy) is model  # built by its worker, from the very object: no copy
        batch = random_train_batch(n=6, seed=2)
        old = policy.compute_logprobs(batch)
        assert torch.equal(old, alone.compute_logprobs(batch))
        batch = batch.replace(old_logp=old, rollout_logp=old)
        stats = policy.update(batch, profile=True)
        want = alone.update(batch)
        assert {k: stats[k] for k in want} == want
        assert {k: stats[k] for k in (COMM_TIME, COMM_SHARE)} == {COMM_TIME: 0.0, COMM_SHARE: 0.0}
        again = policy.update(batch)
        assert COMM_TIME not in again and {k: again[k] for k in want} == alone.update(batch)  # profiled steps only
        assert torch.equal(policy.compute_logprobs(batch), alone.compute_logprobs(batch))
    finally:
        policy.close()
