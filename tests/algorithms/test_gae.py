"""GAE on token-level rewards: a hand-computed case, a plain reverse-time loop on random masked batches
(right padding and multi-turn holes), verl's recursion on right-padded rows, token rewards and whitening."""

import random

import pytest
import torch

from relayrl.algorithms.gae import gae, masked_whiten, token_rewards

from helpers import random_multiturn_mask

pytestmark = pytest.mark.unit


def test_hand_computed_case():
    # prompt token, three model tokens, padding; outcome 1 on the last model token
    mask = torch.tensor([[0.0, 1, 1, 1, 0]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7, 9.0]])
    rewards = token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.9)
    # A3 = 1 - 0.7 = 0.3; A2 = (0.7 - 0.6) + 0.9 * 0.3 = 0.37; A1 = (0.6 - 0.5) + 0.9 * 0.37 = 0.433
    assert adv[0].tolist() == pytest.approx([0.0, 0.433, 0.37, 0.3, 0.0])
    assert ret[0].tolist() == pytest.approx([0.0, 0.933, 0.97, 1.0, 0.0])
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    # A3 = 0.3; A2 = 0.5*0.7 - 0.6 + 0.5*0.3 = -0.1; A1 = 0.5*0.6 - 0.5 + 0.5*(-0.1) = -0.25
    assert adv[0].tolist() == pytest.approx([0.0, -0.25, -0.1, 0.3, 0.0])


def reference_loop(rewards, values, mask, gamma, lam):
    """The recursion written plainly, row by row over the model's tokens only, newest first."""
    adv = [[0.0] * len(row) for row in rewards]
    for i in range(len(rewards)):
        acts = [t for t in range(len(mask[i])) if mask[i][t] > 0]
        next_value, next_adv = 0.0, 0.0  # no value past the last model token
        for t in reversed(acts):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            adv[i][t] = delta + gamma * lam * next_adv
            next_value, next_adv = values[i][t], adv[i][t]
    return adv


@pytest.mark.parametrize("seed", range(5))
def test_equals_a_plain_loop_on_random_masked_batches(seed):
    rng = random.Random(seed)
    B, T = 6, 17
    mask = random_multiturn_mask(rng, B, T)
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g)
    rewards = token_rewards(torch.randn(B, generator=g), mask, kl=torch.rand(B, T, generator=g), kl_coef=0.1)
    gamma, lam = rng.choice([1.0, 0.99]), rng.choice([1.0, 0.95, 0.5])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    expect = torch.tensor(reference_loop(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam))
    assert torch.allclose(adv, expect, atol=1e-6)
    assert torch.allclose(ret, (expect + values) * mask, atol=1e-6)


def test_right_padded_rows_match_verls_recursion():
    """verl loops over every response position with values masked to 0 past the end; on right-padded
    rows (responses from position 0) that is the same recursion."""
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 1, 7]
    T = 9
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    values = torch.randn(4, T, generator=g) * mask
    rewards = token_rewards(torch.randn(4, generator=g), mask)
    gamma, lam = 0.99, 0.95
    lastgaelam, out = torch.zeros(4), []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        out.append(lastgaelam)
    verl = torch.stack(out[::-1], dim=1) * mask
    assert torch.allclose(gae(rewards, values, mask, gamma, lam)[0], verl, atol=1e-6)


def test_token_rewards_put_the_outcome_last_and_the_kl_everywhere():
    mask = torch.tensor([[0.0, 1, 1, 0], [1.0, 1, 1, 1], [0.0, 0, 0, 0]])
    kl = torch.full((3, 4), 0.5)
    r = token_rewards(torch.tensor([2.0, -1.0, 3.0]), mask, kl=kl, kl_coef=0.2)
    assert r.flatten().tolist() == pytest.approx([0.0, -0.1, 1.9, 0.0, -0.1, -0.1, -0.1, -1.1, 0.0, 0.0, 0.0, 0.0])


def test_masked_whiten_uses_the_masked_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expect = (kept - kept.mean()) / kept.std()  # unbiased, as verl's masked_whiten
    w = masked_whiten(x, mask)
    assert w[mask > 0].tolist() == pytest.approx(expect.tolist(), abs=1e-6) and w[mask == 0].tolist() == [0.0, 0.0]
    assert masked_whiten(x, mask, shift_mean=False)[mask > 0].tolist() == pytest.approx(
        (expect + kept.mean()).tolist(), abs=1e-6)
