"""Actor update: micro-batching, padding-free and the schedule against single-pass references."""

import copy
import math

import pytest
import torch

from relayrl.algorithms import AlgoConfig
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.optim import lr_factor

from helpers import random_train_batch

pytestmark = pytest.mark.unit


def _batch(model, n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = random_train_batch(n, generator=g)
    resp = b.response_mask
    actor = Actor(model, TrainerConfig(micro_batch_size=n), AlgoConfig(), total_steps=1)
    old = actor.compute_logprobs(b)
    # a rollout policy slightly off the trainer's, so the TIS weights are not all 1
    return b.replace(old_logp=old, rollout_logp=old + 0.05 * torch.randn(old.shape, generator=g) * resp)


def assert_grads_close(got, want, rel=1e-5):
    """fp32 equality up to summation order: error bounded relative to each tensor's scale."""
    for name in want:
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], atol=rel * scale, rtol=0, msg=name)


def _grads(model, batch, micro, agg, padding_free=False):
    m = copy.deepcopy(model)
    actor = Actor(m, TrainerConfig(micro_batch_size=micro, padding_free=padding_free),
                  AlgoConfig(agg=agg, kl_coef=0.1, entropy_coef=0.01), total_steps=1)
    actor.optimizer.zero_grad()
    # perturb weights so that ratios differ from 1 and clipping is live
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    batch = batch.replace(ref_logp=batch.old_logp - 0.1 * batch.response_mask)
    stats = actor.accumulate_grads(batch)
    return {n: p.grad.clone() for n, p in m.named_parameters()}, stats


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_reproduce_full_batch_gradient(tiny_model, agg):
    batch = _batch(tiny_model)
    torch.manual_seed(5)
    full, st_full = _grads(tiny_model, batch, micro=8, agg=agg)
    torch.manual_seed(5)
    split, st_split = _grads(tiny_model, batch, micro=3, agg=agg)
    assert_grads_close(split, full)
    assert math.isclose(st_split["loss"], st_full["loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert st_full["clip_frac"] > 0  # the perturbation made clipping active


def test_padding_free_gradient_equals_padded(tiny_model):
    batch = _batch(tiny_model)
    torch.manual_seed(5)
    padded, _ = _grads(tiny_model, batch, micro=4, agg="token-mean")
    torch.manual_seed(5)
    packed, _ = _grads(tiny_model, batch, micro=4, agg="token-mean", padding_free=True)
    assert_grads_close(packed, padded)


def test_update_moves_policy_toward_positive_advantage(tiny_model):
    batch = _batch(tiny_model)
    model = copy.deepcopy(tiny_model)
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=4, mini_batches=2, ppo_epochs=2)
    actor = Actor(model, cfg, AlgoConfig(), total_steps=1)
    before = actor.compute_logprobs(batch)
    stats = actor.update(batch)
    after = actor.compute_logprobs(batch)
    seq_gain = ((after - before) * batch.response_mask).sum(-1)
    # sequences with positive advantage gain likelihood on average; negative ones lose it
    assert seq_gain[batch.advantages > 0].mean() > 0 > seq_gain[batch.advantages < 0].mean()
    assert stats["grad_norm"] > 0 and stats["lr"] == pytest.approx(1e-3)


def test_bf16_autocast_close_to_fp32(tiny_model):
    batch = _batch(tiny_model)
    a32 = Actor(copy.deepcopy(tiny_model), TrainerConfig(), AlgoConfig(), total_steps=1)
    a16 = Actor(copy.deepcopy(tiny_model), TrainerConfig(bf16=True), AlgoConfig(), total_steps=1)
    gap = ((a32.compute_logprobs(batch) - a16.compute_logprobs(batch)) * batch.response_mask).abs().max()
    assert 0 < gap < 0.2
    assert all(p.dtype == torch.float32 for p in a16.model.parameters())


def test_schedule_hand_computed():
    cfg = TrainerConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    got = [lr_factor(s, cfg, total_steps=6) for s in range(7)]
    # warm-up 1/2, 2/2; then cosine over 4 steps from 1 to 0.1
    want = [0.5, 1.0, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55,
            0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.1]
    assert got == pytest.approx(want)


def test_sft_loss_is_answer_only_cross_entropy(tiny_model):
    from relayrl.trainer.sft import SFTTrainer

    prompts = [[5, 6, 7, 8], [9, 10]]
    answers = [[11, 12, 2], [13, 2]]
    ids, attn, resp = build_rows(prompts, answers)
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():  # reference: cross-entropy of each answer token given its prefix
        nll = []
        for p, a in zip(prompts, answers, strict=True):
            logits = model(torch.tensor([p + a]))[0]
            for j, t in enumerate(a):
                nll.append(torch.nn.functional.cross_entropy(logits[len(p) + j - 1][None], torch.tensor([t])))
        want = torch.stack(nll).mean()
    trainer = SFTTrainer(model, TrainerConfig(lr=1e-2, micro_batch_size=1), total_steps=10)
    stats = trainer.step(TrainBatch(ids, attn, resp))
    assert stats["sft/loss"] == pytest.approx(float(want), rel=1e-5)
    for _ in range(20):
        last = trainer.step(TrainBatch(ids, attn, resp))["sft/loss"]
    assert last < 0.2 * stats["sft/loss"]  # it learns the answers


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while fn runs (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def test_entropy_as_a_statistic_keeps_no_graph(tiny_model):
    """entropy_coef = 0: the entropy is reported, with the same values, but backward keeps nothing for it: the
    saved tensors are those of the logprobs alone (one [B, T, V] fp32 exp(log p) fewer, which the plan counts)."""
    from relayrl.trainer.logprobs import token_logprobs

    b = _batch(tiny_model)
    params = {p.untyped_storage().data_ptr() for p in tiny_model.parameters()}
    run = lambda **kw: token_logprobs(tiny_model, b.input_ids, b.attention_mask, 1.0, **kw)  # noqa: E731
    (lp_a, ent_a), with_grad = _saved_bytes(lambda: run(with_entropy=True))
    (lp_s, ent_s), stat = _saved_bytes(lambda: run(with_entropy=True, entropy_grad=False))
    (lp_0, _), none = _saved_bytes(lambda: run())
    torch.testing.assert_close(ent_s, ent_a.detach(), atol=0, rtol=0)
    torch.testing.assert_close(lp_s, lp_0, atol=0, rtol=0)
    assert ent_a.requires_grad and not ent_s.requires_grad
    kept = [sum(n for k, n in seen.items() if k not in params) for seen in (with_grad, stat, none)]
    assert kept[1] == kept[2]
    B, T = b.input_ids.shape
    assert kept[0] - kept[1] == B * (T - 1) * tiny_model.config.vocab_size * 4  # exp(log p), fp32, [B, T-1, V]
    # entropy_coef != 0 still trains the entropy: its gradient reaches the weights
    m = copy.deepcopy(tiny_model)
    ent = token_logprobs(m, b.input_ids, b.attention_mask, 1.0, with_entropy=True)[1]
    ent.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


def test_adamw_runs_the_fused_kernel_and_takes_the_reference_step(tiny_model):
    """build_optimizer picks the fused AdamW for plain tensors (adam_kernel), and its steps equal torch's
    per-tensor loop to fp32 rounding."""
    from relayrl.trainer.optim import build_optimizer

    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1)
    models = [copy.deepcopy(tiny_model) for _ in range(2)]
    opt, _ = build_optimizer(models[0], cfg, total_steps=10)
    assert opt.param_groups[0]["fused"] and not opt.param_groups[0]["foreach"]
    ref = torch.optim.AdamW(models[1].parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            eps=cfg.adam_eps, weight_decay=cfg.weight_decay, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in models[0].parameters()]
        for m, o in zip(models, (opt, ref), strict=True):
            for p, gr in zip(m.parameters(), grads, strict=True):
                p.grad = gr.clone()
            o.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=name)
