"""This module keeps the rollout engine's ranks and what their memory holds: the device side of an LLMEngine.

    built      the layout checked (TP against the heads, the experts' placement, a KV budget that holds one
               sequence) before any process starts; the ranks placed (`group`, a RunnerGroup,
               relayrl.engine.protocols: group.call(ModelRunner.load_weights, ...) runs it on every rank);
               the KV cache allocated; no weights yet
    asleep     0 awake; 1 the KV cache freed (sleep(1)); 2 the weights' storage freed too (sleep(2)): a
               weight load brings the storage back (level 1), wake() the KV cache (level 0)
    weights    a load writes every rank's shard, and every tensor the model holds must be written

What a weight update does to requests in flight, and the weights version, are the engine's (LLMEngine): they
concern its scheduler, not the ranks.

It imports torch, the engine's own modules and relayrl.models (and relayrl.single_controller's deadlines, as
an annotation); like the whole engine, it must never import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from relayrl.engine.model import EngineModel
from relayrl.engine.model_runner import ModelRunner, available_memory, check_kv_blocks, kv_blocks, kv_bytes_per_block
from relayrl.engine.moe import check_expert_placement, dense_intermediate
from relayrl.engine.parallel_state import TPInfo, check_tp, head_layout
from relayrl.engine.protocols import RunnerGroup
from relayrl.engine.runner_groups import InProcessRunner
from relayrl.models.config import ModelConfig

if TYPE_CHECKING:  # only the TP worker group (relayrl.engine.tp_workers) needs the single-controller layer
    from relayrl.single_controller.liveness import GroupOptions


class EngineRanks:
    """The engine's RunnerGroup (`group`), its KV cache's size and the sleep level of the ranks' memory."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, *, tensor_parallel_size: int, device: str, block_size: int,
        num_blocks: int | None, kv_cache_bytes: int | None, kv_cache_fraction: float, max_num_seqs: int,
        own_processes: bool, runner_group: RunnerGroup | None, group_options: GroupOptions | None,
        expert_placement: str,
    ):
        """Where the ranks run: see LLMEngine. The KV budget is checked before any process starts."""
        check_tp(config.num_attention_heads, config.num_key_value_heads, tensor_parallel_size,
                 dense_intermediate(config))
        check_expert_placement(config, tensor_parallel_size, expert_placement)
        _, kv_heads = head_layout(config.num_attention_heads, config.num_key_value_heads,
                                  TPInfo(0, tensor_parallel_size))
        self.kv_bytes_per_block = kv_bytes_per_block(config, dtype, block_size, len(kv_heads))
        if num_blocks is None:
            # ranks hosted elsewhere (colocated in the trainer's processes) report their own device's memory
            free = runner_group.free_memory() if runner_group is not None else available_memory(device)
            num_blocks = kv_blocks(config, self.kv_bytes_per_block, block_size, free_bytes=free,
                                   kv_cache_bytes=kv_cache_bytes, kv_cache_fraction=kv_cache_fraction,
                                   max_num_seqs=max_num_seqs)
        check_kv_blocks(config, self.kv_bytes_per_block, block_size, num_blocks)
        self.num_blocks, self.block_size = num_blocks, block_size
        with torch.device("meta"):  # names only: the same on every rank
            self._expected_loads = EngineModel(config).expected_loads()
        if runner_group is not None:
            self.group: RunnerGroup = runner_group
        elif tensor_parallel_size > 1 or own_processes:
            from relayrl.engine.tp_workers import WorkerRanks

            self.group = WorkerRanks(config, dtype, tensor_parallel_size, device=device, options=group_options,
                                     expert_placement=expert_placement)
        else:
            self.group = InProcessRunner(ModelRunner(config, dtype, TPInfo(), device, expert_placement))
        self.asleep = 0
        self.has_weights = False  # built empty: the first load / sync fills it

    @property
    def runner(self) -> ModelRunner | None:
        return self.group.runner if isinstance(self.group, InProcessRunner) else None

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Write checked (name, full tensor) pairs into every rank's shard; a KeyError names one left unwritten."""
        self.restore_weights()
        missing = self._expected_loads - self.group.call(ModelRunner.load_weights, weights)
        if missing:
            raise KeyError(f"weight sync left {len(missing)} engine tensor(s) stale, "
                           f"e.g. {sorted(missing, key=str)[0]}")

    def restore_weights(self) -> None:
        """Before a sync writes into the parameters: storage released by sleep(2) comes back."""
        if self.asleep >= 2:
            self.group.call(ModelRunner.restore_weight_storage)

    def weights_written(self) -> None:
        """After a complete sync: the ranks hold weights (asleep at level 2 becomes 1: the KV cache is still freed)."""
        if self.asleep >= 2:
            self.asleep = 1
        self.has_weights = True

    def score(self, rows: list[list[int]], temperature: float) -> torch.Tensor:
        if self.asleep >= 2 or not self.has_weights:
            raise RuntimeError("the engine holds no weights (never loaded, or released by sleep(level=2)): "
                               "sync them before scoring")
        return self.group.call(ModelRunner.score, rows, temperature)

    def allocate_kv_cache(self) -> None:
        self.group.call(ModelRunner.allocate_kv_cache, self.num_blocks, self.block_size)

    def sleep(self, level: int) -> None:
        self.group.call(ModelRunner.free_kv_cache)
        if level >= 2:
            self.group.call(ModelRunner.free_weights)
        self.asleep = max(self.asleep, level)

    def check_wakeable(self) -> None:
        if self.asleep >= 2:
            raise RuntimeError("the weights were released by sleep(level=2): load_weights() before wake()")

    def wake(self) -> None:
        self.allocate_kv_cache()
        self.asleep = 0

    def close(self) -> None:
        self.group.close()
