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

Row buckets: oneDNN JIT-compiles a kernel for every new shape (about 5 ms on this machine) and caches it, and the
trainer's packed rows and the engine's batches change their row count every call. So the rows are padded with
zeros up to a bucket: exact below 64 rows, then 16 buckets per power of two (at most 1/16 padding), so a run meets
a few dozen shapes per layer and each compiles once. Zero rows add nothing to dW and their outputs are cut off.

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


def bucket(rows: int) -> int:
    """The row count a kernel is compiled for: `rows` up to 64, then rounded up to a sixteenth of its power of two."""
    if rows <= 64:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else F.pad(t, (0, 0, 0, rows - t.shape[0]))


def _mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] w[N, K]^T (+ b) by oneDNN (x's rows padded to their bucket); x and w may be strided views."""
    rows = x.shape[0]
    return _rows(torch.ops.mkldnn._linear_pointwise(_pad(x, bucket(rows)), w, b, "none", [], ""), rows)


def _rows(y: torch.Tensor, rows: int) -> torch.Tensor:
    """y's first `rows` rows: y itself when nothing was padded, else a copy (not a view: FSDP2 warns when a
    module returns a view, as an in-place op on it would skip its hooks)."""
    return y if y.shape[0] == rows else y[:rows].clone()


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xp = _pad(x2, bucket(x2.shape[0]))
        ctx.save_for_backward(xp, weight)
        ctx.has_bias, ctx.rows = bias is not None, x2.shape[0]
        return _rows(torch.ops.mkldnn._linear_pointwise(xp, weight, bias, "none", [], ""), ctx.rows)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xp, weight = ctx.saved_tensors
        dyp = _pad(dy, xp.shape[0])  # zero rows: no share of dW, and their dx is cut off
        dx = _rows(_mm(dyp, weight.t()), ctx.rows) if ctx.needs_input_grad[0] else None
        # dW's rows are the layer's outputs, one fixed shape per layer: no bucket
        dw = torch.ops.mkldnn._linear_pointwise(dyp.t(), xp.t(), None, "none", [], "") if ctx.needs_input_grad[1] \
            else None
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
    # as F.linear does: an unsafe view is no view to autograd (no _base), so a module returning it is not taken
    # for one returning a view (FSDP2 warns of those, as an in-place op on a view would skip its hooks)
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))


class Linear(nn.Linear):
    """nn.Linear (the same parameters, names and state dict) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
