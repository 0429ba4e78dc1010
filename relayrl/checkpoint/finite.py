"""Non-finite state is never saved as a complete checkpoint, nor loaded from an older one.

    first_nonfinite(state) -> "model.layers.0.mlp.up_proj.weight" | None    the first floating tensor (a DTensor:
                                                                            this rank's shard) with a NaN or inf

A run whose weights went NaN would otherwise leave a COMPLETE checkpoint that every `--resume` picks (it is the
newest whose files match their manifest) and trains NaN from. Refusing the save keeps the last good checkpoint
the newest; refusing the load catches one written before this check.

It imports torch only; it must never import the trainer, engine or controller (they import it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def first_nonfinite(state: Any) -> str | None:
    """The dotted path of the first floating tensor in `state` (nested dicts / lists) that holds a NaN or inf."""
    with torch.no_grad():
        for path, t in _tensors(state, ""):
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                return path
    return None


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, DTensor):
        yield prefix, obj.to_local()
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}.{i}" if prefix else str(i))
