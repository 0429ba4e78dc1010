"""relayrl.parallel.vocab_parallel.token_logprobs_from_logits (whole vocabulary, its own backward) equals
log_softmax + gather + autograd: logprobs, entropies and the logits' gradient, at and away from temperature 1, on
padded [B, T, V] slices and packed [N, V] rows, with and without a graph."""

from __future__ import annotations

import pytest
import torch

from relayrl.parallel.vocab_parallel import token_logprobs_from_logits


def reference(logits, targets, temperature):
    logp_all = (logits.float() / temperature).log_softmax(-1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def close(a, b, tol=2e-6):
    assert (a - b).abs().max() <= tol * max(1.0, b.abs().max()), (a - b).abs().max()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("shape", [(3, 9, 257), (40, 1000)])
def test_equals_log_softmax_gather_in_values_and_gradients(temperature, shape):
    g = torch.Generator().manual_seed(0)
    base = 4 * torch.randn(*shape[:-1], shape[-1] + 1, generator=g)
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    up = torch.randn(shape[:-1], generator=g)
    out = []
    for fn in (token_logprobs_from_logits, None):
        leaf = base.clone().requires_grad_(True)
        logits = leaf[..., :-1]  # a strided slice, as the padded path's logits[:, :-1]
        if fn is None:
            logp, ent = reference(logits, targets, temperature)
        else:
            logp, ent = fn(logits, targets, temperature, with_entropy=True, entropy_grad=False)
            assert not ent.requires_grad
        (logp * up).sum().backward()
        out.append((logp.detach(), ent.detach(), leaf.grad))
    (lp1, e1, g1), (lp0, e0, g0) = out
    close(lp1, lp0)
    close(e1, e0)
    close(g1, g0)
    assert g1[..., -1].abs().max() == 0  # the slice's outside takes no gradient


def test_without_a_graph_and_without_entropy():
    g = torch.Generator().manual_seed(1)
    logits, targets = torch.randn(50, 300, generator=g), torch.randint(0, 300, (50,), generator=g)
    with torch.no_grad():
        logp, ent = token_logprobs_from_logits(logits, targets, 1.3, with_entropy=True, entropy_grad=False)
        logp2, none = token_logprobs_from_logits(logits, targets, 1.3)
    ref_lp, ref_ent = reference(logits, targets, 1.3)
    close(logp, ref_lp)
    close(ent, ref_ent)
    assert none is None and torch.equal(logp, logp2)


def test_entropy_with_gradient_takes_autograds_form():
    """entropy_coef != 0: the entropy carries gradient, exactly the autograd form's."""
    g = torch.Generator().manual_seed(2)
    base, targets = torch.randn(20, 64, generator=g), torch.randint(0, 64, (20,), generator=g)
    grads = []
    for fn in (lambda x: token_logprobs_from_logits(x, targets, 1.0, with_entropy=True, entropy_grad=True),
               lambda x: reference(x, targets, 1.0)):
        x = base.clone().requires_grad_(True)
        logp, ent = fn(x)
        (logp.sum() + 0.1 * ent.sum()).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_bf16_logits_are_computed_in_fp32():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 100, generator=g).bfloat16()
    targets = torch.randint(0, 100, (8,), generator=g)
    logp, _ = token_logprobs_from_logits(logits, targets)
    assert logp.dtype == torch.float32
    close(logp, reference(logits, targets, 1.0)[0])
