"""A Sequence is one sequence the paged engine is generating: its tokens, logprobs, status and block table.

    token_ids:   [ prompt ........................ | completion ............ ]
                   0 .. num_prompt_tokens-1          one logprob per token
    blocks:      [ blk 0 ][ blk 1 ][ blk 2 ][ blk 3 (last, maybe partial) ]
    block_table:  physical block id of each logical block (filled by the BlockManager)
    num_cached_tokens: the leading tokens whose KV is already valid in the blocks (prefix-cache hits),
                       so the next prefill computes only token_ids[num_cached_tokens:]

A sequence may start with a partial completion (a request resumed after an abort): its completion
tokens are then ordinary tokens that need KV at the next prefill, exactly like the prompt's.

Policy versions. `versions` holds, per completion token, the engine's weights version that sampled it
(-1: unknown, a resumed token whose version was not given). `kv_version` is the weights version the KV
in `block_table` was computed under, set by the BlockManager at allocate: a sequence that keeps its KV
across a weight update (the engine's partial="keep_kv") keeps the old kv_version, so the prefix cache
never offers its (stale, mixed) blocks to a sequence of the new version.
Forks. `fork_parent` is set by the scheduler for one prefill batch: None for a sequence the batch
computes, the sibling whose prefill (and last-position logits) a forked sample shares otherwise
(relayrl.engine.block_manager); `fork_rows` maps such a batch to the sequences run and the logits row
of each. It is stale after that batch and read nowhere else.
Routing (an MoE engine's record_routing, relayrl.engine.routing). `num_routed` leading tokens have their routing
written in the engine's per-slot store (those whose KV the engine computed or found cached; 0 once the blocks are
freed); `pending_finish` holds the finish reason of a sample whose final token still has to run once for its
routing; `routing` is the gathered [num_tokens, n_moe, k] record, set when the sample ends.
The engine owns `params` (a SamplingParams) and `rng`; nothing here reads them except
`params.max_tokens`, which the scheduler uses to check that the sequence can ever fit in the pool.

It imports the standard library and relayrl.engine.outputs (SampleCost) only; like the whole engine, it must
never import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import enum

from relayrl.engine.outputs import SampleCost


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # in the scheduler's waiting queue: no blocks held
    RUNNING = enum.auto()   # holds blocks for all its tokens (except, between steps, the newest one)
    FINISHED = enum.auto()  # done (stop, length or abort): blocks released


class Sequence:
    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params,
        block_size: int,
        *,
        request_id: int = 0,
        sample_index: int = 0,
        rng=None,
        completion_token_ids: list[int] = (),
        completion_logprobs: list[float] = (),
        completion_versions: list[int] | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"sequence {seq_id}: the prompt is empty; give at least one token")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if len(completion_token_ids) != len(completion_logprobs):
            raise ValueError(
                f"sequence {seq_id}: {len(completion_token_ids)} completion tokens but "
                f"{len(completion_logprobs)} logprobs; a resumed completion needs one logprob per token"
            )
        if completion_versions is not None and len(completion_versions) != len(completion_token_ids):
            raise ValueError(
                f"sequence {seq_id}: {len(completion_token_ids)} completion tokens but "
                f"{len(completion_versions)} versions; a resumed completion needs one version per token"
            )
        self.seq_id = seq_id
        self.request_id = request_id
        self.sample_index = sample_index
        self.params = params
        self.rng = rng
        self.block_size = block_size
        self.token_ids: list[int] = [int(t) for t in prompt_token_ids] + [int(t) for t in completion_token_ids]
        self.num_prompt_tokens = len(prompt_token_ids)
        self.logprobs: list[float] = [float(x) for x in completion_logprobs]
        self.versions: list[int] = ([int(v) for v in completion_versions] if completion_versions is not None
                                    else [-1] * len(completion_token_ids))
        self.kv_version = 0  # the weights version the KV in block_table was computed under (set at allocate)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.fork_parent: Sequence | None = None  # this prefill's sibling it shares KV and logits with
        self.finish_reason: str | None = None
        self.text: str | None = None
        # per completion token, {token id: logprob} of the params.logprobs most likely tokens (when asked)
        self.top_logprobs: list[dict[int, float]] = []
        self.cost = SampleCost()  # tokens computed, keys attended, engine steps (filled in by the engine)
        self.num_routed = 0  # leading tokens whose routing is in the engine's store (record_routing)
        self.pending_finish: str | None = None  # ends after its final token runs once more (record_routing)
        self.routing = None  # [num_tokens, n_moe, k] int16, gathered when it ends (record_routing)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_blocks(self) -> int:
        """Logical blocks needed to hold the KV of every token (ceil(num_tokens / block_size))."""
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block_tokens(self, i: int) -> list[int]:
        """The tokens of logical block i (fewer than block_size only for the last block)."""
        if not 0 <= i < self.num_blocks:
            raise IndexError(f"sequence {self.seq_id} has {self.num_blocks} blocks, asked for block {i}")
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    # -- growth --------------------------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: float, version: int = -1) -> None:
        """Record a sampled token and the weights version that sampled it (-1: unknown). Its KV is not
        written yet: the next decode step writes it."""
        self.token_ids.append(int(token_id))
        self.logprobs.append(float(logprob))
        self.versions.append(int(version))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_prompt_tokens}+"
            f"{self.num_completion_tokens}, blocks={self.block_table}, cached={self.num_cached_tokens})"
        )


def fork_rows(seqs: list[Sequence]) -> tuple[list[Sequence], list[int] | None]:
    """A prefill batch -> (the sequences it computes, the logits row of every sequence in `seqs`; None
    when there are no forks). A fork reads its parent's row, so each sample draws its own token from
    the same logits."""
    run = [s for s in seqs if s.fork_parent is None]
    if len(run) == len(seqs):
        return seqs, None
    row = {s.seq_id: i for i, s in enumerate(run)}
    return run, [row[(s.fork_parent or s).seq_id] for s in seqs]
