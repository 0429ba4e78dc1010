"""relayrl.models.pointwise: the fused (compiled) RMSNorm, SwiGLU and RoPE equal their eager formulas to fp32
rounding, forward and every gradient, and a model built of them matches the same model run eagerly; where they do
not apply (small tensors, other dtypes, autocast, compiling handed off: RELAYRL_COMPILE=off) they are the eager
formula itself, and a compiler that fails leaves them eager with one warning."""

from __future__ import annotations

import pytest
import torch

from relayrl.models import pointwise as pw

from helpers import small_config


class CompilerFailed(torch._dynamo.exc.TorchDynamoException):
    pass


def close(a, b, rel=2e-6):
    assert (a - b).abs().max() <= rel * max(1.0, b.abs().max()), (a - b).abs().max()


def _cases(g):
    x = torch.randn(2, 300, 96, generator=g)
    q = torch.randn(2, 4, 300, 32, generator=g)
    cos, sin = torch.randn(2, 1, 300, 32, generator=g), torch.randn(2, 1, 300, 32, generator=g)
    return [("rms_norm", pw.rms_norm, pw._rms_norm, (x, torch.randn(96, generator=g), 1e-6)),
            ("swiglu", pw.swiglu, pw._swiglu, (x, torch.randn(2, 300, 96, generator=g))),
            ("rope", pw.rope, pw._rope, (q, cos, sin))]


@pytest.mark.equivalence
def test_fused_pieces_equal_the_eager_formulas(monkeypatch):
    monkeypatch.setattr(pw, "MIN_NUMEL", 1024)
    monkeypatch.setattr(pw, "_compile", True)
    g = torch.Generator().manual_seed(0)
    for name, fused, eager, args in _cases(g):
        assert pw.applies(args[0]), name
        outs = []
        for fn in (fused, eager):
            leaves = [a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
            y = fn(*leaves)
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
            outs.append((y.detach(), [a.grad for a in leaves if isinstance(a, torch.Tensor)]))
        (y1, g1), (y0, g0) = outs
        close(y1, y0)
        for a, b in zip(g1, g0, strict=True):
            close(a, b, rel=1e-5)
        with torch.no_grad():
            close(fused(*args), eager(*args))
    assert pw._broken is None and set(pw._compiled) >= {"rms_norm", "swiglu", "rope"}


@pytest.mark.equivalence
def test_a_model_on_fused_pieces_matches_eager(monkeypatch):
    from relayrl.models.transformer import CausalLM

    cfg = small_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(pw, "MIN_NUMEL", 1024)
    monkeypatch.setattr(pw, "_compile", True)  # restored after the test
    out = []
    for mode in ("auto", "off"):
        pw.use_compile(mode == "auto")
        model.zero_grad()
        logits = model(ids)
        logits.log_softmax(-1)[..., 0].sum().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert pw._broken is None  # the "auto" pass ran compiled, not the eager fallback
    (l1, g1), (l0, g0) = out
    close(l1, l0, rel=1e-5)
    for n in g0:
        close(g1[n], g0[n], rel=1e-4)


@pytest.mark.unit
def test_where_it_does_not_apply_it_is_the_eager_formula(monkeypatch):
    g = torch.Generator().manual_seed(2)
    big = torch.randn(pw.MIN_NUMEL, generator=g)
    monkeypatch.setattr(pw, "_compile", True)
    assert pw.applies(big) and not pw.applies(big[:100]) and not pw.applies(big.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not pw.applies(big)
    with torch.inference_mode():  # the rollout engine's forward: no compile stalls a rollout step
        assert not pw.applies(big)
    with torch.no_grad():  # the trainer's forward without gradients (old logprobs, the reference) still fuses
        assert pw.applies(big)
    pw.use_compile(False)  # what RELAYRL_COMPILE=off hands the models (relayrl.parallel.cpu_kernels)
    assert not pw.applies(big) and not pw.enabled()
    assert torch.equal(pw.rms_norm(big.reshape(-1, 64), torch.ones(64), 1e-5),
                       pw._rms_norm(big.reshape(-1, 64), torch.ones(64), 1e-5))
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    assert torch.equal(pw.rms_norm(x, w, 1e-5), pw._rms_norm(x, w, 1e-5))


@pytest.mark.unit
def test_a_failing_compiler_leaves_the_pieces_eager_with_one_warning(monkeypatch):
    def broken(*a, **k):  # what inductor raises without a C++ compiler derives from TorchDynamoException
        raise CompilerFailed("no C++ compiler\nmore")

    monkeypatch.setattr(pw, "_compiled", {"swiglu": broken})
    monkeypatch.setattr(pw, "_broken", None)
    monkeypatch.setattr(pw, "MIN_NUMEL", 16)
    monkeypatch.setattr(pw, "_compile", True)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    with pytest.warns(UserWarning, match=r"torch.compile failed \(CompilerFailed: no C\+\+ compiler\)"):
        y = pw.swiglu(a, b)
    assert torch.equal(y, pw._swiglu(a, b)) and not pw.enabled() and not pw.applies(a)


@pytest.mark.unit
def test_inductors_errors_are_the_ones_caught():
    """A missing C++ compiler surfaces as inductor's InductorError (seen with CXX=/nonexistent); the fallback
    catches TorchDynamoException, so it must stay a subclass of it."""
    from torch._inductor.exc import InductorError

    assert issubclass(InductorError, torch._dynamo.exc.TorchDynamoException)


@pytest.mark.unit
def test_an_error_that_is_not_the_compilers_propagates_and_keeps_compiling(monkeypatch):
    def wrong_input(*a, **k):
        raise RuntimeError("The size of tensor a (8) must match the size of tensor b (4)")

    monkeypatch.setattr(pw, "_compiled", {"swiglu": wrong_input})
    monkeypatch.setattr(pw, "_broken", None)
    monkeypatch.setattr(pw, "MIN_NUMEL", 16)
    monkeypatch.setattr(pw, "_compile", True)
    a = torch.randn(8, 8)
    with pytest.raises(RuntimeError, match="must match"):
        pw.swiglu(a, a)
    assert pw.enabled() and pw._broken is None
