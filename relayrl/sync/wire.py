"""This module lays a bucket out on the wire: the plan's pieces for one (source, destination) pair as flat
messages.

    engine dtype   one message: the pieces' values, cast to the engine's dtype, end to end
    float8         two messages: the pieces as float8 e4m3, each scaled by a scale of its own
                   (its max |x| / 448, recomputed every sync), then the scales (float32, one per
                   piece); the engine dequantises into its dtype. Colocated in-place pieces take the
                   same round trip (fp8_round_trip), so every weight is rounded alike wherever it
                   came from. Bytes: 1 per element + 4 per piece.

It imports torch and the sync modules only; like all of sync, it must never import the trainer, the
engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

import torch

from relayrl.sync.plan import Transfer

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0


def pack_pieces(ts: tuple[Transfer, ...], local: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([local[t.name][t.src_box.slices()].reshape(-1).to(dtype) for t in ts])


def unpack_pieces(ts: tuple[Transfer, ...], flat: torch.Tensor, params: dict[str, torch.Tensor]) -> None:
    at = 0
    for t in ts:
        params[t.dst_param][t.dst_box.slices()].copy_(flat[at:at + t.numel].view(t.shape))
        at += t.numel


def fp8_scales(ts: tuple[Transfer, ...], local: dict[str, torch.Tensor]) -> torch.Tensor:
    amax = torch.stack([local[t.name][t.src_box.slices()].detach().abs().max().float() for t in ts])
    return torch.clamp(amax / FP8_MAX, min=1e-12)


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the engine ends up holding (before its own dtype's rounding): dequantise(quantise(x))."""
    return (x.float() / scale).to(FP8).float() * scale


def encode(ts: tuple[Transfer, ...], local: dict[str, torch.Tensor], dtype: torch.dtype,
           fp8: bool) -> list[torch.Tensor]:
    """The message(s) for one bucket: [flat values in the engine's dtype] or [fp8 bytes, scales]."""
    if not fp8:
        return [pack_pieces(ts, local, dtype)]
    scales = fp8_scales(ts, local)
    data = torch.cat([(local[t.name][t.src_box.slices()].reshape(-1).float() / scales[i]).to(FP8)
                      for i, t in enumerate(ts)])
    return [data.view(torch.uint8), scales]


def receive_buffers(ts: tuple[Transfer, ...], dtype: torch.dtype, fp8: bool, device) -> list[torch.Tensor]:
    n = sum(t.numel for t in ts)
    if not fp8:
        return [torch.empty(n, dtype=dtype, device=device)]
    return [torch.empty(n, dtype=torch.uint8, device=device), torch.empty(len(ts), dtype=torch.float32, device=device)]


def decode(ts: tuple[Transfer, ...], bufs: list[torch.Tensor], params: dict[str, torch.Tensor], fp8: bool) -> None:
    if not fp8:
        unpack_pieces(ts, bufs[0], params)
        return
    data, scales = bufs[0].view(FP8), bufs[1]
    at = 0
    for i, t in enumerate(ts):
        dst = params[t.dst_param][t.dst_box.slices()]
        dst.copy_((data[at:at + t.numel].float() * scales[i]).view(t.shape))
        at += t.numel


def nbytes(bufs: list[torch.Tensor]) -> int:
    return sum(b.numel() * b.dtype.itemsize for b in bufs)
