"""A bucket crosses between two processes of one machine as a handle to the sender's memory, not as its bytes
(`sync.transport: ipc`; auto on CUDA with local processes).

    sender     packs the bucket on its device (relayrl.sync.wire.encode), then sends share(bucket): a small
               host message naming that memory (CUDA IPC for a GPU tensor, torch.multiprocessing's reductions)
    receiver   open(message) maps the sender's bucket (no copy), unpacks it into its parameters device to
               device, waits for those copies, then acks; the sender drops its bucket on the ack

so nothing is staged through host memory, and the window's memory bound is kept: a bucket lives until its
receiver has copied it out. The ack is what makes that exact: CUDA's own IPC reference count keeps a freed
block from reuse while a receiver maps it, but a receiver's copy kernels may still be reading when it unmaps,
hence the wait before the ack. CPU tensors share through torch's CPU strategy (the tests use file_system);
relayrl uses this transport for CUDA tensors only.

    message    HANDLE_BYTES of uint8 on the host: an 8-byte length, then the ForkingPickler bytes

Both ends must see the same devices under the same numbers (one machine, the same CUDA_VISIBLE_DEVICES: the
local backend's processes; Ray gives each worker its own view, so it stays on gloo). A receiver maps a sender's
memory through a CUDA context on the sender's device: a process that receives from ranks on k other GPUs holds k
more contexts (a few hundred MB each), the price of copying without the host.

It imports torch only; like all of sync, it must never import the trainer, the engine or the controller.
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

HANDLE_BYTES = 4096
ACK_TAG = 1 << 24  # acks travel receiver -> sender at ACK_TAG + bucket, apart from the data tags (2 b + k)


def share(t: torch.Tensor) -> torch.Tensor:
    """The host message naming `t`'s memory (the sender keeps `t` until the receiver acks)."""
    data = bytes(ForkingPickler.dumps(t))
    if len(data) + 8 > HANDLE_BYTES:
        raise RuntimeError(f"an IPC handle of {len(data)} bytes does not fit the {HANDLE_BYTES}-byte message")
    msg = torch.zeros(HANDLE_BYTES, dtype=torch.uint8)
    msg[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    msg[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return msg


def open_shared(msg: torch.Tensor) -> torch.Tensor:
    """The sender's tensor, mapped into this process (valid until the ack)."""
    raw = msg.numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    return pickle.loads(raw[8:8 + n])


def handle_buffers(count: int) -> list[torch.Tensor]:
    return [torch.empty(HANDLE_BYTES, dtype=torch.uint8) for _ in range(count)]


def ack_buffer() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.uint8)


def wait_for_copies(params: dict[str, torch.Tensor]) -> None:
    """The copies out of mapped memory have finished (CUDA: the current stream of the parameters' device)."""
    dev = next(iter(params.values())).device if params else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
