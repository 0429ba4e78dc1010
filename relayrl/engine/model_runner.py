"""The model runner runs a batch: the engine model on one tensor-parallel rank, with its slice of the KV
cache.

    sequences ──prepare (on the scheduler's side)──> input ids [N] + PagedBatch
              ──run (on every TP rank)──────────────> logits [B, V] at each sequence's last token

The KV cache is one tensor [layers, 2, num_blocks * block_size, local kv heads, head_dim], sized
from a byte budget; `free_kv_cache` / `allocate_kv_cache` are what sleep and wake do to it. A batch may
carry copy-on-write copies (whole blocks' slots, every layer, k and v): `run` does them first, on
every rank, since each rank holds its own heads' slice of every block.

It imports torch, the engine's own modules and relayrl.models only; like the whole engine, it must never
import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import os

import torch

from relayrl.engine import lora
from relayrl.engine.attention import PagedBatch, build_batch
from relayrl.engine.model import EngineModel
from relayrl.engine.parallel_state import TPInfo
from relayrl.errors import ConfigError, KVCacheError
from relayrl.models.config import ModelConfig, MoEShape
from relayrl.models.rope import rope_inv_freq


def available_memory(device: str) -> int:
    """Free bytes on `device` (the KV cache budget's base when no byte count is given)."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_bytes_per_block(cfg: ModelConfig, dtype: torch.dtype, block_size: int, kv_heads_local: int) -> int:
    return cfg.num_hidden_layers * 2 * block_size * kv_heads_local * cfg.head_dim * torch.finfo(dtype).bits // 8


def kv_blocks(cfg: ModelConfig, per_block: int, block_size: int, *, free_bytes: int, kv_cache_bytes: int | None,
              kv_cache_fraction: float, max_num_seqs: int) -> int:
    """How many KV blocks a budget buys: kv_cache_bytes when given, else a fraction of the free memory
    (never more than max_num_seqs sequences of the model's maximum length use)."""
    if kv_cache_bytes is not None:
        return kv_cache_bytes // per_block
    per_seq = -(-cfg.max_position_embeddings // block_size)
    return min(int(free_bytes * kv_cache_fraction) // per_block, max_num_seqs * per_seq)


def check_kv_blocks(cfg: ModelConfig, per_block: int, block_size: int, num_blocks: int) -> None:
    """A pool without a single block is a user error: say what one sequence needs, and the key to set."""
    if num_blocks < 1:
        longest = per_block * -(-(cfg.max_position_embeddings - 1) // block_size)
        raise KVCacheError(
            f"the KV cache holds no block ({per_block} bytes each, num_blocks={num_blocks}); one sequence of the "
            f"model's maximum length ({cfg.max_position_embeddings} tokens) needs {longest} bytes: set "
            f"kv_cache_bytes (rollout.kv_cache_bytes in a run config) to at least that")


def prepare(seqs, is_prefill: bool, block_size: int, sliding_window: int | None, *, group: bool = True,
            copies: list[tuple[int, int]] = ()):
    """Flatten a scheduled batch: (input_ids [N], PagedBatch). group: attention groups by length in a prefill
    (relayrl.engine.attention); copies: the (shared block, fresh block) pairs copy-on-write asked for
    (BlockManager.take_copies), done on every rank before the batch writes anything."""
    starts = [s.num_cached_tokens if is_prefill else s.num_tokens - 1 for s in seqs]
    ids = [t for s, st in zip(seqs, starts, strict=True) for t in s.token_ids[st:]]
    batch = build_batch(starts, [s.num_tokens for s in seqs], [s.block_table for s in seqs], block_size, sliding_window,
                        group=group)
    if copies:
        offs = torch.arange(block_size)
        src, dst = (torch.tensor(list(b), dtype=torch.long) for b in zip(*copies, strict=True))
        batch.copy_from = (src[:, None] * block_size + offs).reshape(-1)
        batch.copy_to = (dst[:, None] * block_size + offs).reshape(-1)
    return torch.tensor(ids, dtype=torch.long), batch


class ModelRunner:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TPInfo = TPInfo(), device: str = "cpu",
                 expert_placement: str = "tp"):
        """expert_placement: where an MoE model's experts live over the TP ranks, "tp" or "ep" (relayrl.engine.moe)."""
        self.cfg, self.dtype, self.tp, self.device = cfg, dtype, tp, torch.device(device)
        with torch.device("meta"):
            model = EngineModel(cfg, tp, expert_placement)
        self.model = model.to_empty(device=self.device).to(dtype).eval()
        if cfg.tie_word_embeddings:  # to_empty materialises each parameter anew: tie them again
            self.model.lm_head.weight = self.model.embed_tokens.weight
        self.model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(self.device)
        # what a layer above keeps on this rank between calls (the weight sync's group); the engine
        # never reads it
        self.sync_state: dict = {}
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._kv_storage: torch.Tensor | None = None  # the one tensor kv_cache's per-layer views live in
        self._weights_freed = False

    @property
    def kv_heads_local(self) -> int:
        return self.model.layers[0].self_attn.nkv

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (self.cfg.num_hidden_layers, 2, num_blocks * block_size, self.kv_heads_local, self.cfg.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._kv_storage = cache
        self.kv_cache = [(cache[i, 0], cache[i, 1]) for i in range(self.cfg.num_hidden_layers)]

    def free_kv_cache(self) -> None:
        self.kv_cache = self._kv_storage = None

    def free_weights(self) -> None:
        """Deep sleep: drop parameter storage (and merged LoRA's base copies); their shapes are kept."""
        self._freed_shapes = {n: p.shape for n, p in self.model.named_parameters(remove_duplicate=False)}
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        lora.free_bases(self.model)
        self._weights_freed = True

    def restore_weight_storage(self) -> None:
        if not self._weights_freed:
            return
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name, shape in self._freed_shapes.items():  # LoRA adapters included
            params[name].data = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.cfg.tie_word_embeddings:
            self.model.lm_head.weight = self.model.embed_tokens.weight
        lora.restore_bases(self.model)
        self._weights_freed = False

    def params(self) -> dict[str, torch.Tensor]:
        """Engine parameter name -> its storage on this rank (what a weight sync writes into).
        Tied lm_head is not listed: it is embed_tokens.weight. With merged LoRA a targeted module's
        weight is its base copy (merge_lora derives the weight the forward uses). An MoE layer's stacked
        experts [E_local, rows, cols] are given as their 2-D view [E_local * rows, cols] (the same storage),
        the shape relayrl.sync.layout plans them in."""
        out = {n: p.data.flatten(0, 1) if p.dim() == 3 else p.data for n, p in self.model.named_parameters()}
        return lora.sync_params(self.model, out)

    def enable_lora(self, rank: int, scaling: float, targets: tuple[str, ...], mode: str) -> None:
        """Zero LoRA adapters on the targeted modules (relayrl.engine.lora); a weight sync fills them."""
        if isinstance(self.cfg, MoEShape):
            raise ConfigError("LoRA on an MoE model is not supported by the engine yet: train it without "
                              "trainer.lora, or use a dense model")
        lora.enable_lora(self.model, rank, scaling, targets, mode)

    def merge_lora(self) -> None:
        """merge mode: write base + scaling * B @ A into the targeted weights (after a sync)."""
        lora.merge_lora(self.model)

    def load_weights(self, weights) -> set:
        return self.model.load_weights((n, t.to(self.device)) for n, t in weights)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, batch: PagedBatch, record_routing: bool = False):
        """Logits [B, V] at each sequence's last token; with record_routing (an MoE model), (logits, the experts
        each of the N tokens chose in each MoE layer [N, n_moe, k] int16), both on the host."""
        if self.kv_cache is None:
            raise RuntimeError("the engine is asleep: call wake() before generating")
        if self.device.type != "cpu":
            batch, input_ids = batch.to(self.device), input_ids.to(self.device)
        if batch.copy_from is not None:  # copy-on-write: the shared blocks' KV into the fresh ones, all layers
            kv = self._kv_storage
            kv.index_copy_(2, batch.copy_to, kv.index_select(2, batch.copy_from))
        # logits come back to the host: the sampler (and any TP pipe) works on CPU tensors
        routing = [] if record_routing else None
        logits = self.model(input_ids, batch, self.kv_cache, routing).float().cpu()
        if routing is None:
            return logits
        return logits, torch.stack(routing, dim=1).to(torch.int16).cpu()

    @torch.inference_mode()
    def score(self, rows: list[list[int]], temperature: float = 1.0) -> torch.Tensor:
        """Logprob of each token given the ones before it, [B, L] (column 0 and padding: 0), run
        through the same paged forward as generation but on a KV cache of its own, so cached
        prefixes and running requests are untouched. The weight-sync canary compares it with the
        trainer's logprobs of the same rows."""
        bs = 16
        lens = [len(r) for r in rows]
        tables, nxt = [], 0
        for n in lens:
            k = -(-n // bs)
            tables.append(list(range(nxt, nxt + k)))
            nxt += k
        batch = build_batch([0] * len(rows), lens, tables, bs, self.cfg.sliding_window)
        batch.last_index = torch.arange(sum(lens))  # logits at every token, not just the last
        shape = (self.cfg.num_hidden_layers, 2, nxt * bs, self.kv_heads_local, self.cfg.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        kv = [(cache[i, 0], cache[i, 1]) for i in range(self.cfg.num_hidden_layers)]
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)
        if self.device.type != "cpu":
            batch, ids = batch.to(self.device), ids.to(self.device)
        logp = torch.log_softmax(self.model(ids, batch, kv).float() / temperature, dim=-1).cpu()
        out = torch.zeros(len(rows), max(lens))
        at = 0
        for b, r in enumerate(rows):
            n = len(r)
            nxt_tok = torch.tensor(r[1:], dtype=torch.long)
            out[b, 1:n] = logp[at:at + n - 1].gather(1, nxt_tok[:, None]).squeeze(1)
            at += n
        return out
