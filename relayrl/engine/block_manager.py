"""The block manager decides where each sequence's KV lives: in a pool of fixed-size blocks,
reference-counted and prefix-cached.

The KV cache is `num_blocks` blocks of `block_size` token slots. A sequence's block table maps its
logical blocks to physical ones; token position p lives in slot

    block_table[p // block_size] * block_size + p % block_size

Prefix caching. Every FULL block gets a hash chained through all the blocks before it,

    h_0 = H(-1, tokens of block 0)      h_i = H(h_{i-1}, tokens of block i)
    H(prev, toks) = blake2b(little-endian int64 bytes of [prev, *toks], 8-byte digest) as signed int64

so equal hashes mean equal whole prefixes (and the stored token ids are compared too, in case two
prefixes collide). At allocate, the leading full blocks whose hash is cached are shared (ref_count
+1) instead of recomputed; the first miss ends the hits, because the engine computes KV from
`num_cached_tokens` onwards and must never overwrite a shared block.

    seq A  [ a b c d ][ e f g h ][ i ]          block table [ 7 ][ 3 ][ 9 ]
    seq B  [ a b c d ][ e f g h ][ x y ]        block table [ 7 ][ 3 ][ 5 ]   7, 3: ref_count 2

Weights versions. KV is only valid for the weights that computed it, so the chain starts from a salt
of the version the sequence's KV is computed under instead of -1:

    h_0 = H(salt(v), tokens of block 0)      salt(0) = -1 (a never-updated engine hashes as before),
                                             salt(v) = H(-2, [v]) for v > 0

`version` is the engine's current weights version (start_version() at each weight update); allocate
records it as `seq.kv_version`, and every block that sequence registers later (may_append, deallocate)
chains from salt(seq.kv_version). A sequence that keeps its KV across an update (the engine's
partial="keep_kv") thus keeps registering under the OLD version's salt: its blocks hold KV of the old
weights, or new tokens' KV that attended to it, and a request admitted under the new version, which
looks up salt(new) chains only, never hits them. A sequence that recomputes its KV (a preemption, or
partial="reprefill") is allocated again under the new version and shares its blocks from then on.

The block holding a sequence's LAST token is never a hit, even when it is full and cached: the engine
must run at least that token to get the logits of the next one (num_cached_tokens <= num_tokens - 1;
only a fork, below, has num_cached_tokens = num_tokens: its parent runs that token in the same batch).

Free list = LRU eviction. A block whose ref_count drops to 0 joins the END of the free list but keeps
its hash, so a later sequence with the same prefix can still hit it (taking it back out of the free
list). A fresh block is taken from the FRONT (least recently freed); only then is its old hash
dropped from the cache. A sequence frees its blocks last-to-first, so its tail is evicted before
its head (heads are the most shared).

Forks (n > 1 samples of one prompt). The scheduler allocates the first sample and forks the others
from it in the same prefill batch: fork(parent, child) gives the child the parent's whole block table,
every block ref-counted +1, the partly filled last block included, and marks all its tokens computed
(num_cached_tokens = num_tokens): the batch computes the prompt's KV once and every sample draws its
first token from the parent's last-position logits.

    parent  [ a b c d ][ e f g h ][ i . . . ]     block table [ 7 ][ 3 ][ 9 ]   7, 3, 9: ref_count 3
    child   (same table)  child 2 (same table)

Copy-on-write. Every block of a table is read-only while shared, except the last one, into which the
next decode writes the newest token. may_append sees that that block is shared (ref_count > 1) and
gives the sequence a fresh block instead: it takes one from the free list, puts it in place of the
shared one in the sequence's table (ref_count of the shared one -1) and queues the copy (shared block,
fresh block), which the engine hands to every rank with the next batch (take_copies), to be done
before anything of that batch is written. The last sibling left holding the block (ref_count 1) writes
in place. So a decode step in which G forked samples write their first token costs G - 1 fresh blocks
and G - 1 block copies, and never changes a sibling's KV:

    decode 1:  child 1 [ 7 ][ 3 ][ 12 ] <- copy of 9, then writes its token at slot 1
               child 2 [ 7 ][ 3 ][ 14 ] <- copy of 9, ...      parent [ 7 ][ 3 ][ 9 ] writes in place

A fork is no prefix-cache lookup (prefix_queries and prefix_hits leave it out: the hit rate stays the
share of allocated prompt tokens found cached); forked_tokens counts the tokens forks did not compute.
A partial block is never hashed, whoever holds it; full shared blocks are hashed once (the first
holder to register one; the others find its hash set).

Who writes when (the protocol with the scheduler and the engine):

    prefill:  allocate(seq)     -> blocks for all num_tokens tokens; full blocks are hashed and
                                   registered now (the engine writes all KV of a batch before any
                                   attention reads it, so prompts of one batch sharing a prefix
                                   can share the first one's blocks)
              fork(seq, child)  -> child shares all of seq's blocks (seq allocated in this batch);
                                   nothing of child is computed; it samples from seq's logits
    run:      KV of tokens [num_cached_tokens, num_tokens) written; next token sampled
    post:     seq.append_token(t, lp)   -> the newest token has no KV yet, maybe no slot yet
    decode:   can_append(seq)   -> a slot for the newest token exists in a block seq alone holds, or
                                   one free block does
              may_append(seq)   -> opens that block if needed; a block is opened exactly when the one
                                   before it became full with all its KV already written, so that
                                   one is hashed and registered now; a shared last block is copied
                                   on write (above)
    run:      the copies first, then KV of the newest token written; next token sampled; post ...

Hence the cache only ever holds blocks whose KV is written (or written within the current batch).

It imports the standard library and the engine's Sequence only; like the whole engine, it must never
import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from relayrl.engine.sequence import Sequence


def block_hash(prev_hash: int, token_ids: list[int]) -> int:
    """Chained hash of one full block; deterministic across processes and machines."""
    data = struct.pack(f"<{len(token_ids) + 1}q", prev_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def version_salt(version: int) -> int:
    """Where the hash chain of KV computed under weights `version` starts (-1 for version 0)."""
    return -1 if version == 0 else block_hash(-2, [version])


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "num_tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None          # set once the block is full (and prefix caching is on)
        self.token_ids: list[int] = []        # the tokens behind `hash`, to reject hash collisions
        self.num_tokens = 0                   # live token slots, for utilisation()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [_Block(i) for i in range(num_blocks)]
        # ref_count == 0, least recently freed first; never-used blocks start at the front so they
        # are handed out before any block that still holds a reusable prefix
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}     # hash -> block id
        self.prefix_queries = 0               # tokens looked up at allocate
        self.prefix_hits = 0                  # of those, tokens served from the cache
        self.forked_tokens = 0                # tokens forks shared instead of computing (not lookups)
        self._copies: list[tuple[int, int]] = []  # copy-on-write (shared block, fresh block) not yet run
        self.version = 0                      # weights version new allocations compute their KV under

    # -- stats ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def utilisation(self) -> float:
        """Token slots holding live tokens / slots of the blocks in use (1.0 when none is in use)."""
        used = [b for b in self.blocks if b.ref_count > 0]
        if not used:
            return 1.0
        return sum(b.num_tokens for b in used) / (len(used) * self.block_size)

    def used_fraction(self) -> float:
        return (self.num_blocks - len(self._free)) / self.num_blocks

    # -- prefill -------------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        # a hit on an in-use block costs nothing; a hit on a free cached block still takes that block
        # out of the free list, so it counts like a fresh one
        hits = self._prefix_hits(seq, self._full_block_hashes(seq))
        shared = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return seq.num_blocks - shared <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks {seq.block_table}; deallocate first")
        hashes = self._full_block_hashes(seq)
        hits = self._prefix_hits(seq, hashes)
        if seq.num_blocks - sum(1 for b in hits if self.blocks[b].ref_count > 0) > len(self._free):
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}; call can_allocate first")
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            block.num_tokens = self.block_size
            seq.block_table.append(block_id)
        for i in range(len(hits), seq.num_blocks):
            block = self._take_free_block()
            block.num_tokens = len(seq.block_tokens(i))
            if i < len(hashes):
                self._register(block, hashes[i], seq.block_tokens(i))
            seq.block_table.append(block.block_id)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.kv_version = self.version
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child (the same tokens as parent, which was allocated in this prefill batch) shares all of
        parent's blocks, the partly filled last one included; its KV is the parent's (computed in this
        batch), so nothing of it is computed. Costs no free block now; its first write into the shared
        last block costs one (copy-on-write, may_append)."""
        if child.block_table:
            raise RuntimeError(f"sequence {child.seq_id} already holds blocks {child.block_table}; deallocate first")
        if child.token_ids != parent.token_ids or len(parent.block_table) != parent.num_blocks:
            raise RuntimeError(f"sequence {child.seq_id} cannot fork from {parent.seq_id}: a fork has the parent's "
                               f"tokens, and the parent holds blocks for all of them")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_cached_tokens = child.num_tokens
        child.kv_version = parent.kv_version
        self.forked_tokens += child.num_tokens

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies (shared block, fresh block) may_append queued since the last call,
        for the next batch to run before it writes anything."""
        copies, self._copies = self._copies, []
        return copies

    def forget_cached(self) -> None:
        """Drop every cached prefix (the KV they hold was computed by weights that changed). Only with no
        sequence holding blocks: every block is free, and keeps its place in the LRU order."""
        if len(self._free) != self.num_blocks:
            raise RuntimeError("forget_cached() while sequences hold blocks")
        for block in self.blocks:
            block.hash, block.token_ids = None, []
        self._cached.clear()

    def start_version(self, version: int) -> None:
        """New weights: later allocations compute (and look up) KV under `version`. Cached prefixes in free
        blocks are dropped, since nothing can hit them any more; blocks that sequences hold keep their
        hashes, because those sequences (keeping their KV) go on chaining from them under their old version."""
        if version <= self.version:
            raise ValueError(f"weights versions only grow: at {self.version}, asked to start {version}")
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self._cached.get(block.hash) == block_id:
                    del self._cached[block.hash]
                block.hash, block.token_ids = None, []
        self.version = version

    def deallocate(self, seq: Sequence) -> None:
        self._register_last_full_block(seq)
        # last block first: the tail of a sequence is the least likely to be shared, so it should be
        # the first evicted
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table.clear()
        seq.num_cached_tokens = seq.num_routed = 0  # the slots (KV and routing) are no longer its own

    def _register_last_full_block(self, seq: Sequence) -> None:
        """A sequence that ends (or is preempted) right after filling a block leaves that block full, its
        KV written, but not yet hashed: may_append hashes a block only when the next one opens. Register
        it now, so the next turn of an episode (or the preempted sequence's recompute) hits it too.
        Between steps the KV of every token but the newest is written, hence the `<= num_tokens - 1`."""
        if not self.enable_prefix_caching or not seq.block_table:
            return
        last = len(seq.block_table) - 1
        block = self.blocks[seq.block_table[last]]
        if block.hash is None and len(seq.block_table) * self.block_size <= seq.num_tokens - 1:
            prev = self.blocks[seq.block_table[last - 1]].hash if last > 0 else version_salt(seq.kv_version)
            if prev is None:  # a chain with a gap is no prefix (cannot happen: earlier blocks are hashed)
                return
            tokens = seq.block_tokens(last)
            self._register(block, block_hash(prev, tokens), tokens)

    # -- decode --------------------------------------------------------------------------------------
    def can_append(self, seq: Sequence) -> bool:
        """Is there a slot for the KV of seq's newest token (already appended, KV not yet written)?"""
        return self._has_own_slot(seq) or len(self._free) >= 1

    def _has_own_slot(self, seq: Sequence) -> bool:
        """The newest token's slot exists, in a block no other sequence holds (so it may be written)."""
        return len(seq.block_table) >= seq.num_blocks and self.blocks[seq.block_table[-1]].ref_count == 1

    def may_append(self, seq: Sequence) -> None:
        """Make sure the newest token has a slot; called by the scheduler after can_append succeeds.

        A new block is needed exactly when the newest token starts one (num_tokens % block_size == 1
        for block_size > 1). The block before it is then full and all its KV was written by earlier
        steps, so it is hashed and registered here. A newest token whose block is shared (forks) gets
        a copy of it (copy-on-write, see the module docstring). Idempotent: a second call changes nothing.
        """
        missing = seq.num_blocks - len(seq.block_table)
        if missing > 1:
            raise RuntimeError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens but blocks for at most "
                f"{len(seq.block_table) * self.block_size}: append one token per decode step, then schedule"
            )
        if missing == 1:
            last = len(seq.block_table) - 1
            if self.enable_prefix_caching and last >= 0 and self.blocks[seq.block_table[last]].hash is None:
                # every earlier full block was hashed at allocate or when its successor opened
                prev = self.blocks[seq.block_table[last - 1]].hash if last > 0 else version_salt(seq.kv_version)
                tokens = seq.block_tokens(last)
                self._register(self.blocks[seq.block_table[last]], block_hash(prev, tokens), tokens)
            block = self._take_free_block()
            seq.block_table.append(block.block_id)
        elif self.blocks[seq.block_table[-1]].ref_count > 1:  # a fork's shared last block: copy on write
            shared = self.blocks[seq.block_table[-1]]
            block = self._take_free_block()
            shared.ref_count -= 1
            seq.block_table[-1] = block.block_id
            self._copies.append((shared.block_id, block.block_id))
        # the last block is now this seq's alone (never a prefix hit, copied if forked), so its count is too
        self.blocks[seq.block_table[-1]].num_tokens = seq.last_block_num_tokens

    # -- internals -----------------------------------------------------------------------------------
    def _full_block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of seq's full blocks (empty when prefix caching is off)."""
        if not self.enable_prefix_caching:
            return []
        hashes, prev = [], version_salt(self.version)  # the KV an allocation now computes is of this version
        for i in range(seq.num_tokens // self.block_size):
            prev = block_hash(prev, seq.block_tokens(i))
            hashes.append(prev)
        return hashes

    def _prefix_hits(self, seq: Sequence, hashes: list[int]) -> list[int]:
        """Block ids of the leading cached blocks, never including the block of the last token."""
        hits = []
        hittable = (seq.num_tokens - 1) // self.block_size  # full blocks before the last token's block
        for i in range(min(hittable, len(hashes))):
            block_id = self._cached.get(hashes[i])
            if block_id is None or self.blocks[block_id].token_ids != seq.block_tokens(i):
                break
            hits.append(block_id)
        return hits

    def _take_free_block(self) -> _Block:
        if not self._free:
            raise RuntimeError("no free KV block; the scheduler must check can_allocate / can_append first")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict: the slots are about to be overwritten
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
            block.hash = None
            block.token_ids = []
        block.ref_count = 1
        block.num_tokens = 0
        return block

    def _register(self, block: _Block, h: int, tokens: list[int]) -> None:
        # the newest copy wins: it is the one most likely to stay in use (an older copy with the same
        # prefix is usually a freed block nearer eviction)
        block.hash = h
        block.token_ids = list(tokens)
        self._cached[h] = block.block_id
