"""This module is the models' linear layer: nn.Linear, with the CPU's fp32 matmuls run by oneDNN where that is
faster than torch's default.

Why: torch's CPU wheels run an fp32 matmul through MKL's sgemm, which on AMD CPUs takes its AVX2 path. On an
AVX-512 core with full-width FMA units (AMD Zen 5, recent Intel) that is half the core's fp32 rate; oneDNN, which
torch ships too, JIT-compiles AVX-512 kernels and reaches it (benchmarks/bench_linear.py measures both, side by
side). The numbers are fp32 either way; the sums run in another order, so results differ from MKL's at fp32
rounding (about 1e-6 relative: tests/test_linear.py).

    y  = x W^T + b          oneDNN (torch.ops.mkldnn._linear_pointwise)
    dx = dy W               the same kernel, W^T as its weight (a strided view, no copy)
    dW = dy^T x             the same kernel over the transposed views;   db = sum over rows of dy

Where it applies (else F.linear, unchanged): fp32 plain tensors (not DTensors: TP keeps torch's sharded ops) on
the CPU, autocast off, torch built with oneDNN, and at least MIN_MACS multiply-adds: below that oneDNN's fixed
cost per call (~12 us) loses to MKL (measured: the crossover sits near 2M MACs on this machine), so the small
models of the tests keep torch's kernels.

It imports torch only; it must never import another relayrl layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

MIN_MACS = 1 << 21  # rows x out x in at which oneDNN starts to beat MKL on the CPU (bench_linear.py)

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] w[N, K]^T (+ b) by oneDNN; x and w may be strided views."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return _mm(x2, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        dx = _mm(dy, weight.t()) if ctx.needs_input_grad[0] else None
        dw = _mm(dy.t(), x2.t()) if ctx.needs_input_grad[1] else None
        db = dy.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) runs on oneDNN (see the module docstring)."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not isinstance(x, DTensor) and not isinstance(weight, DTensor)
            and not torch.is_autocast_enabled("cpu")
            and x.numel() * weight.shape[0] >= MIN_MACS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), on oneDNN where uses_onednn says so."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        y = _OneDNNLinear.apply(x2, weight, bias)
    else:
        y = _mm(x2, weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (the same parameters, names and state dict) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
