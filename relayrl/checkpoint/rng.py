"""Capture and restore every random-number generator a step draws from.

A resumed run must draw the same samples, dropout masks and shuffles as a never-stopped one, so the
checkpoint stores the state of each generator in use: Python's `random`, numpy's global generator
(when numpy is installed), torch's CPU generator and, when CUDA is available, every CUDA device's.
RNG state is per process; under torch.distributed each rank saves its own entry.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional: torch runs without it.
    np = None


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    cuda_states = state.get("cuda")
    if cuda_states is None:
        return
    if not torch.cuda.is_available():
        warnings.warn("checkpoint has CUDA RNG states but CUDA is unavailable; they are ignored")
        return
    count = torch.cuda.device_count()
    if len(cuda_states) != count:
        # Resuming on a different number of devices cannot reproduce per-device draws exactly;
        # restore what matches and say so rather than fail the resume.
        warnings.warn(
            f"checkpoint has {len(cuda_states)} CUDA RNG states, this process sees {count} devices"
        )
    for device, device_state in enumerate(cuda_states[:count]):
        torch.cuda.set_rng_state(device_state, device)
