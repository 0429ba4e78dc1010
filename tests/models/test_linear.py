"""relayrl.models.linear: oneDNN's fp32 CPU linear equals torch's F.linear to fp32 rounding (outputs and every
gradient), with any mix of the two kernels over its three products; only where it applies; below MIN_MACS or
MIN_FEATURES, under autocast and for DTensors it is F.linear itself; a model built of it matches the same model on
torch's kernels; and it runs the products the choice it is handed names (use_kernels; the choice itself is made
by relayrl.parallel.cpu_kernels: tests/parallel/test_cpu_kernels.py).

The tests fix the choice (all three products on oneDNN unless a test says otherwise): which kernel this machine
measures faster is not theirs to depend on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relayrl.models import linear as lin
from relayrl.models.linear import Linear, linear, uses_onednn

from helpers import small_config

pytestmark = pytest.mark.skipif(not lin._ONEDNN, reason="torch without oneDNN")


@pytest.fixture(autouse=True)
def all_on_onednn(monkeypatch):
    monkeypatch.setattr(lin, "_choice", dict.fromkeys(lin.PRODUCTS, True))


def close(a, b, rel=1e-5):
    assert (a - b).abs().max() <= rel * b.abs().max(), ((a - b).abs().max(), b.abs().max())


@pytest.mark.equivalence
@pytest.mark.parametrize("shape, n, bias", [((2, 300, 512), 384, True), ((1024, 256), 512, False),
                                           ((64, 1536), 512, True)])
@pytest.mark.parametrize("on", ["fwd dx dw", "fwd", "dx dw", "dw"])
def test_onednn_linear_equals_torch_in_output_and_gradients(shape, n, bias, on, monkeypatch):
    monkeypatch.setattr(lin, "_choice", {p: p in on.split() for p in lin.PRODUCTS})
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(n, shape[-1], generator=g) / shape[-1] ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    up = torch.randn(*shape[:-1], n, generator=g)
    assert uses_onednn(x, w) == ("fwd" in on) and lin.applies(x, w)
    grads = []
    for fn in (linear, F.linear):
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        bs = b.clone().requires_grad_(True) if bias else None
        y = fn(xs, ws, bs)
        (y * up).sum().backward()
        grads.append((y.detach(), xs.grad, ws.grad, bs.grad if bias else None))
    (y1, dx1, dw1, db1), (y0, dx0, dw0, db0) = grads
    close(y1, y0)
    close(dx1, dx0)
    close(dw1, dw0)
    if bias:
        close(db1, db0)
    # a frozen weight (a reference model, a LoRA base) takes no weight gradient; no grad at all runs the kernel alone
    xs = x.clone().requires_grad_(True)
    linear(xs, w, b).sum().backward()
    close(xs.grad, (torch.ones(*shape[:-1], n) @ w).reshape(shape))
    with torch.no_grad():
        close(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.unit
def test_where_it_does_not_apply_it_is_torchs_own():
    g = torch.Generator().manual_seed(1)
    small_x, small_w = torch.randn(16, 32, generator=g), torch.randn(32, 32, generator=g)
    big_x, big_w = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
    assert not uses_onednn(small_x, small_w) and uses_onednn(big_x, big_w)
    narrow_x, narrow_w = torch.randn(8192, 128, generator=g), torch.randn(512, 128, generator=g)  # the demo's width
    assert narrow_x.numel() * narrow_w.shape[0] >= lin.MIN_MACS and not uses_onednn(narrow_x, narrow_w)
    assert not uses_onednn(big_x, torch.randn(128, 512, generator=g))
    assert torch.equal(linear(small_x, small_w), F.linear(small_x, small_w))  # the tests' tiny models
    assert not uses_onednn(big_x.double(), big_w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(big_x, big_w)
        assert torch.equal(linear(big_x, big_w), F.linear(big_x, big_w))


@pytest.mark.equivalence
def test_a_model_on_onednn_matches_torchs_kernels(monkeypatch):
    """A CausalLM wide enough to take oneDNN: logits and every parameter gradient match the same model run with
    oneDNN turned off (MIN_MACS out of reach)."""
    from relayrl.models.transformer import CausalLM

    cfg = small_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Linear)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(2))
    assert uses_onednn(torch.empty(4 * 64, 256), model.model.layers[0].mlp.up_proj.weight)
    out = []
    for min_macs in (lin.MIN_MACS, 1 << 62):
        monkeypatch.setattr(lin, "MIN_MACS", min_macs)
        model.zero_grad()
        logits = model(ids)
        logits.log_softmax(-1)[..., 0].sum().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l1, g1), (l0, g0) = out
    close(l1, l0)
    for n in g0:
        close(g1[n], g0[n], rel=1e-4)


@pytest.mark.unit
def test_row_buckets_by_hand():
    """oneDNN compiles a kernel per shape: rows are padded to few buckets, at most 1/16 more rows."""
    from relayrl.models.linear import bucket

    assert [bucket(r) for r in (1, 63, 64, 65, 100, 128, 129, 600, 1000, 1024, 1025)] == \
        [1, 63, 64, 68, 100, 128, 136, 608, 1024, 1024, 1088]
    assert all(r <= bucket(r) <= r * 17 / 16 and bucket(bucket(r)) == bucket(r) for r in range(1, 5000))
    assert len({bucket(r) for r in range(1025, 2049)}) == 16  # 1088, 1152, ..., 2048


@pytest.mark.unit
def test_outputs_are_no_views():
    """Like F.linear's, the output is no view (FSDP2 warns when a module returns one): padded or not, 2-D or 3-D."""
    w = torch.randn(512, 512, requires_grad=True)
    for shape in ((601, 512), (608, 512), (2, 301, 512)):
        x = torch.randn(*shape, requires_grad=True)
        assert uses_onednn(x, w)
        y = linear(x, w)
        assert y._base is None and y.shape == (*shape[:-1], 512)
        y.sum().backward()
        close(x.grad, torch.ones(*shape[:-1], 512) @ w.detach())


@pytest.mark.unit
def test_use_kernels_sets_what_runs(monkeypatch):
    """The choice handed to use_kernels is the one the linears run, product by product (kernels() reports it);
    a choice that does not name each product is refused."""
    x, w = torch.randn(700, 512), torch.randn(512, 512)
    lin.use_kernels({"fwd": False, "dx": True, "dw": False})
    assert lin.kernels() == {"fwd": False, "dx": True, "dw": False}
    assert [uses_onednn(x, w, p) for p in lin.PRODUCTS] == [False, True, False]
    with pytest.raises(ValueError, match="a kernel choice names each of fwd, dx, dw"):
        lin.use_kernels({"fwd": True, "dx": True})
    assert lin.kernels() == {"fwd": False, "dx": True, "dw": False}


@pytest.mark.unit
def test_all_on_torch_is_f_linear_itself(monkeypatch):
    """With every product on torch's kernel (the choice on a machine where MKL is at full rate) the layer is
    F.linear, bit for bit, with and without gradients."""
    monkeypatch.setattr(lin, "_choice", dict.fromkeys(lin.PRODUCTS, False))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(700, 512, generator=g, requires_grad=True), torch.randn(512, 512, generator=g)
    assert lin.applies(x, w) and not uses_onednn(x, w, "dw")
    assert torch.equal(linear(x, w), F.linear(x, w))
    linear(x, w).sum().backward()
    dx = x.grad.clone()
    x.grad = None
    F.linear(x, w).sum().backward()
    assert torch.equal(dx, x.grad)
