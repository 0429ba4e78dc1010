"""Weight sync: layouts as data, the shard-to-shard reshard plan (see DESIGN.md, "The reshard
plan"), its transfer between processes and per-piece checksums.

The package imports relayrl.models (shapes, the fusion map), relayrl.parallel and the ground floor;
it must never import the trainer, the engine or the controller: the controller hands it plain
tensors (trainer shards, engine parameters by name). Names are imported on first use, so
`relayrl.sync.config` (the `sync:` section) loads without torch.distributed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl.lazy import lazy_exports

_EXPORTS = {
    "execute_plan": "relayrl.sync.apply", "pack": "relayrl.sync.apply", "unpack": "relayrl.sync.apply",
    "EngineLayout": "relayrl.sync.layout", "TrainerLayout": "relayrl.sync.layout",
    "sync_shape": "relayrl.sync.experts",
    "SyncPlan": "relayrl.sync.plan", "plan_sync": "relayrl.sync.plan",
    "Members": "relayrl.sync.transfer", "SyncComm": "relayrl.sync.transfer", "SyncSpec": "relayrl.sync.transfer",
    "SyncStats": "relayrl.sync.transfer", "sync_step": "relayrl.sync.transfer",
}
__all__ = ["EngineLayout", "Members", "SyncComm", "SyncPlan", "SyncSpec", "SyncStats", "TrainerLayout",
           "execute_plan", "pack", "plan_sync", "sync_shape", "sync_step", "unpack"]

if TYPE_CHECKING:
    from relayrl.sync.apply import execute_plan, pack, unpack
    from relayrl.sync.experts import sync_shape
    from relayrl.sync.layout import EngineLayout, TrainerLayout
    from relayrl.sync.plan import SyncPlan, plan_sync
    from relayrl.sync.transfer import Members, SyncComm, SyncSpec, SyncStats, sync_step

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
