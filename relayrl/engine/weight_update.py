"""This module says what a weight update does to the rollout engine's requests in flight and to its prefix cache.

Asynchronous RL updates the weights between two engine steps with requests in flight; the engine's `partial`
(rollout.partial) says what happens to them at LLMEngine.end_weight_update:

    None        refused (RuntimeError): abort them first (the synchronous loop's contract)
    "keep_kv"   they keep their KV (computed by the old weights) and go on; their next tokens are
                sampled by the new weights and recorded with the new version
    "reprefill" every running one gives back its blocks and goes to the front of the waiting queue,
                in order, keeping its tokens: its next prefill recomputes its KV under the new weights
                (counted in stats() as engine/reprefills)

The prefix cache forgets what the old weights computed: with no block held it is emptied; with blocks held
(keep_kv) it starts the new version, and entries carry the version their KV was computed under
(relayrl.engine.block_manager), so a request admitted under new weights never reads KV of old ones.

It imports the engine's own modules and relayrl.errors; like the whole engine, it must never import the
trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from relayrl.engine.block_manager import BlockManager
from relayrl.engine.scheduler import Scheduler
from relayrl.errors import ConfigError

PARTIAL = (None, "keep_kv", "reprefill")  # what a weight update does to requests in flight


def check_partial(value: str | None) -> str | None:
    if value not in PARTIAL:
        raise ConfigError(f"partial (rollout.partial) must be one of {', '.join(map(str, PARTIAL))}, "
                          f"got {value!r}")
    return value


def check_in_flight(scheduler: Scheduler, partial: str | None) -> bool:
    """Before the update takes effect: whether requests are in flight (refused when partial is None)."""
    in_flight = scheduler.has_unfinished()
    if in_flight and partial is None:
        raise RuntimeError("weights changed with requests in flight: abort them before a weight update "
                           "(or set the engine's partial to 'keep_kv' or 'reprefill')")
    return in_flight


def carry_over(scheduler: Scheduler, block_manager: BlockManager, version: int, in_flight: bool,
               partial: str | None) -> None:
    """An awake engine's requests and prefix cache move to weights `version`, as `partial` says."""
    if in_flight and partial == "reprefill":
        scheduler.reprefill()
    if scheduler.running:  # keep_kv: they hold their blocks; the cache forgets the rest
        block_manager.start_version(version)
    else:
        block_manager.forget_cached()
        block_manager.version = version
