"""This module makes the samples of one request: `params.n` Sequences, each drawing from a random stream of its own.

    stream j    random.Random(f"{params.seed}:{j}") when the request is seeded, else seeded by the engine's own
                generator: a sample's tokens depend on its stream and its logits only, not on the batch around it
    resumed     with `prior` (what abort() returned: (token_ids, logprobs) or (token_ids, logprobs, versions)
                per sample), a sample starts with those tokens and its stream advanced past them, one draw
                each, so the rest equals an uninterrupted run under the same weights; without versions those
                tokens' version is -1 (unknown)

It imports the engine's own modules only; like the whole engine, it must never import the trainer, sync, the
controller or the CLI.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from collections.abc import Sequence as Seq

from relayrl.engine.sampling_params import SamplingParams
from relayrl.engine.sequence import Sequence


def new_samples(ids: list[int], params: SamplingParams, request_id: int, prior: Seq[tuple] | None, *,
                seq_ids: Iterator[int], rng: random.Random, block_size: int, step: int, where: str) -> list[Sequence]:
    """The request's samples, numbered from seq_ids, queued at engine step `step` (their SampleCost's clock)."""
    seqs = []
    for j in range(params.n):
        done_tokens, done_lps, *done_versions = prior[j] if prior else ([], [])
        if len(done_versions) > 1:
            raise ValueError(f"{where}: a prior item is (token_ids, logprobs) or (token_ids, logprobs, "
                             f"versions), got {len(done_versions) + 2} fields")
        stream = random.Random(f"{params.seed}:{j}" if params.seed is not None else rng.getrandbits(64))
        for _ in done_tokens:
            stream.random()
        seqs.append(Sequence(next(seq_ids), ids, params, block_size, request_id=request_id, sample_index=j,
                             rng=stream, completion_token_ids=list(done_tokens), completion_logprobs=list(done_lps),
                             completion_versions=list(done_versions[0]) if done_versions else None))
        seqs[-1].cost.added_step = step
    return seqs
