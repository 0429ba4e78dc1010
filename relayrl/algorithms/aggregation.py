"""This module reduces per-token values [B, T] under a loss mask to one scalar.

Three modes (the choice changes how much each token / each sequence weighs in the gradient):

    token-mean           sum_{i,t} m_it v_it / N_tok           every token weighs the same
    seq-mean-token-sum   sum_i ( sum_t m_it v_it ) / N_seq      every token of a sequence summed
    seq-mean-token-mean  sum_i ( sum_t m_it v_it / n_i ) / N_seq  every sequence weighs the same

with n_i = sum_t m_it (the sequence's own token count), N_tok = sum_{i,t} m_it, N_seq = B.

Why N_tok and N_seq can be passed in: the trainer splits a batch into micro-batches (and, later,
data-parallel ranks) and sums their gradients. Each term above is a sum over tokens or sequences
divided by a batch-wide count, so if every micro-batch divides by the counts of the GLOBAL batch,

    sum_over_microbatches aggregate(v_k, m_k, num_tokens=N_tok_global, num_seqs=N_seq_global)
        == aggregate(v, m)   (the full-batch loss, exactly)

whereas dividing each micro-batch by its own count would weight micro-batches unequally.
(n_i needs no such care: a sequence is never split across micro-batches.)

Defaults when not given: N_tok = max(mask.sum(), 1) so an all-masked batch gives 0, not NaN;
N_seq = B. A sequence with no masked tokens contributes 0 to seq-mean-token-mean (n_i clamped to 1).

It imports torch and the algorithm registry only; it must never import another relayrl layer: the
algorithms are a leaf, which the trainer and the controller import.
"""

from __future__ import annotations

from torch import Tensor

from relayrl.algorithms.registry import get_aggregation, register_aggregation


def _num_tokens(mask: Tensor, num_tokens: float | Tensor | None) -> float | Tensor:
    return mask.sum().clamp(min=1.0) if num_tokens is None else num_tokens


def _num_seqs(mask: Tensor, num_seqs: float | Tensor | None) -> float | Tensor:
    return mask.shape[0] if num_seqs is None else num_seqs


@register_aggregation("token-mean")
def token_mean(values: Tensor, mask: Tensor, num_tokens=None, num_seqs=None) -> Tensor:
    return (values * mask).sum() / _num_tokens(mask, num_tokens)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(values: Tensor, mask: Tensor, num_tokens=None, num_seqs=None) -> Tensor:
    return (values * mask).sum() / _num_seqs(mask, num_seqs)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(values: Tensor, mask: Tensor, num_tokens=None, num_seqs=None) -> Tensor:
    per_seq = (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / _num_seqs(mask, num_seqs)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
) -> Tensor:
    """Reduce values [B, T] under mask [B, T] with the named mode (see the module docstring)."""
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    return get_aggregation(mode)(values, mask, num_tokens=num_tokens, num_seqs=num_seqs)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of values over mask > 0 (0 when nothing is masked in); for statistics, not losses."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max of values over mask > 0 (0 when nothing is masked in); for statistics."""
    keep = mask > 0
    if not bool(keep.any()):
        return values.new_zeros(())
    return values[keep].max()
