"""Weight sync: layouts as data and the shard-to-shard reshard plan (see DESIGN.md, "The reshard
plan"). Imports models and parallel only — never trainer or engine."""

from relayrl.sync.apply import execute_plan, pack, unpack
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.plan import SyncPlan, plan_sync

__all__ = ["EngineLayout", "SyncPlan", "TrainerLayout", "execute_plan", "pack", "plan_sync", "unpack"]
