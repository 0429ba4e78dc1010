"""The trainer's device memory in a step's metrics (CUDA only; a CPU run reports none).

    memory/allocated_gib   held by live tensors when the update returns (weights, grads, optimiser state, and a
                           colocated engine's weights and KV cache)
    memory/reserved_gib    what the caching allocator holds from the driver (allocated + its free cache)
    memory/peak_gib        the most allocated at any moment since the last report: the step's high-water mark,
                           whichever stage set it (rollout's KV cache, the update's activations)

Figures are of trainer rank 0's device, in GiB (2^30 bytes). Reading resets the peak, so each step's is its own.

It imports torch only; like all of observe, it must never import another relayrl layer.
"""

from __future__ import annotations

import torch

GIB = float(1 << 30)


def device_memory_metrics(device: str | torch.device) -> dict[str, float]:
    """{memory/allocated_gib, memory/reserved_gib, memory/peak_gib} of a CUDA device (peak reset after
    reading); {} for any other device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    out = {"memory/allocated_gib": torch.cuda.memory_allocated(dev) / GIB,
           "memory/reserved_gib": torch.cuda.memory_reserved(dev) / GIB,
           "memory/peak_gib": torch.cuda.max_memory_allocated(dev) / GIB}
    torch.cuda.reset_peak_memory_stats(dev)
    return out
