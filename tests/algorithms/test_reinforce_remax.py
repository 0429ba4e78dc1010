"""REINFORCE++, REINFORCE++-baseline and ReMax against cases worked out by hand, a plain reverse-time loop on
random masked batches, OpenRLHF's recursion and global normalisation on right-padded rows, and the config names."""

from __future__ import annotations

import math
import random

import pytest
import torch

from relayrl.algorithms import (
    AdvantageInputs,
    AlgoConfig,
    advantage_is_token_level,
    advantage_needs_greedy_baseline,
    discounted_returns,
    get_advantage,
    global_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    remax,
)
from relayrl.algorithms.gae import token_rewards
from relayrl.errors import ConfigError

from helpers import advantages_of, random_multiturn_mask

pytestmark = pytest.mark.unit

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def close(a, b, tol=1e-9):
    torch.testing.assert_close(a.to(D), b if isinstance(b, torch.Tensor) else t(b), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- REINFORCE++ by hand

# row 0: prompt, two model tokens, an observation (multi-turn hole), one model token, padding
# row 1: prompt, three model tokens, padding
MASK = t([[0, 1, 1, 0, 1, 0],
          [0, 1, 1, 1, 0, 0]])


def test_reinforce_pp_hand_case_with_a_hole_and_gamma():
    # gamma = 0.5, outcomes [4, -4], no KL.
    # row 0: r_4 = 4; G_4 = 4; the hole at 3 is skipped: G_2 = 0 + 0.5*4 = 2; G_1 = 0.5*2 = 1
    # row 1: r_3 = -4; G_3 = -4; G_2 = -2; G_1 = -1
    returns = discounted_returns(token_rewards(t([4.0, -4.0]), MASK), MASK, gamma=0.5)
    close(returns, [[0, 1, 2, 0, 4, 0], [0, -1, -2, -4, 0, 0]])
    # the six model tokens' returns {1, 2, 4, -1, -2, -4}: mean 0, population variance (1+4+16)*2/6 = 7,
    # so A = G / sqrt(7)
    s7 = math.sqrt(7)
    adv = reinforce_pp(t([4.0, -4.0]), MASK, gamma=0.5)
    close(adv, [[0, 1 / s7, 2 / s7, 0, 4 / s7, 0], [0, -1 / s7, -2 / s7, -4 / s7, 0, 0]])
    # gamma = 1: G = 4 on row 0's tokens, -4 on row 1's; mean 0, variance 16: A = +-1
    close(reinforce_pp(t([4.0, -4.0]), MASK, gamma=1.0), [[0, 1, 1, 0, 1, 0], [0, -1, -1, -1, 0, 0]])
    # norm_std=False (OpenRLHF --no_advantage_std_norm): the mean shift only, here 0, so A = G
    close(reinforce_pp(t([4.0, -4.0]), MASK, gamma=0.5, norm_std=False), returns)


def test_whitening_is_over_the_whole_batch_not_per_row():
    # gamma = 1, outcomes [3, 1]: row 0 has 3 tokens of 3, row 1 has 3 tokens of 1. Batch mean 2, population
    # variance 1, so A = +1 on row 0 and -1 on row 1. Per-row whitening would give 0 everywhere (each row is
    # constant), per-row centring too.
    adv = reinforce_pp(t([3.0, 1.0]), MASK, gamma=1.0)
    close(adv, [[0, 1, 1, 0, 1, 0], [0, -1, -1, -1, 0, 0]])
    # the batch's masked tokens have mean 0 and population std 1, whatever the rows
    g = torch.Generator().manual_seed(0)
    adv = reinforce_pp(torch.randn(2, generator=g, dtype=D), MASK, gamma=0.7,
                       kl=torch.rand(2, 6, generator=g, dtype=D), kl_coef=0.3)
    vals = adv[MASK > 0]
    assert abs(vals.mean().item()) < 1e-12 and abs(vals.var(unbiased=False).item() - 1) < 1e-9
    assert abs(adv[0][MASK[0] > 0].mean().item()) > 1e-3  # a single row is not centred on its own


def test_kl_enters_the_reward_per_token():
    # one row of three model tokens, outcome 1, KL [1, 1, 2], kl_coef 0.1, gamma 1:
    # r = [-0.1, -0.1, 1 - 0.2] = [-0.1, -0.1, 0.8]; G = [0.6, 0.7, 0.8]; mean 0.7,
    # population variance (0.1^2 + 0 + 0.1^2)/3 = 0.02/3, std 0.1/sqrt(1.5): A = [-sqrt(1.5), 0, sqrt(1.5)]
    mask, kl = t([[1, 1, 1, 0]]), t([[1.0, 1.0, 2.0, 100.0]])  # the KL off the mask (100) must not count
    close(discounted_returns(token_rewards(t([1.0]), mask, kl, 0.1), mask), [[0.6, 0.7, 0.8, 0]])
    r = math.sqrt(1.5)
    close(reinforce_pp(t([1.0]), mask, kl=kl, kl_coef=0.1), [[-r, 0, r, 0]])
    # without the KL every token's return is the outcome 1: a constant batch, advantage 0 (not NaN)
    close(reinforce_pp(t([1.0]), mask, kl=kl, kl_coef=0.0), [[0, 0, 0, 0]])
    close(reinforce_pp(t([1.0]), mask), [[0, 0, 0, 0]])


def test_baseline_variant_subtracts_the_group_mean():
    # G = 2, outcomes [1, 0 | 3, 3] -> centred [0.5, -0.5 | 0, 0]; rows of 1, 1, 2, 2 model tokens, gamma 1:
    # tokens {0.5, -0.5, 0, 0, 0, 0}: mean 0, population variance 0.5/6 = 1/12, so A = +-0.5*sqrt(12) = +-sqrt(3)
    mask = t([[1, 0], [1, 0], [1, 1], [1, 1]])
    r3 = math.sqrt(3)
    close(reinforce_pp_baseline(t([1.0, 0.0, 3.0, 3.0]), mask, group_size=2), [[r3, 0], [-r3, 0], [0, 0], [0, 0]])
    # plain REINFORCE++ on the same batch: tokens {1, 0, 3, 3, 3, 3} are not centred per prompt
    assert reinforce_pp(t([1.0, 0.0, 3.0, 3.0]), mask)[2, 0] > 0.5
    # with KL and gamma, the baseline variant is REINFORCE++ on the group-centred outcomes
    g = torch.Generator().manual_seed(1)
    outcome, kl = torch.randn(4, generator=g, dtype=D), torch.rand(4, 2, generator=g, dtype=D)
    centred = outcome - outcome.view(2, 2).mean(dim=1).repeat_interleave(2)
    close(reinforce_pp_baseline(outcome, mask, group_size=2, kl=kl, kl_coef=0.2, gamma=0.9),
          reinforce_pp(centred, mask, kl=kl, kl_coef=0.2, gamma=0.9))
    with pytest.raises(ValueError, match="whole number of groups"):
        reinforce_pp_baseline(t([1.0, 0.0, 3.0]), mask[:3], group_size=2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        reinforce_pp_baseline(t([1.0, 0.0]), mask[:2], group_size=1)


# ----------------------------------------------------------------------------- against plain loops


def reference_loop(outcome, mask, kl, kl_coef, gamma, baseline_group=0):
    """REINFORCE++ written plainly: per row over its model tokens, newest first; then one mean and one std
    over every model token of the batch."""
    outcome = list(outcome)
    if baseline_group:
        for s in range(0, len(outcome), baseline_group):
            grp = outcome[s:s + baseline_group]
            outcome[s:s + baseline_group] = [o - sum(grp) / len(grp) for o in grp]
    ret = [[0.0] * len(row) for row in mask]
    for i in range(len(mask)):
        acts = [j for j in range(len(mask[i])) if mask[i][j] > 0]
        running = 0.0
        for j in reversed(acts):
            r = -kl_coef * kl[i][j] + (outcome[i] if j == acts[-1] else 0.0)
            running = r + gamma * running
            ret[i][j] = running
    flat = [ret[i][j] for i in range(len(mask)) for j in range(len(mask[i])) if mask[i][j] > 0]
    mean = sum(flat) / len(flat)
    std = math.sqrt(max(sum((x - mean) ** 2 for x in flat) / len(flat), 1e-8))
    return [[(ret[i][j] - mean) / std if mask[i][j] > 0 else 0.0 for j in range(len(mask[i]))]
            for i in range(len(mask))]


@pytest.mark.parametrize("seed", range(5))
def test_equals_a_plain_loop_on_random_masked_batches(seed):
    rng = random.Random(seed)
    B, T, G = 6, 17, 3
    mask = random_multiturn_mask(rng, B, T, dtype=D)
    g = torch.Generator().manual_seed(seed)
    outcome, kl = torch.randn(B, generator=g, dtype=D), torch.rand(B, T, generator=g, dtype=D)
    kl_coef, gamma = rng.choice([0.0, 0.05, 0.5]), rng.choice([1.0, 0.99, 0.8])
    args = (outcome.tolist(), mask.tolist(), kl.tolist(), kl_coef, gamma)
    close(reinforce_pp(outcome, mask, kl=kl, kl_coef=kl_coef, gamma=gamma), t(reference_loop(*args)), tol=1e-7)
    close(reinforce_pp_baseline(outcome, mask, group_size=G, kl=kl, kl_coef=kl_coef, gamma=gamma),
          t(reference_loop(*args, baseline_group=G)), tol=1e-7)


def test_right_padded_rows_match_openrlhfs_recursion_and_normalisation():
    """OpenRLHF masks the token rewards, runs the discount over every response position, then normalises over
    all action tokens with the population variance clamped at 1e-8; on right-padded rows that is ours."""
    g = torch.Generator().manual_seed(2)
    lengths, T = [5, 9, 1, 7], 9
    mask = t([[1.0] * n + [0.0] * (T - n) for n in lengths])
    outcome, kl = torch.randn(4, generator=g, dtype=D), torch.rand(4, T, generator=g, dtype=D)
    gamma, coef = 0.95, 0.1
    rewards = -coef * kl * mask
    rewards[torch.arange(4), torch.tensor(lengths) - 1] += outcome
    running, cols = torch.zeros(4, dtype=D), []
    for j in reversed(range(T)):
        running = rewards[:, j] + gamma * running
        cols.append(running)
    returns = torch.stack(cols[::-1], dim=1)
    n = mask.sum()
    mean = (returns * mask).sum() / n
    rstd = (((returns - mean) ** 2 * mask).sum() / n).clamp(min=1e-8).rsqrt()
    close(reinforce_pp(outcome, mask, kl=kl, kl_coef=coef, gamma=gamma), (returns - mean) * rstd * mask)


def test_global_whiten_edge_cases():
    # no model tokens: zeros, not NaN; one token: 0 (its own mean)
    close(global_whiten(t([[1.0, 2.0]]), t([[0, 0]])), [[0, 0]])
    close(global_whiten(t([[5.0, 2.0]]), t([[0, 1]])), [[0, 0]])
    with pytest.raises(ValueError, match="kl must have the mask's shape"):
        reinforce_pp(t([1.0]), t([[1, 1]]), kl=t([[1.0]]), kl_coef=0.1)


# ----------------------------------------------------------------------------- ReMax


def test_remax_by_hand():
    # G = 3, two prompts; greedy rewards [1, 0]: A = r - r_greedy of its prompt
    close(remax(t([1, 0, 1, 0, 0, 1]), 3, baseline=t([1, 0])), [0, -1, 0, 0, 0, 1])
    # G = 1 (the paper's setting): one sample and one greedy response per prompt
    close(remax(t([0.5, 1.0]), 1, baseline=t([1.0, 0.0])), [-0.5, 1.0])
    # norm_std is accepted and ignored (no std division)
    close(advantages_of("remax", t([2, 0, 1, 1]), 2, norm_std=True, baseline=t([0.5, 3])), [1.5, -0.5, -2, -2])
    with pytest.raises(ValueError, match=r"baseline must be \[N/G\] = \[2\]"):
        remax(t([1, 0, 1, 0]), 2, baseline=t([1, 0, 1]))
    with pytest.raises(TypeError):  # the greedy baseline is not optional
        remax(t([1, 0]), 2)


# ----------------------------------------------------------------------------- registry and config


def test_flags_tell_the_driver_how_to_call_each_estimator():
    assert advantage_is_token_level("reinforce_pp") and advantage_is_token_level("reinforce_pp_baseline")
    assert not any(advantage_is_token_level(n) for n in ("grpo", "dr_grpo", "rloo", "remax"))
    assert advantage_needs_greedy_baseline("remax")
    assert not any(advantage_needs_greedy_baseline(n) for n in ("grpo", "rloo", "reinforce_pp"))
    # the registered estimator (one signature for all) computes the plain function's advantages
    outcome, mask = t([1.0, 0.0, 2.0, 1.0]), torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    registered = get_advantage("reinforce_pp")(AdvantageInputs(outcome, mask, 2), AlgoConfig(advantage="reinforce_pp"))
    assert torch.equal(registered.advantages, reinforce_pp(outcome, mask)) and registered.returns is None
    with pytest.raises(ValueError, match="unknown advantage"):
        advantage_is_token_level("nope")


def test_algo_config_accepts_the_names_and_lists_them_on_a_typo():
    for name in ("reinforce_pp", "reinforce_pp_baseline", "remax"):
        assert AlgoConfig.from_dict({"advantage": name}).advantage == name
    # the discount and the KL-in-reward switch the driver passes on (shared with gae)
    cfg = AlgoConfig.from_dict({"advantage": "reinforce_pp", "gamma": 0.99, "kl_in_reward": True, "kl_coef": 0.01})
    assert (cfg.gamma, cfg.kl_in_reward, cfg.kl_coef) == (0.99, True, 0.01)
    bad = [
        ({"advantage": "reinforce++"}, "advantage: .*unknown advantage 'reinforce\\+\\+'; known: .*"
                                       "reinforce_pp, reinforce_pp_baseline, remax, rloo"),
        ({"advantage": "remax_"}, "advantage: .*known: .*remax"),
        ({"advantage": "reinforce_pp", "gamma": 1.5}, "gamma"),
    ]
    for data, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            AlgoConfig.from_dict(data)
