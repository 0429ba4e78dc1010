"""relayrl.algorithms: every function against a case whose numbers are worked out here by hand."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms import (
    AlgoConfig,
    aggregate,
    entropy_from_logits,
    get_advantage,
    get_aggregation,
    get_loss,
    group_has_signal,
    kl_penalty,
    masked_is_sequences,
    mismatch_stats,
    no_signal_fraction,
    policy_objective,
    register_loss,
    select_signal_groups,
    truncated_is_weights,
)
from relayrl.errors import ConfigError

from helpers import advantages_of

pytestmark = pytest.mark.unit

D = torch.float64


def t(x, **kw):
    return torch.tensor(x, dtype=D, **kw)


def close(a, b, tol=1e-9):
    a = a if isinstance(a, torch.Tensor) else t(a)
    b = b if isinstance(b, torch.Tensor) else t(b)
    torch.testing.assert_close(a.to(D), b.to(D), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- registry


def test_unknown_names_list_known_ones():
    with pytest.raises(ValueError, match=r"unknown loss 'nope'; known: .*gspo, .*ppo"):
        get_loss("nope")
    with pytest.raises(ValueError, match=r"dr_grpo, gae, grpo, .*rloo"):
        get_advantage("ppo")
    with pytest.raises(ValueError, match=r"seq-mean-token-mean"):
        get_aggregation("mean")


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_loss("ppo")(lambda *a, **k: None)


# ----------------------------------------------------------------------------- advantages

REWARDS = t([1, 0, 0, 1, 2, 2, 2, 2])


def test_grpo_hand_computed():
    # group 1: mean 0.5, deviations +-0.5, sample std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # = 0.86602...
    close(advantages_of("grpo", REWARDS, 4), [a, -a, -a, a, 0, 0, 0, 0])
    # a lopsided group of 3: [0, 1, 5], mean 2, deviations [-2, -1, 3], var = (4+1+9)/2 = 7
    s = math.sqrt(7) + 1e-6
    close(advantages_of("grpo", t([0, 1, 5]), 3), [-2 / s, -1 / s, 3 / s])


def test_dr_grpo_is_centered_only():
    close(advantages_of("dr_grpo", REWARDS, 4), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    close(advantages_of("grpo", REWARDS, 4, norm_std=False), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    close(advantages_of("dr_grpo", t([0, 1, 5]), 3, norm_std=True), [-2, -1, 3])


def test_rloo_leave_one_out():
    # r_i - mean of the other three: 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3
    close(advantages_of("rloo", REWARDS, 4), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0])
    # [0, 1, 5]: 0 - 3, 1 - 2.5, 5 - 0.5
    close(advantages_of("rloo", t([0, 1, 5]), 3, norm_std=True), [-3, -1.5, 4.5])


def test_advantages_reject_partial_groups():
    for name in ("grpo", "dr_grpo", "rloo"):
        with pytest.raises(ValueError, match="whole number of groups"):
            advantages_of(name, t([1, 0, 1]), 2)


# ----------------------------------------------------------------------------- aggregation

VALUES = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_aggregation_modes_hand_computed():
    # masked values: row0 {1, 2}, row1 {4}, row2 {} (no tokens)
    close(aggregate(VALUES, MASK, "token-mean"), 7 / 3)  # (1+2+4)/3
    close(aggregate(VALUES, MASK, "seq-mean-token-sum"), 7 / 3)  # (3 + 4 + 0)/3
    close(aggregate(VALUES, MASK, "seq-mean-token-mean"), 5.5 / 3)  # (1.5 + 4 + 0)/3, no NaN
    close(aggregate(VALUES[:2], MASK[:2], "seq-mean-token-sum"), 3.5)  # (3 + 4)/2
    close(aggregate(VALUES[:2], MASK[:2], "seq-mean-token-mean"), 2.75)  # (1.5 + 4)/2
    # explicit denominators replace the counts
    close(aggregate(VALUES, MASK, "token-mean", num_tokens=10.0), 0.7)
    close(aggregate(VALUES, MASK, "seq-mean-token-mean", num_seqs=11.0), 0.5)
    # nothing masked in: 0, not NaN
    close(aggregate(VALUES, torch.zeros_like(MASK), "token-mean"), 0.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_microbatches_with_global_denominators_sum_to_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5, 6, generator=g, dtype=D)
    mask = t([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    full = aggregate(values, mask, mode)
    n_tok, n_seq = mask.sum(), mask.shape[0]
    parts = [aggregate(values[s], mask[s], mode, num_tokens=n_tok, num_seqs=n_seq) for s in (slice(0, 2), slice(2, 5))]
    close(sum(parts), full, tol=1e-12)


# ----------------------------------------------------------------------------- PPO

def _ppo_case():
    # ratios: seq0 (A=+1) [1.5, 0.9, 1.0]; seq1 (A=-1) [0.5, 1.1, 2.0], last token masked out
    old = t([[-1.0, -2.0, -0.5], [-1.2, -0.3, -2.5]])
    ratios = t([[1.5, 0.9, 1.0], [0.5, 1.1, 2.0]])
    logp = (old + ratios.log()).requires_grad_()
    mask = t([[1, 1, 1], [1, 1, 0]])
    return logp, old, t([1.0, -1.0]), mask


def test_ppo_clip_hand_computed():
    logp, old, adv, mask = _ppo_case()
    # clip range [0.8, 1.28]
    # seq0 A=+1: 1.5 -> min(1.5, 1.28) = 1.28 (clipped); 0.9 -> 0.9; 1.0 -> 1.0  => losses -1.28, -0.9, -1.0
    # seq1 A=-1: 0.5 -> min(-0.5, -0.8) = -0.8 (clipped); 1.1 -> -1.1              => losses  0.8,  1.1
    # token-mean over 5 tokens: (-1.28 - 0.9 - 1.0 + 0.8 + 1.1) / 5 = -0.256
    loss, stats = get_loss("ppo")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="token-mean")
    close(loss, -0.256)
    close(stats["clip_frac"], 2 / 5)
    close(stats["ratio_mean"], (1.5 + 0.9 + 1.0 + 0.5 + 1.1) / 5)
    close(stats["ratio_max"], 1.5)
    assert all(not v.requires_grad for v in stats.values())
    # gradient: d(-ratio*A)/dlogp = -ratio*A on unclipped tokens, 0 on clipped and masked ones, /5
    loss.backward()
    close(logp.grad, t([[0.0, -0.9 / 5, -1.0 / 5], [0.0, 1.1 / 5, 0.0]]))


def test_ppo_other_aggregations_is_weights_and_token_advantages():
    logp, old, adv, mask = _ppo_case()
    kw = dict(clip_low=0.2, clip_high=0.28)
    # per-token losses [[-1.28, -0.9, -1.0], [0.8, 1.1, -]]
    loss, _ = get_loss("ppo")(logp, old, adv, mask, agg="seq-mean-token-sum", **kw)
    close(loss, ((-1.28 - 0.9 - 1.0) + (0.8 + 1.1)) / 2)
    loss, _ = get_loss("ppo")(logp, old, adv, mask, agg="seq-mean-token-mean", **kw)
    close(loss, ((-1.28 - 0.9 - 1.0) / 3 + (0.8 + 1.1) / 2) / 2)
    # is_weights rescale each token's loss: (-2.56 - 0.9 - 1.0 + 0.4 + 1.1) / 5
    w = t([[2.0, 1.0, 1.0], [0.5, 1.0, 7.0]])
    loss, _ = get_loss("ppo")(logp, old, adv, mask, agg="token-mean", is_weights=w, **kw)
    close(loss, (-2.56 - 0.9 - 1.0 + 0.4 + 1.1) / 5)
    # [B, T] advantages equal to the broadcast [B] ones give the same loss
    loss_bt, _ = get_loss("ppo")(logp, old, adv[:, None].expand(2, 3), mask, agg="token-mean", **kw)
    close(loss_bt, -0.256)


def test_ppo_ignores_garbage_at_masked_positions():
    logp, old, adv, mask = _ppo_case()
    old = old.clone()
    old[1, 2] = -float("inf")  # ratio would be inf there
    loss, stats = get_loss("ppo")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="token-mean")
    close(loss, -0.256)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and torch.isfinite(stats["ratio_max"])


# ----------------------------------------------------------------------------- GSPO

def _gspo_case():
    old = t([[-1.0, -2.0, -0.5], [-1.2, -0.3, -2.5], [-0.7, -0.1, -3.0]])
    log_ratios = t([[0.1, -0.2, 0.4], [0.3, 0.5, 9.0], [0.5, 0.5, 0.5]])
    logp = (old + log_ratios).requires_grad_()
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    return logp, old, t([1.0, -1.0, 1.0]), mask


def test_gspo_sequence_ratio_is_geometric_mean():
    logp, old, adv, mask = _gspo_case()
    # s_i = (prod_t r_t)^(1/n_i):  s0 = (e^0.1 e^-0.2 e^0.4)^(1/3) = e^0.1,  s1 = e^0.4,  s2 = e^0.5
    s0 = (math.exp(0.1) * math.exp(-0.2) * math.exp(0.4)) ** (1 / 3)
    s1 = (math.exp(0.3) * math.exp(0.5)) ** (1 / 2)
    s2 = math.exp(0.5)
    close(s0, math.exp(0.1))
    # clip range [0.8, 1.28]: s0 = 1.105 unclipped (A=+1); s1 = 1.492 with A=-1: min(-1.492, -1.28)
    # = -1.492 unclipped; s2 = 1.649 with A=+1: min(1.649, 1.28) = 1.28 clipped.
    # seq-mean-token-mean: every token of seq i carries -min(...), so each sequence mean is that value
    loss, stats = get_loss("gspo")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean")
    close(loss, (-s0 + s1 - 1.28) / 3)
    close(stats["ratio_mean"], (s0 + s1 + s2) / 3)
    close(stats["ratio_max"], s2)
    close(stats["clip_frac"], 3 / 8)  # seq2's 3 tokens of 8 masked tokens
    # analytic gradient of -(1/B) sum_i A_i s_i:  d/dlogp_it = -A_i s_i / (B n_i) (0 if clipped/masked)
    loss.backward()
    expect = t([[-s0 / 9] * 3, [s1 / 6, s1 / 6, 0.0], [0.0, 0.0, 0.0]])
    close(logp.grad, expect)


def test_gspo_gradient_matches_finite_difference():
    logp, old, adv, mask = _gspo_case()
    kw = dict(clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean")
    loss, _ = get_loss("gspo")(logp, old, adv, mask, **kw)
    loss.backward()
    h = 1e-6
    for i, j in [(0, 0), (0, 2), (1, 1), (1, 2), (2, 1)]:
        plus, minus = logp.detach().clone(), logp.detach().clone()
        plus[i, j] += h
        minus[i, j] -= h
        gspo = get_loss("gspo")
        fd = (gspo(plus, old, adv, mask, **kw)[0] - gspo(minus, old, adv, mask, **kw)[0]) / (2 * h)
        close(logp.grad[i, j], fd, tol=1e-7)


# ----------------------------------------------------------------------------- KL and entropy

def test_kl_estimators_hand_computed():
    logp, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])  # log-ratio l = [0.5, -1.0]
    close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5]])  # l^2 / 2
    close(kl_penalty(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0]])  # e^-l + l - 1
    # the log-ratio is clamped to +-20
    close(kl_penalty(t([[30.0]]), t([[0.0]]), "k1"), [[20.0]])
    close(kl_penalty(t([[-30.0]]), t([[0.0]]), "k3"), [[math.exp(20) - 21]])
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_k1_and_k3_expectations_are_exact_kl():
    # p = [1/2, 1/4, 1/4], q = [1/4, 1/2, 1/4]:  KL(p||q) = 1/2 ln 2 + 1/4 ln(1/2) = 1/4 ln 2
    p, q = t([[0.5, 0.25, 0.25]]), t([[0.25, 0.5, 0.25]])
    for kind in ("k1", "k3"):
        close((p * kl_penalty(p.log(), q.log(), kind)).sum(), 0.25 * math.log(2))


def test_entropy_hand_computed():
    logits = t([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # p = [1/2, 1/2] and [3/4, 1/4]
    h2 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    close(entropy_from_logits(logits), [[math.log(2.0), h2]])
    # shift-invariant and finite for huge / peaked logits
    close(entropy_from_logits(logits + 1e4), [[math.log(2.0), h2]], tol=1e-6)
    assert entropy_from_logits(t([[[1000.0, 0.0]]])).abs().item() < 1e-12
    out = entropy_from_logits(logits.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and abs(out[0, 0].item() - math.log(2)) < 1e-2


# ----------------------------------------------------------------------------- IS correction

def test_truncated_is_weights():
    rollout = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    old = rollout + t([[0.5, -0.5, 2.0], [0.1, 0.0, 50.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    w = truncated_is_weights(old.requires_grad_(), rollout, mask, cap=2.0)
    # exp(0.5), exp(-0.5), min(e^2, 2) = 2 | exp(0.1), 1, masked -> 0
    close(w, [[math.exp(0.5), math.exp(-0.5), 2.0], [math.exp(0.1), 1.0, 0.0]])
    assert not w.requires_grad


def test_masked_is_sequences_band():
    rollout = torch.zeros(4, 2, dtype=D)
    old = t([[0.1, 0.3], [-1.0, -1.0], [0.0, 0.02], [5.0, 5.0]])
    mask = t([[1, 1], [1, 1], [1, 1], [0, 0]])
    # rho = exp(mean): e^0.2 = 1.221, e^-1 = 0.368, e^0.01 = 1.010, no tokens -> 1
    keep = masked_is_sequences(old, rollout, mask, low=0.5, high=1.1)
    close(keep, [0.0, 0.0, 1.0, 1.0])
    close(masked_is_sequences(old, rollout, mask, low=0.3, high=1.3), [1.0, 1.0, 1.0, 1.0])


def test_mismatch_stats():
    rollout = torch.zeros(2, 2, dtype=D)
    old = t([[0.5, -1.0], [0.2, 9.0]])
    mask = t([[1, 1], [1, 0]])
    s = mismatch_stats(old, rollout, mask)
    close(s["mismatch/logp_abs_mean"], (0.5 + 1.0 + 0.2) / 3)
    close(s["mismatch/logp_abs_max"], 1.0)
    k3 = [math.exp(x) - x - 1 for x in (0.5, -1.0, 0.2)]  # w - log w - 1
    close(s["mismatch/k3"], sum(k3) / 3)


# ----------------------------------------------------------------------------- filtering

def test_group_filtering():
    rewards = t([1, 1, 1, 0, 1, 0, 2, 2, 2 + 1e-9, 0, 0, 3])
    assert group_has_signal(rewards, 3).tolist() == [False, True, False, True]
    assert no_signal_fraction(rewards, 3) == 0.5
    idx = select_signal_groups(rewards, 3)
    assert idx.dtype == torch.long and idx.tolist() == [3, 4, 5, 9, 10, 11]
    assert select_signal_groups(t([1, 1, 2, 2]), 2).tolist() == []


# ----------------------------------------------------------------------------- config

def test_algo_config_defaults_and_errors():
    cfg = AlgoConfig()
    assert (cfg.advantage, cfg.loss, cfg.agg, cfg.clip_low, cfg.clip_high, cfg.tis_cap) == (
        "grpo", "ppo", "token-mean", 0.2, 0.28, 2.0)
    assert AlgoConfig.from_dict({"tis_cap": None, "mis_low": 0.5, "mis_high": 2.0}).uses_mis
    bad = [
        ({"clip_lo": 0.2}, "unknown key 'clip_lo'"),
        ({"clip_low": 0.0}, "clip_low"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"loss": "ppo2"}, "loss: .*unknown loss 'ppo2'; known: .*gspo, .*ppo"),
        ({"advantage": "gae2"}, "advantage: .*known: dr_grpo, gae, grpo, .*rloo"),
        ({"agg": "mean"}, "agg"),
        ({"kl_kind": "k9"}, "kl_kind"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"mis_low": 0.5}, "mis_low and mis_high"),
        ({"mis_low": 2.0, "mis_high": 1.0}, "mis_low"),
        ({"max_resample_rounds": -1}, "max_resample_rounds"),
        ({"norm_std": "yes"}, "norm_std"),
    ]
    for data, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            AlgoConfig.from_dict(data)


# ----------------------------------------------------------------------------- objective

def _objective_case():
    # ratio 1 everywhere (logp == old_logp), A = [+1, -1]: ppo per-token losses [[-1, -1], [1, -]]
    old = t([[-1.0, -2.0], [-0.5, -3.0]])
    logp = old.clone().requires_grad_()
    mask = t([[1, 1], [1, 0]])
    rollout = old - t([[math.log(1.5), math.log(3.0)], [0.0, 4.0]])  # w = [[1.5, 3 -> cap 2], [1, -]]
    ref = old - 0.5  # l = 0.5: k3 = e^-0.5 - 0.5
    entropy = t([[1.0, 2.0], [3.0, 4.0]])
    return logp, old, t([1.0, -1.0]), mask, rollout, ref, entropy


def test_policy_objective_with_tis_kl_entropy():
    logp, old, adv, mask, rollout, ref, ent = _objective_case()
    cfg = AlgoConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    loss, st = policy_objective(logp, old, adv, mask, cfg, rollout_logp=rollout, ref_logp=ref, entropy=ent)
    k3 = math.exp(-0.5) - 0.5
    policy = (-1.5 - 2.0 + 1.0) / 3  # weighted token-mean
    close(st["loss/policy"], policy)
    close(st["loss/kl"], k3)
    close(st["kl"], k3)
    close(st["entropy"], 2.0)  # (1 + 2 + 3) / 3
    close(st["is/weight_mean"], 1.5)  # (1.5 + 2 + 1) / 3
    close(st["is/masked_seq_frac"], 0.0)
    close(st["clip_frac"], 0.0)
    close(loss, policy + 0.1 * k3 - 0.01 * 2.0)
    assert all(not v.requires_grad for v in st.values())


def test_policy_objective_mis_drops_sequences_but_keeps_denominators():
    logp, old, adv, mask, rollout, ref, ent = _objective_case()
    # seq0 rho = sqrt(1.5 * 3) = 2.12 > 2.0 -> dropped; seq1 rho = 1 -> kept
    cfg = AlgoConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, mis_low=0.5, mis_high=2.0)
    loss, st = policy_objective(logp, old, adv, mask, cfg, rollout_logp=rollout, ref_logp=ref, entropy=ent)
    k3 = math.exp(-0.5) - 0.5
    # only token (1,0) remains; denominators still the original 3 tokens
    close(st["loss/policy"], 1.0 / 3)
    close(st["is/masked_seq_frac"], 0.5)
    close(st["is/weight_mean"], 1.0)
    close(st["entropy"], 2.0)  # stats describe the whole batch
    close(loss, 1.0 / 3 + 0.1 * k3 / 3 - 0.01 * 3.0 / 3)


def test_policy_objective_without_optional_inputs():
    logp, old, adv, mask, *_ = _objective_case()
    loss, st = policy_objective(logp, old, adv, mask, AlgoConfig(kl_coef=0.5))
    close(loss, -1.0 / 3)
    close(st["loss/kl"], 0.0)
    close(st["is/weight_mean"], 1.0)
    assert "kl" not in st and "entropy" not in st


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_objective_microbatches_sum_to_full_batch(loss_name, agg):
    g = torch.Generator().manual_seed(1)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=g, dtype=D) * 3
    logp0 = old + 0.3 * torch.randn(B, T, generator=g, dtype=D)
    rollout = old + 0.4 * torch.randn(B, T, generator=g, dtype=D)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    ent0 = torch.rand(B, T, generator=g, dtype=D)
    adv = t([1.0, -0.5, 0.0, 2.0])
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    cfg = AlgoConfig(loss=loss_name, agg=agg, kl_coef=0.1, entropy_coef=0.01, tis_cap=1.5, mis_low=0.6, mis_high=1.6)

    def run(rows, **denoms):
        logp = logp0[rows].clone().requires_grad_()
        ent = ent0[rows].clone().requires_grad_()
        loss, _ = policy_objective(logp, old[rows], adv[rows], mask[rows], cfg,
                                   rollout_logp=rollout[rows], ref_logp=ref[rows], entropy=ent, **denoms)
        loss.backward()
        return loss, logp.grad, ent.grad

    full, g_logp, g_ent = run(slice(0, B))
    denoms = dict(num_tokens=mask.sum(), num_seqs=B)
    parts = [run(s, **denoms) for s in (slice(0, 1), slice(1, 4))]
    close(sum(p[0] for p in parts), full, tol=1e-12)
    close(torch.cat([p[1] for p in parts]), g_logp, tol=1e-12)
    close(torch.cat([p[2] for p in parts]), g_ent, tol=1e-12)
