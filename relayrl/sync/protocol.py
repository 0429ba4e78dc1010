"""The seam between the driver and a weight sync, as a typing.Protocol.

The driver calls `sync(label)` once per step (before the rollout) and reads `last_table` in debug
mode; `close()` ends the sync's groups. relayrl.roles.weight_sync has the two implementations:
the planned, verified shard-to-shard sync for relayrl's engine, and the full-tensor one vLLM's loader
needs. The protocol imports nothing but typing; like all of sync, it must never import the trainer, the
engine or the controller: the controller hands it plain tensors.
"""

from __future__ import annotations

from typing import Protocol


class WeightSync(Protocol):
    """Moves the trainer's weights into the rollout engine, and checks them."""

    last_table: dict[str, tuple[float, float]]  # 'engine rank r: param' -> (trainer's, engine's) checksum

    def sync(self, label: str | None = None) -> dict[str, float]:
        """One sync (wake the engine if it slept); returns its metrics (time/sync_*, sync/*)."""

    def close(self) -> None:
        """Shut the sync's groups down (best effort: also runs on the way out of failures)."""
