"""This module holds the decoder's pointwise pieces (RMSNorm, SwiGLU, RoPE), each run as one fused CPU kernel
where it is large enough to gain from it.

Why: in eager torch each piece is several passes over its tensor, forward and backward (RMSNorm: square, mean,
add, rsqrt, two products; RoPE: two products, a negation, a concatenation, a sum), and on the CPU these passes are
memory-bound. torch.compile (inductor's C++ backend) writes each piece, and its backward, as one loop. Measured on
the 27M model's micro-batch shapes, forward + backward (benchmarks/RESULTS.md): RMSNorm 2.6x, SwiGLU 1.9x, RoPE
2.0x faster.

    rms_norm(x, w, eps) = w * (x * rsqrt(mean(x^2) + eps))        (in fp32, cast back, as the reference)
    swiglu(g, u)        = silu(g) * u
    rope(x, cos, sin)   = x * cos + rotate_half(x) * sin

Where it applies (else the eager formula, the same code): plain fp32 CPU tensors (not DTensors: tensor / sequence
parallelism keeps torch's sharded ops), autocast off, at least MIN_NUMEL elements (the tests' tiny models stay
eager), not in inference mode, not already inside a compiled region, and compiling on. Inference mode is the
rollout engine's forward (relayrl.engine.model_runner): forward alone the fused SwiGLU gains 1.1-1.4x and RMSNorm
0.7-1.5x on a prefill's rows, under 1% of its step, while the first batch past MIN_NUMEL would stall the step that
meets it for the compile (3 s with inductor's disk cache warm, 18 s cold, measured on bench_fleet's model when a
lost replica's requests were re-prefilled beside running ones); so the engine stays eager.
Whether it is on is not this module's choice: it
is made once per process by relayrl.parallel.cpu_kernels (RELAYRL_COMPILE=auto|off) and handed here as an argument,
`use_compile(on)`, by relayrl.single_controller.process_setup.configure_process, which every relayrl process that
runs models calls when it starts; until then it is on (auto, the variable's default): this module reads no
environment. The fused kernels compute the same
formula in another order: results equal the eager ones to fp32 rounding (tests/models/test_pointwise.py). Each piece is
compiled once per process with dynamic shapes (a few seconds the first time; inductor caches the code on disk for
later processes), once for passes with gradients and once without. If compiling fails (torch.compile's own
errors, e.g. no C++ compiler), a warning says so once and every piece stays eager in this process; any other
error (a wrong shape, say) is the caller's and propagates. The first compile sets inductor's compile_threads to 1,
a process-wide setting: no pool of compiler processes is forked inside trainer workers.

It imports torch only; it must never import another relayrl layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._dynamo.exc import TorchDynamoException
from torch.distributed.tensor import DTensor

MIN_NUMEL = 1 << 19  # elements below which a piece stays eager (compiled kernels gain little, and cost a compile)

_compile = True  # fuse where it applies (handed by use_compile; on until then, as RELAYRL_COMPILE's default)
_compiled: dict[str, Callable] = {}
_broken: str | None = None  # why compiling failed in this process, once it has


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def use_compile(on: bool) -> None:
    """Fuse the pieces where they apply (on) or keep them eager (off), in this process from now on. The choice is
    made outside the models (relayrl.parallel.cpu_kernels) and handed here by
    relayrl.single_controller.process_setup.configure_process."""
    global _compile
    _compile = bool(on)


def enabled() -> bool:
    """Whether the pieces are fused where they apply: compiling is on and has not failed in this process."""
    return _compile and _broken is None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether a piece over these tensors runs fused (see the module docstring)."""
    return (tensors[0].numel() >= MIN_NUMEL
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and not isinstance(t, DTensor)
                    for t in tensors)
            and not torch.is_autocast_enabled("cpu") and not torch.is_inference_mode_enabled()
            and not torch.compiler.is_compiling() and enabled())


def _run(name: str, fn: Callable, *args):
    global _broken
    if not applies(*(a for a in args if isinstance(a, torch.Tensor))):
        return fn(*args)
    fused = _compiled.get(name)
    if fused is None:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # no pool of compile processes inside trainer workers
        fused = _compiled[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    try:
        return fused(*args)
    except TorchDynamoException as e:  # the compiler's failure (inductor's errors derive from it), not the caller's
        _broken = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"relayrl.models.pointwise: torch.compile failed ({_broken}); the decoder's pointwise "
                      f"pieces stay eager in this process (set RELAYRL_COMPILE=off to skip the attempt)", stacklevel=2)
        return fn(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _run("rms_norm", _rms_norm, x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _run("swiglu", _swiglu, gate, up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D]; cos / sin broadcastable to it."""
    return _run("rope", _rope, x, cos, sin)
