"""Capture and restore every random-number generator a step draws from.

A resumed run must draw the same samples, dropout masks and shuffles as a never-stopped one, so the
checkpoint stores the state of each generator in use: Python's `random`, numpy's global generator
(when numpy is installed), torch's CPU generator and, when CUDA is available, every CUDA device's.
The captured state is plain data — tuples, ints, a numpy array, uint8 tensors — so it is stored as data
(relayrl.checkpoint.statefile) and comes back with the same types, and restore_rng_state checks it
before handing it to the generators: a malformed state is a one-line CheckpointError.
RNG state is per process; under torch.distributed each rank saves its own entry. This module imports
only torch, numpy (optional) and the checkpoint errors; it must never import the trainer, engine or
controller (they import it).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

from relayrl.checkpoint.errors import CheckpointError

try:
    import numpy as np
except ImportError:  # numpy is optional: torch runs without it.
    np = None


def capture_rng_state() -> dict[str, Any]:
    """{"python": random.getstate(), "torch": CPU state, "numpy": ... if installed, "cuda": [...] if any}."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _byte_tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise CheckpointError(f"the checkpoint's RNG state {what} is not a uint8 tensor")
    return value


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator capture_rng_state() saw back to `state` (CUDA states only where devices match)."""
    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise CheckpointError("the checkpoint's RNG state lacks the 'python' or 'torch' entry")
    try:
        random.setstate(state["python"])
        torch.set_rng_state(_byte_tensor(state["torch"], "'torch'"))
        if np is not None and "numpy" in state:
            np.random.set_state(state["numpy"])
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"the checkpoint's RNG state is malformed: {str(e).splitlines()[0][:200]}") from None
    cuda_states = state.get("cuda")
    if cuda_states is None:
        return
    if not torch.cuda.is_available():
        warnings.warn("checkpoint has CUDA RNG states but CUDA is unavailable; they are ignored", stacklevel=2)
        return
    if not isinstance(cuda_states, list):
        raise CheckpointError("the checkpoint's RNG state 'cuda' is not a list")
    count = torch.cuda.device_count()
    if len(cuda_states) != count:
        # Resuming on a different number of devices cannot reproduce per-device draws exactly;
        # restore what matches and say so rather than fail the resume.
        warnings.warn(
            f"checkpoint has {len(cuda_states)} CUDA RNG states, this process sees {count} devices", stacklevel=2
        )
    for device, device_state in enumerate(cuda_states[:count]):
        torch.cuda.set_rng_state(_byte_tensor(device_state, f"'cuda'[{device}]"), device)
