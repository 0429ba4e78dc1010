"""TrainBatch is what one update consumes: rows of [prompt | response | padding].

    input_ids       [B, T]  prompt then response tokens, right-padded
    attention_mask  [B, T]  1 on prompt and response tokens
    response_mask   [B, T]  1.0 on the model's response tokens (the only tokens that get loss);
                            0 on prompt, padding and a multi-turn episode's observations
    advantages      [B]
    old_logp        [B, T]  trainer logprobs before the update (recomputed, not the engine's)
    rollout_logp    [B, T]  what the engine reported when sampling (for the IS correction)
    ref_logp        [B, T]  reference model logprobs (KL), or None
    values          [B, T]  the critic's values when the batch was collected (PPO with a critic), or None
    returns         [B, T]  the critic's regression targets (GAE returns), or None
    routing         [B, T, n_moe, k]  MoE: the experts the engine routed each token to in each MoE layer (int16,
                            -1 on padding and on a token the engine never ran), what algo.routing_replay replays
                            and moe/routing_mismatch compares against; None for a dense model

Logprobs are aligned to tokens: logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t]).

It is the one batched form of a step's samples, and it crosses to the trainer's worker groups as itself: it has
what a data-parallel call cuts and rejoins (relayrl.single_controller's Rows: len, chunk, concat), and it pickles
a chunk's own rows only. No field list is kept anywhere else.

It imports torch only; like all of the trainer, it must never import the engine, sync, the controller or
the CLI.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass

import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    _: KW_ONLY
    advantages: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    routing: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def chunk(self, n_chunks: int) -> list[TrainBatch]:
        """n_chunks contiguous chunks (views), the first len % n_chunks one row longer: one per data-parallel
        rank of a worker-group call (the sizes single_controller's chunk_sizes gives)."""
        if n_chunks < 1:
            raise ValueError(f"cannot split into {n_chunks} chunks; n_chunks must be >= 1")
        base, extra = divmod(len(self), n_chunks)
        out, start = [], 0
        for i in range(n_chunks):
            size = base + (i < extra)
            out.append(self.select(slice(start, start + size)))
            start += size
        return out

    @classmethod
    def concat(cls, parts: list[TrainBatch]) -> TrainBatch:
        """Rows of parts[0], then parts[1], ...; every part sets the same fields."""
        if not parts:
            raise ValueError("TrainBatch.concat needs at least one batch")
        names = [f.name for f in dataclasses.fields(cls)]
        set_in = [{n for n in names if getattr(p, n) is not None} for p in parts]
        if any(s != set_in[0] for s in set_in):
            raise ValueError(f"TrainBatch.concat: parts set different fields {[sorted(s) for s in set_in]}")
        return cls(**{n: torch.cat([getattr(p, n) for p in parts]) if n in set_in[0] else None for n in names})

    def __getstate__(self) -> dict:
        # a chunk is a view of the whole batch's storage, which pickling a view would send whole: clone those
        return {k: v.clone() if isinstance(v, torch.Tensor) and _partial_view(v) else v
                for k, v in self.__dict__.items()}

    def select(self, idx: torch.Tensor | slice) -> TrainBatch:
        return TrainBatch(**{
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx])
            for f in dataclasses.fields(self)
        })

    def to(self, device: str | torch.device) -> TrainBatch:
        """Every tensor field on `device` (no copy where one already is): the one place a micro-batch goes to
        its model's device before the forward."""
        return TrainBatch(**{
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
            for f in dataclasses.fields(self)
        })

    def split(self, size: int) -> list[TrainBatch]:
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def replace(self, **kw) -> TrainBatch:
        return dataclasses.replace(self, **kw)


def _partial_view(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


def build_rows(prompts: list[list[int]], responses: list[list[int]], pad_id: int = 0,
               masks: list[list[int]] | None = None):
    """Right-padded rows [prompt | response]; returns (input_ids, attention_mask, response_mask).

    `masks` (one 0/1 per response token) marks the tokens that get loss: a multi-turn episode's
    response holds the model's tokens (1) and the environment's observations between them (0).
    Without it every response token gets loss."""
    T = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    B = len(prompts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    resp = torch.zeros(B, T)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        attn[i, :n] = 1
        if masks is None:
            resp[i, len(p):n] = 1.0
        else:
            if len(masks[i]) != len(r):
                raise ValueError(f"row {i}: {len(masks[i])} mask values for {len(r)} response tokens")
            resp[i, len(p):n] = torch.tensor(masks[i], dtype=torch.float32)
    return ids, attn, resp


def scatter_routing(routing: list[torch.Tensor], T: int) -> torch.Tensor:
    """Each sample's routing [its prompt + response tokens, n_moe, k] (the engine's record) as rows
    [B, T, n_moe, k], int16, -1 after a row's tokens (padding: the forward routes those itself)."""
    out = torch.full((len(routing), T, *routing[0].shape[1:]), -1, dtype=torch.int16)
    for i, r in enumerate(routing):
        out[i, :len(r)] = r
    return out


def scatter_per_token(values: list[list[float]], prompts: list[list[int]], T: int) -> torch.Tensor:
    """Place per-response-token values (e.g. the engine's logprobs) at their row positions."""
    out = torch.zeros(len(values), T)
    for i, (v, p) in enumerate(zip(values, prompts, strict=True)):
        out[i, len(p):len(p) + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out
