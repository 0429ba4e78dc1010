"""This module is the models' linear layer: nn.Linear, with the CPU's fp32 matmuls run by oneDNN where that is
faster than torch's default on this machine.

Why: torch's CPU wheels run an fp32 matmul through MKL's sgemm, which on AMD CPUs takes its AVX2 path. On an AMD
core with full-width AVX-512 FMA units (Zen 5) that is half the core's fp32 rate; oneDNN, which torch ships too,
JIT-compiles AVX-512 kernels and reaches it (benchmarks/bench_linear.py measures both, side by side). The numbers
are fp32 either way; the sums run in another order, so results differ from MKL's at fp32 rounding (about 1e-6
relative: tests/models/test_linear.py).

    y  = x W^T + b          oneDNN (torch.ops.mkldnn._linear_pointwise)
    dx = dy W               the same kernel, W^T as its weight (a strided view, no copy)
    dW = dy^T x             the same kernel over the transposed views;   db = sum over rows of dy

Which products run on oneDNN is not this module's choice: it depends on the CPU, and it is made once per process
by relayrl.parallel.cpu_kernels (the CPU's rule, a measurement, or RELAYRL_CPU_LINEAR) and handed here as an
argument, `use_kernels(choice)`, by relayrl.single_controller.process_setup.configure_process, which every relayrl
process that runs models calls when it starts. Until a choice is handed, every product runs on torch's kernel:
this module reads neither the environment nor the CPU. `kernels()` says what it was handed.

Row buckets: oneDNN JIT-compiles a kernel for every new shape (about 5 ms on this machine) and caches it, and the
trainer's packed rows and the engine's batches change their row count every call. So the rows are padded with
zeros up to a bucket: exact below 64 rows, then 16 buckets per power of two (at most 1/16 padding), so a run meets
a few dozen shapes per layer and each compiles once. Zero rows add nothing to dW and their outputs are cut off.
That padding copies each product's operands and its output; a caller that lays out its own tokens pads them once
instead (`packed_rows`: the trainer's packed row gets a segment of filler tokens), and its linears copy nothing.

Where it applies (else F.linear, unchanged): fp32 plain tensors (not DTensors: TP keeps torch's sharded ops) on
the CPU, autocast off, torch built with oneDNN, and at least MIN_MACS multiply-adds: below that oneDNN's fixed
cost per call (~12 us) loses to MKL (measured: the crossover sits near 2M MACs on the Zen 5 machine), so the small
models of the tests keep torch's kernels; and in and out features both at least MIN_FEATURES (256): on the Zen 4
machine oneDNN lost on the demo's 128-wide model (its products 0.79-1.09x of MKL's, the demo's GRPO step 7% slower
on oneDNN, `benchmarks/bench_grpo_trl.py --workload demo` with RELAYRL_CPU_LINEAR=onednn against torch), and on
the Zen 5 one such a model gained nothing from it.

It imports torch only; it must never import another relayrl layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

MIN_MACS = 1 << 21  # rows x out x in at which oneDNN starts to beat MKL on the CPU (bench_linear.py)
MIN_FEATURES = 256  # in and out features below which a linear stays on torch's kernel (narrow models)
PRODUCTS = ("fwd", "dx", "dw")  # y = x W^T, dx = dy W, dW = dy^T x

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_choice: dict[str, bool] = dict.fromkeys(PRODUCTS, False)  # product -> runs on oneDNN: handed by use_kernels


def bucket(rows: int) -> int:
    """The row count a kernel is compiled for: `rows` up to 64, then rounded up to a sixteenth of its power of two."""
    if rows <= 64:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def packed_rows(rows: int, width: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """How many rows a caller that lays out its own tokens (the trainer's packed row) should give a model of this
    width, so that its linears meet a bucket and pad nothing: bucket(rows) where they run on oneDNN (fp32 on the
    CPU, autocast off, wide enough, some product chosen for oneDNN), else rows. Padding inside `linear` copies
    every product's operands and its output; padding the tokens once costs the same FLOPs and no copies."""
    if not (_ONEDNN and torch.device(device).type == "cpu" and dtype == torch.float32 and width >= MIN_FEATURES
            and not torch.is_autocast_enabled("cpu") and any(_choice.values())):
        return rows
    return bucket(rows)


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if t.shape[0] == rows else F.pad(t, (0, 0, 0, rows - t.shape[0]))


def _mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] w[N, K]^T (+ b) by oneDNN (x's rows padded to their bucket); x and w may be strided views."""
    rows = x.shape[0]
    return _rows(torch.ops.mkldnn._linear_pointwise(_pad(x, bucket(rows)), w, b, "none", [], ""), rows)


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def use_kernels(choice: Mapping[str, bool]) -> None:
    """Run each product ("fwd", "dx", "dw") on oneDNN where `choice` says True (for linears where oneDNN applies
    at all), on torch's kernel elsewhere, in this process from now on. The choice is made outside the models
    (relayrl.parallel.cpu_kernels) and handed here by relayrl.single_controller.process_setup.configure_process."""
    global _choice
    if set(choice) != set(PRODUCTS):
        raise ValueError(f"a kernel choice names each of {', '.join(PRODUCTS)}: got {sorted(choice)}")
    _choice = {p: bool(choice[p]) for p in PRODUCTS}


def kernels() -> dict[str, bool]:
    """The kernel choice this process's linears run: product -> on oneDNN (all False until use_kernels)."""
    return dict(_choice)


def _rows(y: torch.Tensor, rows: int) -> torch.Tensor:
    """y's first `rows` rows: y itself when nothing was padded, else a copy (not a view: FSDP2 warns when a
    module returns a view, as an in-place op on it would skip its hooks)."""
    return y if y.shape[0] == rows else y[:rows].clone()


class _OneDNNLinear(torch.autograd.Function):
    """x W^T + b with each product on the kernel the handed choice names (at least one of them oneDNN)."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return _mm(x2, weight, bias) if _choice["fwd"] else F.linear(x2, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        use = _choice
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _mm(dy, weight.t()) if use["dx"] else dy.mm(weight)
        if ctx.needs_input_grad[1]:
            if use["dw"]:  # zero rows add nothing to dW; dW's rows are the layer's outputs, one shape per layer
                rows = bucket(x2.shape[0])
                dw = _onednn(_pad(dy, rows).t(), _pad(x2, rows).t())
            else:
                dw = dy.t().mm(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) may run on oneDNN at all (see the module docstring); the handed choice (kernels())
    then says which products do."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not isinstance(x, DTensor) and not isinstance(weight, DTensor)
            and not torch.is_autocast_enabled("cpu")
            and min(weight.shape) >= MIN_FEATURES and x.numel() * weight.shape[0] >= MIN_MACS)


def uses_onednn(x: torch.Tensor, weight: torch.Tensor, product: str = "fwd") -> bool:
    """Whether `product` ("fwd", "dx" or "dw") of linear(x, weight) runs on oneDNN."""
    return applies(x, weight) and _choice[product]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), with the products the handed choice names on oneDNN where applies() says so."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    use = _choice
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        if not any(use.values()):
            return F.linear(x, weight, bias)
        y = _OneDNNLinear.apply(x2, weight, bias)
    elif use["fwd"]:
        y = _mm(x2, weight, bias)
    else:
        return F.linear(x, weight, bias)
    # as F.linear does: an unsafe view is no view to autograd (no _base), so a module returning it is not taken
    # for one returning a view (FSDP2 warns of those, as an in-place op on a view would skip its hooks)
    return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))


class Linear(nn.Linear):
    """nn.Linear (the same parameters, names and state dict) whose forward is `linear` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
