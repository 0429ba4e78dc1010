"""Weight sync: layouts as data, the shard-to-shard reshard plan (see DESIGN.md, "The reshard
plan"), its transfer between processes and per-piece checksums. Imports models and parallel only —
never trainer or engine (the controller hands it plain tensors: trainer shards, engine parameters)."""

from relayrl.sync.apply import execute_plan, pack, unpack
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.plan import SyncPlan, plan_sync
from relayrl.sync.transfer import Members, SyncComm, SyncSpec, SyncStats, sync_step

__all__ = ["EngineLayout", "Members", "SyncComm", "SyncPlan", "SyncSpec", "SyncStats", "TrainerLayout", "execute_plan",
           "pack", "plan_sync", "sync_step", "unpack"]
