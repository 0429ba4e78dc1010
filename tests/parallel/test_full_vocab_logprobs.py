"""The whole-vocabulary token logprobs the trainer and the pipeline's last stage share
(relayrl.parallel.vocab_parallel.full_vocab_logprobs): at temperature 1 they skip the division, and that changes no
bit of the logprobs, the entropy or the gradient; at another temperature they are log_softmax(z / T) gathered, by
hand."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.parallel.vocab_parallel import full_vocab_logprobs

pytestmark = pytest.mark.unit


def _divided(logits, targets, temperature):  # the form before: always divide
    logp_all = (logits.float() / temperature).log_softmax(-1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_temperature_one_skips_the_division_bit_for_bit(entropy_grad):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 17, 257, generator=g)).requires_grad_()
    targets = torch.randint(0, 257, (3, 17), generator=g)
    w = torch.randn(3, 17, generator=g)
    logp, ent = full_vocab_logprobs(logits, targets, 1.0, with_entropy=True, entropy_grad=entropy_grad)
    assert ent.requires_grad == entropy_grad
    (grad,) = torch.autograd.grad((w * logp).sum() + (ent.sum() if entropy_grad else 0), logits)
    ref_logp, ref_ent = _divided(logits, targets, 1.0)
    (ref_grad,) = torch.autograd.grad((w * ref_logp).sum() + (ref_ent.sum() if entropy_grad else 0), logits)
    assert torch.equal(logp, ref_logp) and torch.equal(ent, ref_ent) and torch.equal(grad, ref_grad)


def test_other_temperatures_hand_computed():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    logp, ent = full_vocab_logprobs(logits, torch.tensor([[1]]), 0.5, with_entropy=True)
    z = [4.0, 0.0, -2.0]
    lse = math.log(sum(math.exp(v) for v in z))
    assert logp.item() == pytest.approx(0.0 - lse, rel=1e-6)
    assert ent.item() == pytest.approx(-sum(math.exp(v - lse) * (v - lse) for v in z), rel=1e-6)
    logp2, none = full_vocab_logprobs(logits.to(torch.bfloat16), torch.tensor([[0]]), 2.0)
    assert none is None and logp2.dtype == torch.float32
    assert logp2.item() == pytest.approx(1.0 - math.log(math.exp(1.0) + 1 + math.exp(-0.5)), rel=1e-6)
