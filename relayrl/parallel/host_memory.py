"""The host allocator policy of a relayrl process: memory a step frees is kept for the next step, not handed back
to the kernel.

Why: a training or rollout step allocates and frees the same large buffers every time (activations, logits, their
gradients, transposed copies for the weight gradients). glibc's malloc serves each block above its mmap threshold
(128 KiB at start, adapting up to 32 MiB; above 32 MiB always) with a fresh mmap and unmaps it on free, and trims
the heap's free top above its trim threshold. The pages of such a block are then faulted in again, and zeroed by
the kernel, on every step. Under a virtual machine a page fault is expensive. On the 2-core Zen 4 VM of
benchmarks/RESULTS.md the 27M model's update (bench_trainer's shapes, one thread) took 1.07M minor faults over
six updates, and 0.50M with this policy. The update's median fell from 9.2-9.4 s to 8.3-8.5 s, in three
alternating runs of each. Its peak RSS rose by 1-5%.

    keep     (the default) mallopt(M_MMAP_MAX, 0): no block is served by mmap, every one comes from the heap and
             goes back to it on free; mallopt(M_TRIM_THRESHOLD, INT_MAX): the heap's free top is returned to the
             kernel only past 2 GiB. A freed buffer is reused by the next allocation of its size without a fault.
    release  glibc's defaults: freed large blocks go back to the kernel (the RSS follows the live tensors).

The cost is resident memory: a process keeps the high-water mark of its heap (up to 2 GiB of free top) after a
peak has passed, as a GPU caching allocator does with device memory. Nothing numeric changes.

RELAYRL_HOST_MEMORY=keep|release picks the policy. When any glibc malloc setting is already in the environment
(MALLOC_MMAP_THRESHOLD_, MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, or glibc.malloc in
GLIBC_TUNABLES), that setting is the user's (the memory benchmarks set one so RSS follows live tensors) and
nothing is changed. Where the C library is not glibc, nothing is changed.

Applied once per process by the processes that do the work: every process that runs models through
relayrl.single_controller.process_setup.configure_process (the jobs' driver process, every worker), and every rank
relayrl.parallel.launch spawns; a benchmark that runs a trainer or an engine in its own process calls `apply()`
itself. The environment variable is inherited by spawned
processes, so one setting reaches every rank.

It imports the standard library and errors.py only.
"""

from __future__ import annotations

import ctypes
import os
import platform

from relayrl.errors import ConfigError

ENV = "RELAYRL_HOST_MEMORY"
MODES = ("keep", "release")
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: the heap's free top is returned past 2 GiB
KEEP = "keep: freed memory stays in the heap (no mmap blocks; its free top trimmed past 2 GiB)"
_basis: str | None = None  # what apply() did in this process, once


def mode() -> str:
    """The policy RELAYRL_HOST_MEMORY names (keep when unset); a ConfigError names a bad value."""
    value = os.environ.get(ENV, "keep").strip().lower() or "keep"
    if value not in MODES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(MODES)}")
    return value


def user_setting() -> str | None:
    """The glibc malloc setting already in the environment, if any (it is then left as it is)."""
    for name in GLIBC_ENV:
        if name in os.environ:
            return name
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def plan() -> str:
    """What apply() does in this environment, without doing it."""
    if mode() == "release":
        return f"release: glibc's defaults ({ENV}=release)"
    if (name := user_setting()) is not None:
        return f"left to {name} in the environment"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "left as it is: the C library is not glibc"
    return KEEP


def apply() -> str:
    """Apply the policy to this process (once; later calls return the first answer) and say what was done."""
    global _basis
    if _basis is None:
        chosen = plan()
        if chosen == KEEP:
            libc = ctypes.CDLL(None)
            if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
                chosen = "left as it is: mallopt refused"
        _basis = chosen
    return _basis


def basis() -> str | None:
    """What apply() did in this process (None: not applied)."""
    return _basis
