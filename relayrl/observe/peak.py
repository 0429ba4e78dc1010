"""The machine's matmul peak: the denominator of MFU, measured once per machine and cached.

    matmul_peak(device, dtype, threads) ──> best GFLOP/s of square `a @ b` over growing sizes
                                             (one warm-up call, then the fastest of `reps` calls; sizes stop
                                             growing once one call takes longer than `budget_s`, so bf16 on
                                             a CPU without bf16 units stays cheap); on the CPU in fp32 the
                                             better of torch's default kernel (MKL) and oneDNN's, the one
                                             relayrl.models.linear runs where it is faster (on AVX-512 cores
                                             with full-width FMA units MKL's AVX2 path reaches half the rate)

It is what this process can reach on this machine, not a datasheet figure: on a CPU, with `threads` intra-op
threads (a worker rank of the local backend runs 1; the driver's own process torch's default); on CUDA, the
device's. The method is benchmarks/bench_trainer.py's `_matmul_gflops`.

The cache is JSON at $RELAYRL_CACHE/matmul_peak.json (else ~/.cache/relayrl/matmul_peak.json), one entry per
key `host | cpu model or CUDA device name | torch version | threads | dtype`. A file that does not parse, or an
entry that is not a positive finite number, is measured again and rewritten (written to a temporary name, then
renamed); the file is never unpickled or executed.

It imports torch and the standard library only; it must never import another relayrl layer: observe is a
leaf, which the controller and the CLI import.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import time
from pathlib import Path

import torch

CACHE_NAME = "matmul_peak.json"
CPU_SIZES = (256, 512, 1024, 2048)
CUDA_SIZES = (1024, 2048, 4096, 8192)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cache_path() -> Path:
    root = os.environ.get("RELAYRL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "relayrl") / CACHE_NAME


def _processor(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(device: str, dtype: str, threads: int) -> str:
    return " | ".join((socket.gethostname(), _processor(device), f"torch {torch.__version__}",
                       f"threads {threads}", dtype, "mm+onednn"))


def _kernels(dev: torch.device, dt: torch.dtype) -> list:
    """The matmuls to time: torch's, and on the CPU in fp32 oneDNN's (a @ b^T: the same FLOPs)."""
    out = [lambda a, b, o: torch.mm(a, b, out=o)]
    if dev.type == "cpu" and dt == torch.float32 and torch.backends.mkldnn.is_available() \
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        out.append(lambda a, b, o: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
    return out


def measure_gflops(device: str = "cpu", dtype: str = "float32", threads: int | None = None, *,
                   reps: int = 3, budget_s: float = 0.2) -> float:
    """Best GFLOP/s of one square matmul, sizes growing until one call takes `budget_s`."""
    dev, dt = torch.device(device), DTYPES[dtype]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        best = 0.0
        for n in CUDA_SIZES if dev.type == "cuda" else CPU_SIZES:
            a, b = torch.randn(n, n, device=dev).to(dt), torch.randn(n, n, device=dev).to(dt)
            out = torch.empty(n, n, device=dev, dtype=dt)
            fastest = float("inf")
            for mm in _kernels(dev, dt):
                mm(a, b, out)  # warm-up: allocations, kernel selection
                sync()
                for _ in range(reps):
                    t = time.perf_counter()
                    mm(a, b, out)
                    sync()
                    fastest = min(fastest, time.perf_counter() - t)
            best = max(best, 2 * n**3 / max(fastest, 1e-12) / 1e9)
            if fastest > budget_s:
                break
        return best
    finally:
        torch.set_num_threads(before)


def _read(path: Path) -> dict[str, float]:
    """The cache's valid entries; a file that is missing or does not parse counts as empty."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def matmul_peak(device: str = "cpu", dtype: str = "float32", threads: int | None = None) -> float:
    """GFLOP/s: the cached peak for this machine, process setup and dtype, measured on a miss."""
    if dtype not in DTYPES:
        raise ValueError(f"matmul_peak: dtype is one of {', '.join(DTYPES)}, got {dtype!r}")
    threads = torch.get_num_threads() if threads is None else threads
    key = cache_key(device, dtype, threads)
    path = cache_path()
    cached = _read(path)
    if key in cached:
        return cached[key]
    value = measure_gflops(device, dtype, threads)
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home still gets its MFU; it is measured again next time
    return value
