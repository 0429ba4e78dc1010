"""The sampler draws one token from each row of a batch of logits (one row per sequence), every row with
its own settings.

The logprob returned for a sampled token is

    logprob = log_softmax(logits / temperature)[token]          (temperature 0: temperature 1)

over the FULL vocabulary: top-k / top-p / min-p choose which tokens may be drawn, but the reported
logprob is not renormalised over the kept set. This is exactly what the trainer recomputes from the
same weights (`relayrl.trainer.logprobs.token_logprobs` with the same temperature), so any gap
between the two is numerical mismatch, never a difference of definition. The cost: when truncation
is on, the true behaviour policy puts slightly more mass on the kept tokens than the reported
logprob says (by the truncated mass); keep top_p = 1 and top_k = 0 in RL when exact
importance-sampling corrections matter.

Randomness: each row carries a uniform draw u in [0, 1) from its own stream; the token is found by
inverse CDF (the first token whose cumulative kept probability exceeds u), so a row's token depends
only on its logits and its stream — not on the batch around it.

The settings arrive already checked (`SamplingParams.validate`: finite, in range), and whatever they
are the most likely token is never filtered out, so every row keeps at least one token to draw.

It imports torch only; like the whole engine, it must never import the trainer, sync, the controller or
the CLI.
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set disallowed tokens to -inf. logits [B, V] (already temperature-scaled); per-row k, p, min_p.

    top_k == 0, top_p == 1 and min_p == 0 switch the filter off for that row.
    """
    V = logits.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(V, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))
        drop = ranks >= k[:, None]
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches p
        before = probs.cumsum(-1) - probs
        drop |= before >= top_p[:, None]
        drop[:, 0] = False  # the top token always stays, even for a p that rounds to 0 in float32
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (tokens [B], logprobs [B]) — see the module docstring."""
    logits = logits.float()
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None]
    logp_all = scaled.log_softmax(-1)
    kept = filter_logits(scaled, top_k, top_p, min_p)
    cdf = kept.softmax(-1).cumsum(-1)
    u = (uniforms * cdf[:, -1]).clamp(max=cdf[:, -1] * (1 - 1e-7))
    # right=True: a zero-probability token has the cdf of its predecessor and can never be hit
    drawn = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn)
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)
