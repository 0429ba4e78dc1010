"""This module is the models' linear layer: nn.Linear, with the CPU's fp32 matmuls run by oneDNN where that is
faster than torch's default on this machine.

Why: torch's CPU wheels run an fp32 matmul through MKL's sgemm, which on AMD CPUs takes its AVX2 path. On an AMD
core with full-width AVX-512 FMA units (Zen 5) that is half the core's fp32 rate; oneDNN, which torch ships too,
JIT-compiles AVX-512 kernels and reaches it (benchmarks/bench_linear.py measures both, side by side). The numbers
are fp32 either way; the sums run in another order, so results differ from MKL's at fp32 rounding (about 1e-6
relative: tests/test_linear.py).

    y  = x W^T + b          oneDNN (torch.ops.mkldnn._linear_pointwise)
    dx = dy W               the same kernel, W^T as its weight (a strided view, no copy)
    dW = dy^T x             the same kernel over the transposed views;   db = sum over rows of dy

Which kernel wins depends on the CPU, and MKL's own dispatch says where: it runs its AVX-512 code on Intel CPUs
only. Measured (benchmarks/bench_linear.py, each machine in RESULTS.md): on an Intel Xeon with AVX-512 MKL is at
full rate and oneDNN 0.6-1.0x of it; on AMD Zen 5 oneDNN is about twice MKL's rate for all three products; on AMD
Zen 4 (AVX-512 run at half width) oneDNN's forward is 1.1-1.4x MKL's, and interleaved in one process the 27M
model's update ran 1.03-1.09x and the 25m model's rollout 1.08x faster.
So the choice is a rule where the CPU is known, the same in every process of a machine (a data-parallel group's
ranks all run the same kernels, and a rerun rounds as the run before it):

    Intel (vendor GenuineIntel)              all three products on torch's kernel (MKL)
    AMD (AuthenticAMD) with AVX-512          all three on oneDNN
    any other CPU                            measured, once per process (measure_kernels: a 1024 x 1024 x 512
                                             case, best of a few calls of each kernel, about 0.2 s); a product
                                             runs on oneDNN only where it wins by WIN (25%)

The measurement is the fallback, not the default, because it flips: on the Zen 4 machine three processes in a row
measured the forward at 1.35x, 1.22x and 1.47x against the 1.25 margin, so each chose differently and rounded
differently. RELAYRL_CPU_LINEAR=measure always measures; torch | onednn fixes the choice (auto: the rule, the
default); `kernel_choice()` says what was chosen and `choice_basis()` why.

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

import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

MIN_MACS = 1 << 21  # rows x out x in at which oneDNN starts to beat MKL on the CPU (bench_linear.py)
MIN_FEATURES = 256  # in and out features below which a linear stays on torch's kernel (narrow models)
WIN = 1.25  # oneDNN runs a product only when it is this much faster than torch's kernel on this machine
KERNEL_ENV = "RELAYRL_CPU_LINEAR"
PRODUCTS = ("fwd", "dx", "dw")  # y = x W^T, dx = dy W, dW = dy^T x

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_choice: dict[str, bool] | None = None  # product -> runs on oneDNN; by the rule, measured or named, once
_basis = ""  # why _choice is what it is (choice_basis)
_ratios: dict[str, float] = {}  # product -> torch seconds / oneDNN seconds, when measured
MODES = ("auto", "measure", "torch", "onednn")


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
            and not torch.is_autocast_enabled("cpu") and any(kernel_choice().values())):
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


def _torch_products(x, w, dy):
    return {"fwd": lambda: F.linear(x, w), "dx": lambda: dy.mm(w), "dw": lambda: dy.t().mm(x)}


def _onednn_products(x, w, dy):
    return {"fwd": lambda: _onednn(x, w), "dx": lambda: _onednn(dy, w.t()), "dw": lambda: _onednn(dy.t(), x.t())}


def measure_kernels(m: int = 1024, n: int = 1024, k: int = 512, calls: int = 3) -> dict[str, float]:
    """torch seconds / oneDNN seconds for each product on an m x n x k case, the best of `calls` interleaved calls
    of each after one warm-up (in this process's threads)."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(m, n, generator=g)
    base, ours = _torch_products(x, w, dy), _onednn_products(x, w, dy)
    best = {p: [float("inf"), float("inf")] for p in PRODUCTS}
    for rep in range(calls + 1):
        for p in PRODUCTS:
            for i, fn in enumerate((base[p], ours[p])):
                t = time.perf_counter()
                fn()
                if rep:  # the first call of each compiles / warms up
                    best[p][i] = min(best[p][i], time.perf_counter() - t)
    return {p: best[p][0] / best[p][1] for p in PRODUCTS}


def cpu_vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...) from /proc/cpuinfo; "" where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def rule(vendor: str, capability: str) -> dict[str, bool] | None:
    """The kernel choice for a known CPU (see the module docstring), or None: measure. capability is torch's
    (torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", ...)."""
    if vendor == "GenuineIntel":
        return dict.fromkeys(PRODUCTS, False)
    if vendor == "AuthenticAMD" and capability.startswith("AVX512"):
        return dict.fromkeys(PRODUCTS, True)
    return None


def kernel_choice() -> dict[str, bool]:
    """Which of the three products run on oneDNN in this process (for linears where it applies at all): by the
    CPU's rule, else measured (measure_kernels, WIN), or fixed by RELAYRL_CPU_LINEAR; decided on first use."""
    global _choice, _basis
    if _choice is None:
        mode = os.environ.get(KERNEL_ENV, "auto").strip().lower()
        if mode not in MODES:
            raise ValueError(f"{KERNEL_ENV}={mode!r}: expected {', '.join(MODES[:-1])} or {MODES[-1]}")
        vendor, capability = cpu_vendor(), torch.backends.cpu.get_cpu_capability()
        known = rule(vendor, capability) if mode == "auto" else None
        if not _ONEDNN or mode == "torch":
            _choice, _basis = dict.fromkeys(PRODUCTS, False), f"{KERNEL_ENV}={mode}" if _ONEDNN else "no oneDNN"
        elif mode == "onednn":
            _choice, _basis = dict.fromkeys(PRODUCTS, True), f"{KERNEL_ENV}=onednn"
        elif known is not None:
            _choice, _basis = known, f"the rule for {vendor} with {capability}"
        else:
            with torch.no_grad():
                _ratios.update(measure_kernels())
            _choice = {p: _ratios[p] >= WIN for p in PRODUCTS}
            _basis = "measured: torch s / oneDNN s " + ", ".join(f"{p} {_ratios[p]:.2f}" for p in PRODUCTS)
    return _choice


def choice_basis() -> str:
    """Why kernel_choice() is what it is: the rule and the CPU it matched, the measured ratios, or the variable."""
    kernel_choice()
    return _basis


def _rows(y: torch.Tensor, rows: int) -> torch.Tensor:
    """y's first `rows` rows: y itself when nothing was padded, else a copy (not a view: FSDP2 warns when a
    module returns a view, as an in-place op on it would skip its hooks)."""
    return y if y.shape[0] == rows else y[:rows].clone()


class _OneDNNLinear(torch.autograd.Function):
    """x W^T + b with each product on the kernel kernel_choice() names (at least one of them oneDNN)."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return _mm(x2, weight, bias) if kernel_choice()["fwd"] else F.linear(x2, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        use = kernel_choice()
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
    """Whether linear(x, weight) may run on oneDNN at all (see the module docstring); kernel_choice() then says
    which products do."""
    return (_ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and not isinstance(x, DTensor) and not isinstance(weight, DTensor)
            and not torch.is_autocast_enabled("cpu")
            and min(weight.shape) >= MIN_FEATURES and x.numel() * weight.shape[0] >= MIN_MACS)


def uses_onednn(x: torch.Tensor, weight: torch.Tensor, product: str = "fwd") -> bool:
    """Whether `product` ("fwd", "dx" or "dw") of linear(x, weight) runs on oneDNN."""
    return applies(x, weight) and kernel_choice()[product]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), with the products kernel_choice() names on oneDNN where applies() says so."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    use = kernel_choice()
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
