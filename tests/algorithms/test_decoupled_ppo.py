"""Decoupled PPO on hand-computed cases: the clipped ratio against the proximal policy (the trainer's weights
before the update), the behaviour weight pi_prox / pi_behaviour truncated per token (TIS) or a sequence
masked by its geometric mean (MIS); and algo.proximal=behaviour, plain PPO against the sampling policy."""

import math

import pytest
import torch

from relayrl.algorithms.config import AlgoConfig
from relayrl.algorithms.objective import policy_objective
from relayrl.controller.driver import Driver, LoopSettings
from relayrl.rollout.sample import Rollout, Sample
from relayrl.rollout.source import LockstepSource

from helpers import cfg_for

pytestmark = pytest.mark.unit

L = math.log
# row 0 (A = +1): three tokens; row 1 (A = -1): two tokens and a padded one
LOGP = torch.tensor([[L(.5), L(.3), L(.6)], [L(.1), L(.5), 0.0]])
PROX = torch.tensor([[L(.4), L(.3), L(.4)], [L(.2), L(.5), 0.0]])
BEHAV = torch.tensor([[L(.2), L(.6), L(.4)], [L(.05), L(.5), 0.0]])
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
ADV = torch.tensor([1.0, -1.0])


def _loss(old, **algo):
    cfg = AlgoConfig(agg="token-mean", clip_low=0.2, clip_high=0.28, **algo)
    return policy_objective(LOGP, old, ADV, MASK, cfg, rollout_logp=BEHAV)


def test_decoupled_ppo_with_truncated_behaviour_weights_by_hand():
    loss, stats = _loss(PROX, tis_cap=2.0)
    # row 0: ratio to prox [1.25, 1, 1.5] -> clipped surrogate [1.25, 1, 1.28]; weight min(prox/behav, 2) = [2, .5, 1]
    # row 1: ratio [.5, 1] with A = -1 -> min(-.5, -.8) = -.8 and -1; weight [min(4, 2), 1] = [2, 1]
    by_hand = (-(2 * 1.25) - (.5 * 1) - (1 * 1.28) + (2 * .8) + (1 * 1)) / 5
    assert float(loss) == pytest.approx(by_hand, abs=1e-6)
    assert float(stats["is/weight_mean"]) == pytest.approx((2 + .5 + 1 + 2 + 1) / 5, abs=1e-6)


def test_decoupled_ppo_with_a_sequence_mask_by_hand():
    loss, stats = _loss(PROX, tis_cap=None, mis_low=0.5, mis_high=1.5)
    # geometric-mean prox/behav: row 0 exp((ln 2 + ln .5 + 0) / 3) = 1 (kept); row 1 exp((ln 4 + 0) / 2) = 2 (masked)
    # row 0 unweighted, and the masked row still counts in the token denominator (5)
    assert float(loss) == pytest.approx(-(1.25 + 1 + 1.28) / 5, abs=1e-6)
    assert float(stats["is/masked_seq_frac"]) == 0.5


def test_plain_ppo_against_the_behaviour_policy_by_hand():
    loss, stats = _loss(BEHAV, tis_cap=2.0)  # what algo.proximal=behaviour hands the objective
    # row 0: ratio to behav [2.5, .5, 1.5] -> [1.28, .5, 1.28]; row 1: [2, 1] with A = -1 -> -2 and -1; weights 1
    assert float(loss) == pytest.approx((-(1.28 + .5 + 1.28) + (2 + 1)) / 5, abs=1e-6)
    assert float(stats["is/weight_mean"]) == 1.0


class _Recorder:
    """A policy that records the batch its update gets (the driver's choice of old logprobs is under test)."""

    def __init__(self):
        self.batch = None

    def compute_logprobs(self, batch):
        return torch.full_like(batch.rollout_logp, -0.25)  # a recomputation distinct from the engine's

    def update(self, batch):
        self.batch = batch
        return {}


class _Engine:
    pad_id = 0

    def stats(self):
        return {}

    def reset_stats(self):
        pass


@pytest.mark.parametrize("proximal", ["recompute", "behaviour"])
def test_driver_hands_the_update_the_proximal_policy_it_is_told(tmp_path, proximal):
    cfg = cfg_for(tmp_path, "x", algo={"proximal": proximal}, rollout={"prompts_per_step": 1, "group_size": 2})
    policy = _Recorder()
    source = LockstepSource(_Engine(), sampler=None, rollout=cfg.rollout, data=cfg.data, seed=0, scorer=object())
    d = Driver(LoopSettings.of(cfg), policy=policy, engine=source.engine, source=source, weight_sync=None)
    ro = Rollout([Sample(example=None, prompt_ids=[5, 6], response_ids=[7, 8], logprobs=[-1.0, -2.0], mask=[1, 1],
                         versions=[0, 0], text="", reward=1.0, correct=True),
                  Sample(example=None, prompt_ids=[5, 6], response_ids=[9], logprobs=[-3.0], mask=[1], versions=[0],
                         text="", reward=0.0)], {})
    m = d.learn(ro, 0.0, t0=0.0, extra={})
    b = policy.batch
    got = b.old_logp[b.response_mask > 0].tolist()
    assert got == ([-1.0, -2.0, -3.0] if proximal == "behaviour" else [-0.25] * 3)
    assert m["staleness/max"] == 0.0 and m["staleness/tokens_at_0"] == 3.0
