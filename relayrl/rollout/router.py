"""This module decides which engine replica of a rollout fleet runs each request: least outstanding work, with
prefix affinity, the idea of SGLang's cache-aware router (sgl-router) at the engine's block granularity.

    a request = a prompt's token ids with its n samples (the G samples of a group never split: the engine forks
                them from one prefill), and its work = prompt tokens + n * max_tokens (what it may compute)

    route(ids, work):
        matched[r]  the leading FULL blocks of `ids` replica r holds, in tokens (the engine caches whole blocks
                    only, chained: block i is a hit only if blocks 0..i-1 are; relayrl.engine.block_manager)
        least       the replica with the least outstanding work (ties: the lowest index)
        best        the replica with the longest match (ties: the least loaded, then the lowest index)
        affinity    matched[best] / len(ids) >= cache_threshold, and best is not over the load bound:
                        over  <=>  load[best] - load[least] > balance_abs  and  load[best] > balance_rel * load[least]
                    (SGLang's imbalance test, applied to the cached replica against the least loaded one)
        -> best if affinity, else least; its load grows by `work`, and it now holds the prompt's blocks
    done(r, work): a request finished on replica r (its work leaves the load; its blocks stay, as the engine's
                   prefix cache keeps them)
    forget():      new weights: no replica's cache is worth anything (the engine salts its block hashes by the
                   weights version), so every table is emptied
    route(..., among=[...]): only those replicas may take it (the fleet passes the live ones in service: not lost,
                   not draining, not behind the staleness bound); clear(r): replica r was replaced by a fresh engine
                   (its table emptied); add(): one more replica, numbered after the others (numbers never reused)

A replica's table keeps at most `capacity_blocks` block hashes, the least recently used dropped first (the engine's
own eviction is of free blocks, least recently freed: the table approximates it, as sgl-router's radix tree
approximates each worker's cache). Routing never changes what is sampled: a request's samples draw from its own
seeded streams (SamplingParams.seed), whatever replica and batch they run in.

Like the rest of relayrl.rollout, it imports the engine and the layers below; never the roles, the loop or the jobs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from relayrl.engine.block_manager import block_hash

CACHE_THRESHOLD = 0.5  # the share of a prompt that must be cached for affinity to count (sgl-router: 0.3-0.5)
BALANCE_ABS = 256  # tokens of outstanding work a cached replica may carry beyond the least loaded one...
BALANCE_REL = 1.25  # ...or this multiple of it, whichever is larger (both must be exceeded to fall back)
CAPACITY_BLOCKS = 1 << 16


def prefix_hashes(ids: list[int], block_size: int) -> list[int]:
    """The chained hash of each full block of `ids` (the last partial block has none)."""
    out, h = [], -1
    for i in range(0, len(ids) - block_size + 1, block_size):
        h = block_hash(h, ids[i:i + block_size])
        out.append(h)
    return out


@dataclass
class ReplicaCounters:
    """One replica's figures since the last reset (the step's), and its load now."""

    outstanding: int = 0  # tokens of work routed to it and not done
    requests: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0  # prompt tokens it held cached when routed (the router's view of its hit rate)
    by_affinity: int = 0  # requests sent for their cached prefix, not for being the least loaded

    def reset(self) -> None:
        self.requests = self.prompt_tokens = self.matched_tokens = self.by_affinity = 0

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Router:
    """Least outstanding work with prefix affinity over `replicas` engine replicas (see the module docstring)."""

    def __init__(self, replicas: int, block_size: int, *, cache_threshold: float = CACHE_THRESHOLD,
                 balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL,
                 capacity_blocks: int = CAPACITY_BLOCKS):
        if replicas < 1 or block_size < 1 or capacity_blocks < 1:
            raise ValueError(f"a router needs replicas, block_size and capacity_blocks >= 1, got {replicas}, "
                             f"{block_size}, {capacity_blocks}")
        self.block_size, self.cache_threshold = block_size, cache_threshold
        self.balance_abs, self.balance_rel, self.capacity_blocks = balance_abs, balance_rel, capacity_blocks
        self.counters = [ReplicaCounters() for _ in range(replicas)]
        self.tables: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]

    @property
    def replicas(self) -> int:
        return len(self.counters)

    def load(self, r: int) -> int:
        return self.counters[r].outstanding

    def matched_tokens(self, hashes: list[int], r: int) -> int:
        table, n = self.tables[r], 0
        for h in hashes:
            if h not in table:
                break
            n += 1
        return n * self.block_size

    def over_bound(self, r: int, least: int) -> bool:
        a, b = self.load(r), self.load(least)
        return a - b > self.balance_abs and a > self.balance_rel * b

    def route(self, ids: list[int], work: int, among: Sequence[int] | None = None) -> int:
        """The replica that runs this request (one of `among`, default every replica); its load and table take the
        request in."""
        R = range(self.replicas) if among is None else sorted(set(among))
        if not R:
            raise ValueError("no replica may take the request")
        hashes = prefix_hashes(ids, self.block_size)
        matched = {r: self.matched_tokens(hashes, r) for r in R}
        least = min(R, key=lambda r: (self.load(r), r))
        best = min(R, key=lambda r: (-matched[r], self.load(r), r))
        affine = (matched[best] > 0 and matched[best] >= self.cache_threshold * len(ids)
                  and not self.over_bound(best, least))
        r = best if affine else least
        c = self.counters[r]
        c.outstanding += work
        c.requests += 1
        c.prompt_tokens += len(ids)
        c.matched_tokens += matched[r]
        c.by_affinity += int(affine and best != least)
        self._insert(r, hashes)
        return r

    def _insert(self, r: int, hashes: list[int]) -> None:
        table = self.tables[r]
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.capacity_blocks:
            table.popitem(last=False)

    def done(self, r: int, work: int) -> None:
        self.counters[r].outstanding -= work

    def forget(self) -> None:
        for t in self.tables:
            t.clear()

    def clear(self, r: int) -> None:
        """Replica r is a fresh engine now (restarted): it holds no prefix, and no work of the lost one."""
        self.tables[r].clear()
        self.counters[r].outstanding = 0

    def add(self) -> int:
        """One more replica; its number."""
        self.counters.append(ReplicaCounters())
        self.tables.append(OrderedDict())
        return len(self.counters) - 1

    def reset_counters(self) -> None:
        for c in self.counters:
            c.reset()
