"""This module chooses the CPU kernels a relayrl process's models run: which of an fp32 linear's three products run
on oneDNN instead of torch's default (MKL), and whether the decoder's pointwise pieces are fused by torch.compile.
It decides; the models only take the decision as an argument (relayrl.models.linear.use_kernels,
relayrl.models.pointwise.use_compile) and never read the environment or the CPU themselves.

    y = x W^T (fwd)     dx = dy W (dx)     dW = dy^T x (dw)     each on oneDNN or on torch's kernel

Why a choice: torch's CPU wheels run an fp32 matmul through MKL's sgemm, whose own dispatch runs its AVX-512 code
on Intel CPUs only; on AMD it takes its AVX2 path, half the rate of a core with full-width AVX-512 FMA units
(Zen 5). oneDNN, which torch ships too, JIT-compiles AVX-512 kernels and reaches it. Measured
(benchmarks/bench_linear.py, each machine in benchmarks/RESULTS.md): on an Intel Xeon with AVX-512 MKL is at full
rate and oneDNN 0.6-1.0x of it; on AMD Zen 5 oneDNN is about twice MKL's rate for all three products; on AMD Zen 4
(AVX-512 run at half width) oneDNN's forward is 1.1-1.4x MKL's, and interleaved in one process the 27M model's
update ran 1.03-1.09x and the 25m model's rollout 1.08x faster; on AMD Zen 3 (AVX2, no AVX-512: MKL's AVX2 path is
the CPU's full rate) oneDNN's forward measured 0.97-1.22x, dx 0.77-0.87x, dw 0.64-0.79x of MKL's. So the choice is a
rule where the CPU is known, the same in every process of a machine (a data-parallel group's ranks all run the same
kernels, and a rerun rounds as the run before it):

    Intel (vendor GenuineIntel)              all three products on torch's kernel (MKL)
    AMD (AuthenticAMD) with AVX-512          all three on oneDNN
    AMD without AVX-512 (Zen 3 and before)   all three on torch's kernel
    any other CPU                            measured (measure_kernels: a 1024 x 1024 x 512 case, best of a few
                                             calls of each kernel, about 0.2 s); a product runs on oneDNN only
                                             where it wins by WIN (25%)

The measurement is the fallback, not the default, because it flips: on the Zen 4 machine three processes in a row
measured the forward at 1.35x, 1.22x and 1.47x against the 1.25 margin, so each chose differently and rounded
differently (on a Zen 3 host, before its rule, a context-parallel run and the one-process run it is tested against
differed in their loss beyond 1e-4 so). Where torch has no oneDNN every product stays on torch's kernel.

    RELAYRL_CPU_LINEAR   auto (the rule above; the default) | measure (always measure) | torch | onednn (fixed)
    RELAYRL_COMPILE      auto (the pointwise pieces fused where they apply; the default) | off (always eager)

Anything else is refused in one line naming the variable (a ValueError). `decide(env)` is the whole choice from
an environment mapping; `configure()` makes it once per process (later calls return the first decision) and
`kernel_choice()` / `choice_basis()` say what it chose and why. The decision reaches the models through
relayrl.single_controller.process_setup.configure_process, which every relayrl process that runs models calls
when it starts (each worker process, the jobs and CLI commands that run models in the driver, the tests' conftest
and distributed harness, the benchmarks): each process decides once. The environment variables are inherited by
spawned processes, so one setting reaches every rank.

It imports torch and the standard library only; it must never import the models (they take what it decides).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

KERNEL_ENV = "RELAYRL_CPU_LINEAR"
COMPILE_ENV = "RELAYRL_COMPILE"
MODES = ("auto", "measure", "torch", "onednn")  # RELAYRL_CPU_LINEAR's values
COMPILE_MODES = ("auto", "off")  # RELAYRL_COMPILE's values
PRODUCTS = ("fwd", "dx", "dw")  # y = x W^T, dx = dy W, dW = dy^T x (relayrl.models.linear.PRODUCTS)
WIN = 1.25  # a measured product runs on oneDNN only when it is this much faster than torch's kernel here
ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@dataclass(frozen=True)
class CPUKernels:
    """A process's CPU kernels: what the models are handed, and why."""

    linear: dict[str, bool]  # product -> runs on oneDNN (for linears where oneDNN applies at all)
    compile: bool  # the decoder's pointwise pieces fused by torch.compile where they apply
    basis: str  # why `linear` is what it is: the rule and the CPU it matched, the measured ratios, or the variable
    ratios: dict[str, float] = field(default_factory=dict)  # product -> torch s / oneDNN s, when measured


_decided: CPUKernels | None = None  # this process's decision (configure), once


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _torch_products(x, w, dy):
    return {"fwd": lambda: torch.nn.functional.linear(x, w), "dx": lambda: dy.mm(w), "dw": lambda: dy.t().mm(x)}


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
    if vendor == "AuthenticAMD":
        return dict.fromkeys(PRODUCTS, capability.startswith("AVX512"))
    return None


def _mode(env: Mapping[str, str], name: str, modes: tuple[str, ...]) -> str:
    mode = env.get(name, "auto").strip().lower()
    if mode not in modes:
        raise ValueError(f"{name}={mode!r}: expected {', '.join(modes[:-1])} or {modes[-1]}")
    return mode


def decide_linear(env: Mapping[str, str] | None = None) -> tuple[dict[str, bool], str, dict[str, float]]:
    """(product -> oneDNN, why, measured ratios) by RELAYRL_CPU_LINEAR in `env` (os.environ when None): the CPU's
    rule, else measured (measure_kernels, WIN), or the kernel the variable names."""
    mode = _mode(os.environ if env is None else env, KERNEL_ENV, MODES)
    vendor, capability = cpu_vendor(), torch.backends.cpu.get_cpu_capability()
    known = rule(vendor, capability) if mode == "auto" else None
    if not ONEDNN or mode == "torch":
        return dict.fromkeys(PRODUCTS, False), f"{KERNEL_ENV}={mode}" if ONEDNN else "no oneDNN", {}
    if mode == "onednn":
        return dict.fromkeys(PRODUCTS, True), f"{KERNEL_ENV}=onednn", {}
    if known is not None:
        return known, f"the rule for {vendor} with {capability}", {}
    with torch.no_grad():
        ratios = measure_kernels()
    basis = "measured: torch s / oneDNN s " + ", ".join(f"{p} {ratios[p]:.2f}" for p in PRODUCTS)
    return {p: ratios[p] >= WIN for p in PRODUCTS}, basis, ratios


def decide_compile(env: Mapping[str, str] | None = None) -> bool:
    """Whether the pointwise pieces are fused: RELAYRL_COMPILE in `env` (os.environ when None) is not "off"."""
    return _mode(os.environ if env is None else env, COMPILE_ENV, COMPILE_MODES) == "auto"


def decide(env: Mapping[str, str] | None = None) -> CPUKernels:
    """The whole choice from `env` (os.environ when None); measures where the rule does not know the CPU."""
    compile_on = decide_compile(env)  # the cheap check first: a bad value is refused before anything is measured
    linear, basis, ratios = decide_linear(env)
    return CPUKernels(linear=linear, compile=compile_on, basis=basis, ratios=ratios)


def configure() -> CPUKernels:
    """This process's CPU kernels: decided on the first call (from os.environ), the same answer after."""
    global _decided
    if _decided is None:
        _decided = decide()
    return _decided


def kernel_choice() -> dict[str, bool]:
    """Which of the three products run on oneDNN in this process (for linears where it applies at all)."""
    return dict(configure().linear)


def choice_basis() -> str:
    """Why kernel_choice() is what it is: the rule and the CPU it matched, the measured ratios, or the variable."""
    return configure().basis
