"""The scheduler decides what runs next: continuous batching over a paged KV pool, prefill first,
preemption by recompute.

    add ──> waiting (FIFO) ──prefill──> running (FIFO) ──finish / abort──> FINISHED (blocks freed)
               ^                            │
               └─────── preempt (last) ─────┘   blocks freed; tokens and logprobs kept

Each call to `schedule()` returns one batch, either all prefill or all decode:

1. Prefill, if any waiting sequence can start. Take waiting sequences in FIFO order while
     - running + batch stays under max_num_seqs (so a decode step always covers every running
       sequence and none of them waits behind the others),
     - the batch's new tokens fit in max_num_batched_tokens (a sequence is estimated at num_tokens
       before allocation and charged num_tokens - num_cached_tokens after, so prefix hits leave room
       for more; the first sequence is always admitted, so a huge prompt cannot starve),
     - the block manager can allocate it.
   The first sequence that does not fit stops the scan (FIFO: no overtaking).
   Forks (fork_samples, the default): a waiting sequence with the same request and the same tokens as
   one already allocated in this batch (the n samples of a fresh prompt) is forked from it instead
   (BlockManager.fork: all its blocks shared, nothing computed, its first token drawn from the same
   logits); it costs no block and no token of the budget, only its place under max_num_seqs.
2. Otherwise decode every running sequence (FIFO, at most max_num_seqs). Each needs a slot for the
   KV of its newest token; while the pool has none, the LAST running sequence is preempted (it is
   the most recently admitted, so it has the least work to redo). If that is the sequence itself,
   it is preempted and the scan stops.

The step protocol with the engine (see block_manager for the block side):

    schedule() ── prefill: allocate -> blocks for every token; KV of [num_cached_tokens, num_tokens)
               │           (or fork -> the parent's blocks, seq.fork_parent set)
               └─ decode:  can_append + may_append -> block for the newest token (copy-on-write of
                           a fork's shared last block: BlockManager.take_copies)
                  after either, every scheduled seq has len(block_table) == seq.num_blocks
    run        ── write that KV, sample one token per sequence
    postprocess── seq.append_token(t, lp); if it is done: scheduler.finish(seq, reason)
                  (the new token's KV is written by the next decode step)

`add` admits a sequence only if the pool could hold it alone at its longest: KV for

    min(prompt + max_tokens, max_model_len) - 1 tokens      (the final token is never fed back)

so a max_tokens past the model's maximum length reserves nothing more (the engine ends that sample at
the maximum, finish_reason "length"); one that can never fit is refused with a `KVCacheError` saying
how much KV it and a maximum-length sequence need, and which key to raise.

A preempted sequence loses its blocks and goes back to the FRONT of the waiting queue; its next
prefill recomputes the KV of all its tokens (prompt + completion so far, the newest included), which
prefix caching often shortens. Nothing sampled is ever dropped.

`reprefill()` does the same to every running sequence at once, for a weight update that must not let
in-flight sequences continue on KV the old weights computed (the engine's partial="reprefill"); it is
counted in `num_reprefills`, not as preemptions, since no shortage of blocks caused it.

It imports the engine's block manager and Sequence, and relayrl.errors, only; like the whole engine, it
must never import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from collections import deque

from relayrl.engine.block_manager import BlockManager
from relayrl.engine.sequence import Sequence, SequenceStatus
from relayrl.errors import KVCacheError


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, *,
                 max_model_len: int | None = None, kv_bytes_per_block: int | None = None,
                 fork_samples: bool = True, feed_final_token: bool = False):
        """max_model_len: the model's maximum length (prompt and completion together); a sequence
        reserves KV for at most that many tokens. kv_bytes_per_block: only for error messages (in bytes).
        fork_samples: fork a request's samples from one prefill (False: each sample is allocated and
        prefilled on its own, its partly filled last block recomputed). feed_final_token: a sample's final
        token runs once more before it finishes (the engine's record_routing), so it reserves KV for it too."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs} and {max_num_batched_tokens}"
            )
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and a completion token), got {max_model_len}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_bytes_per_block = kv_bytes_per_block
        self.fork_samples = fork_samples
        self.feed_final_token = feed_final_token
        self.num_prefill_tokens = 0  # tokens prefill batches computed (forks and prefix hits excluded)
        self.num_forks = 0
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_reprefills = 0

    def final_length(self, seq: Sequence) -> int:
        """The most tokens seq can reach: prompt + max_tokens, capped at the model's maximum length."""
        n = seq.num_prompt_tokens + seq.params.max_tokens
        return min(n, self.max_model_len) if self.max_model_len is not None else n

    def max_kv_tokens(self, seq: Sequence) -> int:
        # the final sampled token finishes the sequence and is never fed back, so it needs no slot (unless it is
        # run once more for its routing: feed_final_token)
        return max(seq.num_tokens, self.final_length(seq) - (0 if self.feed_final_token else 1))

    def blocks_for(self, kv_tokens: int) -> int:
        return -(-kv_tokens // self.block_manager.block_size)

    def add(self, seq: Sequence) -> None:
        max_kv_tokens = self.max_kv_tokens(seq)
        needed = self.blocks_for(max_kv_tokens)
        if needed > self.block_manager.num_blocks:
            raise KVCacheError(self._too_small(seq, max_kv_tokens, needed))
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _too_small(self, seq: Sequence, kv_tokens: int, needed: int) -> str:
        bm, per_block = self.block_manager, self.kv_bytes_per_block

        def size(blocks: int) -> str:
            in_bytes = f" = {blocks * per_block} bytes" if per_block else ""
            return f"{blocks} blocks of {bm.block_size} tokens{in_bytes}"

        asked = seq.num_prompt_tokens + seq.params.max_tokens - 1
        capped = " (capped at the model's maximum length)" if kv_tokens < asked else ""
        msg = (f"sequence {seq.seq_id} (prompt {seq.num_prompt_tokens} tokens, max_tokens {seq.params.max_tokens}) "
               f"needs KV for {kv_tokens} tokens{capped} = {size(needed)}, "
               f"but the KV cache holds {size(bm.num_blocks)}")
        if self.max_model_len is not None:
            msg += (f"; one sequence of the model's maximum length ({self.max_model_len} tokens) needs "
                    f"{size(self.blocks_for(self.max_model_len - 1))}")
        if per_block:
            fix = f"raise kv_cache_bytes (rollout.kv_cache_bytes in a run config) to at least {needed * per_block}"
        else:
            fix = f"give the engine at least {needed} KV blocks"
        return f"{msg}. To run it, {fix}, or lower max_tokens or the prompt's length"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        batch = self._schedule_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def restart(self, block_manager: BlockManager) -> None:
        """Move to a fresh, empty block pool (after a failed step, whose KV writes are unknown): every
        running sequence goes back to the front of waiting, in order, keeping its tokens and logprobs;
        its next prefill recomputes its KV. Not counted as a preemption."""
        for seq in self.running:
            seq.block_table.clear()
            seq.num_cached_tokens = seq.num_routed = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.extendleft(reversed(self.running))
        self.running.clear()
        self.block_manager = block_manager

    def reprefill(self) -> None:
        """Every running sequence gives back its blocks and goes to the front of waiting, in order, keeping
        its tokens and logprobs: its next prefill recomputes the KV of all its tokens (after a weight update)."""
        for seq in self.running:
            self.block_manager.deallocate(seq)
            seq.status = SequenceStatus.WAITING
        self.waiting.extendleft(reversed(self.running))
        self.num_reprefills += len(self.running)
        self.running.clear()

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

    def abort(self, seq_ids: set[int]) -> list[Sequence]:
        aborted = []
        for queue in (self.waiting, self.running):
            for seq in [s for s in queue if s.seq_id in seq_ids]:
                queue.remove(seq)
                self.block_manager.deallocate(seq)  # no-op for a waiting seq: it holds no blocks
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                aborted.append(seq)
        return aborted

    # -- the two kinds of step -----------------------------------------------------------------------
    def _schedule_prefill(self) -> list[Sequence]:
        bm = self.block_manager
        batch: list[Sequence] = []
        new_tokens = 0
        # (request id, tokens held) -> the first sequence of that request allocated in this batch
        parents: dict[tuple[int, int], Sequence] = {}
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            parent = parents.get((seq.request_id, seq.num_tokens))
            if parent is not None and parent.token_ids == seq.token_ids:
                bm.fork(parent, seq)
                self.num_forks += 1
            else:
                if batch and new_tokens + seq.num_tokens > self.max_num_batched_tokens:
                    break
                if not bm.can_allocate(seq):
                    break
                bm.allocate(seq)
                parent = None
                new_tokens += seq.num_tokens - seq.num_cached_tokens
                if self.fork_samples:
                    parents.setdefault((seq.request_id, seq.num_tokens), seq)
            seq.fork_parent = parent
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            batch.append(seq)
        self.num_prefill_tokens += new_tokens
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        bm = self.block_manager
        batch: list[Sequence] = []
        while self.running and len(batch) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                bm.may_append(seq)
                batch.append(seq)
        # the scheduled ones go back to the front, in their order, ahead of any left unscheduled
        self.running.extendleft(reversed(batch))
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
