"""Trainer-side logprobs: the definition the engine's sampler reports (see relayrl.engine.sampler).

    logp[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]     (logp[:, 0] = 0)

over the full vocabulary, computed in fp32 whatever the model's dtype.

Padding-free: rows are packed into one row with segment ids (attention stays within a sequence)
and positions restarting per sequence, so no compute is spent on padding; the result is unpacked
to the padded [B, T] layout and equals the padded computation.
"""

from __future__ import annotations

import torch

from relayrl.models import CausalLM


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool):
    logits = logits.float() / temperature
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, ent


def _shift_pad(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else torch.nn.functional.pad(x, (1, 0))


def token_logprobs(
    model: CausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    padding_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [B, T], entropy [B, T] or None) for right-padded rows; entropy is that of the
    temperature-scaled distribution at each token's position."""
    if padding_free:
        return _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy)
    logits = model(input_ids, attention_mask=attention_mask)[:, :-1]
    logp, ent = _from_logits(logits, input_ids[:, 1:], temperature, with_entropy)
    return _shift_pad(logp), _shift_pad(ent)


def _packed_logprobs(model, input_ids, attention_mask, temperature, with_entropy):
    B, T = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    packed = torch.cat([input_ids[i, :n] for i, n in enumerate(lengths)])[None]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(packed, attention_mask=torch.ones_like(packed), position_ids=pos, segment_ids=seg)[:, :-1]
    logp_p, ent_p = _from_logits(logits, packed[:, 1:], temperature, with_entropy)
    logp = torch.zeros(B, T, dtype=logp_p.dtype)
    ent = torch.zeros(B, T, dtype=logp_p.dtype) if with_entropy else None
    start = 0
    for i, n in enumerate(lengths):
        # packed position start + t - 1 predicts token t of sequence i (t >= 1)
        logp[i, 1:n] = logp_p[0, start:start + n - 1]
        if with_entropy:
            ent[i, 1:n] = ent_p[0, start:start + n - 1]
        start += n
    return logp, ent
