"""This module keeps the rollout engine's figures: what `LLMEngine.stats()` reports and what each sample cost.

    engine-wide  since construction or the last reset (wake() resets): the prefix cache's hit rate, the peak
                 share of blocks in use and how full those blocks were then, the most sequences running (holding
                 KV) and waiting (queued) at once after a schedule, preemptions and re-prefills, the
                 tokens prefills computed, samples forked from a sibling's prefill and, with record_routing,
                 the experts' load imbalance
    per sample   its SampleCost (relayrl.engine.outputs): tokens computed, keys attended, logit positions

Most counters live where they are counted (the block manager, the scheduler, the routing store); EngineStats
reads and resets them there, and keeps the one figure nothing else sees: the block pool at its peak.

It imports the engine's own modules only; like the whole engine, it must never import the trainer, sync, the
controller or the CLI.
"""

from __future__ import annotations

from relayrl.engine.block_manager import BlockManager
from relayrl.engine.routing import RoutingStore
from relayrl.engine.scheduler import Scheduler
from relayrl.engine.sequence import Sequence


class EngineStats:
    """The engine's figures; the pieces that count are passed in (the engine replaces them: wake, a failed step)."""

    def __init__(self, sliding_window: int | None, expert_placement: str, tp_size: int):
        self.sliding_window, self.expert_placement, self.tp_size = sliding_window, expert_placement, tp_size
        self.peak_used_fraction = self.utilisation_at_peak = 0.0
        self.peak_running = self.peak_waiting = 0

    def observe_queue(self, scheduler: Scheduler) -> None:
        """After a schedule: the sequences running (admitted, holding KV) and waiting (queued) now."""
        self.peak_running = max(self.peak_running, len(scheduler.running))
        self.peak_waiting = max(self.peak_waiting, len(scheduler.waiting))

    def observe_blocks(self, block_manager: BlockManager) -> None:
        """Before a batch runs: at the peak, how full are the blocks in use? (the last step at the peak counts:
        blocks fill up while no new one is needed)"""
        used = block_manager.used_fraction()
        if used >= self.peak_used_fraction:
            self.peak_used_fraction, self.utilisation_at_peak = used, block_manager.utilisation()

    def count(self, seqs: list[Sequence], is_prefill: bool) -> None:
        """Add what this batch computed to each sequence's cost: the tokens prepare() ran (a prefill from the
        first uncached token, a decode its newest), the keys each attended to (p + 1 at position p, at
        most the sliding window) and one logit position (the model's lm_head runs at its last token only)."""
        window = self.sliding_window
        for s in seqs:
            if is_prefill and s.fork_parent is not None:  # its parent computed it all
                continue
            start = s.num_cached_tokens if is_prefill else s.num_tokens - 1
            s.cost.computed_tokens += s.num_tokens - start
            s.cost.logit_positions += 1
            if window is None:  # sum of p + 1 over p in [start, num_tokens)
                s.cost.attended += (s.num_tokens * (s.num_tokens + 1) - start * (start + 1)) // 2
            else:
                s.cost.attended += sum(min(p + 1, window) for p in range(start, s.num_tokens))

    def reset(self, block_manager: BlockManager, scheduler: Scheduler, routing: RoutingStore | None) -> None:
        block_manager.prefix_queries = block_manager.prefix_hits = 0
        block_manager.forked_tokens = 0
        scheduler.num_preemptions = scheduler.num_reprefills = 0
        scheduler.num_prefill_tokens = scheduler.num_forks = 0
        self.peak_used_fraction = self.utilisation_at_peak = 0.0
        self.peak_running = self.peak_waiting = 0
        if routing is not None:
            routing.load.zero_()

    def report(self, block_manager: BlockManager, scheduler: Scheduler,
               routing: RoutingStore | None) -> dict[str, float]:
        """The figures by name (see the module docstring)."""
        return {"engine/prefix_hit_rate": block_manager.hit_rate,
                "engine/prefix_lookup_tokens": float(block_manager.prefix_queries),  # the rate's denominator
                "engine/peak_blocks_used": self.peak_used_fraction,
                "engine/block_utilisation_at_peak": self.utilisation_at_peak,
                "engine/peak_running": float(self.peak_running), "engine/peak_waiting": float(self.peak_waiting),
                "engine/preemptions": float(scheduler.num_preemptions),
                "engine/reprefills": float(scheduler.num_reprefills),
                "engine/prefill_tokens": float(scheduler.num_prefill_tokens),
                "engine/forked_samples": float(scheduler.num_forks), **self._expert_stats(routing)}

    def _expert_stats(self, routing: RoutingStore | None) -> dict[str, float]:
        """With record_routing: the expert load's imbalance (relayrl.engine.routing), over experts and, under
        expert_placement "ep" at TP > 1, over the ranks (what the most loaded rank makes the others wait for)."""
        if routing is None:
            return {}
        out = {"engine/expert_load_max_over_mean": routing.load_max_over_mean()}
        if self.expert_placement == "ep" and self.tp_size > 1:
            out["engine/ep_rank_load_max_over_mean"] = routing.load_max_over_mean(self.tp_size)
        return out
