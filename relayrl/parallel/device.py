"""Which device a role computes on, and what follows from the device's type.

    parallel.device (sft.device)   auto | cpu | cuda      auto: cuda when torch sees a GPU, else cpu
    resolve_device(setting)        "cpu" or "cuda"; cuda without a GPU is a ConfigError in one line
    process_group_backend(device)  cpu: gloo; cuda: "cuda:nccl,cpu:gloo" (see below)
    module_device(model)           where a model's parameters are (its autocast's device type, where its
                                   micro-batches go)

A worker process gets one device of its pool ("cuda:<local rank>"); the driver's own process (parallel.backend
none) uses the current one ("cuda" = cuda:0 unless CUDA_VISIBLE_DEVICES says otherwise).

Why two backends on CUDA: the model's tensors (FSDP's all-gathers and reduce-scatters, TP's all-reduces, DTensor
norms) live on the GPU and go over nccl, while the trainer's control tensors (global token counts, the number of
micro-batches, the reduced stats) are small CPU tensors: a process group made with "cuda:nccl,cpu:gloo" sends each
tensor by its device, and every sub-group of the device mesh inherits both (torchtitan makes the same pair
for CPU offload). Object collectives and barriers then run on gloo (torch picks cpu when it is in the pairs).

It imports torch and relayrl.errors only; it must never import another relayrl layer.
"""

from __future__ import annotations

import torch

from relayrl.errors import ConfigError
from relayrl.parallel.dims import backend_for

DEVICE_SETTINGS = ("auto", "cpu", "cuda")


def resolve_device(setting: str, key: str = "parallel.device") -> str:
    """The device type a run computes on: "cpu" or "cuda" (auto: cuda when available)."""
    if setting not in DEVICE_SETTINGS:
        raise ConfigError(f"{key}={setting!r}: expected one of {', '.join(DEVICE_SETTINGS)}")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda, but torch sees no CUDA device (torch {torch.__version__}, "
                          f"built with CUDA {torch.version.cuda}): set {key}=cpu or auto")
    return setting


def process_group_backend(device: str | torch.device) -> str:
    """The default process group's backend for ranks on `device`: gloo on CPU; nccl for CUDA tensors with
    gloo beside it for CPU ones on CUDA."""
    backend = backend_for(device)  # refuses a device type with no collective backend
    return backend if backend == "gloo" else f"cuda:{backend},cpu:gloo"


def module_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (a DTensor's: its local shard's); cpu for a model without any."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
