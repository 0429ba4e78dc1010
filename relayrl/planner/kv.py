"""The rollout engine's memory: its weights per TP rank and how many sequences its KV cache holds —
relayrl's engine arithmetic reproduced (relayrl.engine.model_runner, llm_engine, block_manager):

    kv heads per rank    Hkv / tp when tp <= Hkv, else 1 (the head its Q heads use, replicated)
    bytes per token      2 (K and V) x layers x kv heads per rank x head_dim x dtype bytes
    bytes per block      bytes per token x block_size                          (kv_bytes_per_block)
    num blocks           kv_cache_bytes // bytes per block, when given; else
                         min(free x kv_cache_fraction // bytes per block,
                             max_num_seqs x ceil(max_position_embeddings / block_size))   (kv_blocks)
    blocks per seq       ceil((seq_len - 1) / block_size)   (at least 1)
    concurrent seqs      min(num_blocks // blocks per seq, max_num_seqs)   (the scheduler runs at most
                         max_num_seqs)

Why seq_len - 1: a sequence of L tokens (prompt + generated) holds KV for L - 1 when its last token is
sampled: that token finishes the sequence and is never fed back, so it gets no slot
(relayrl.engine.scheduler.Scheduler.max_kv_tokens = max(prompt, L - 1); the prompt is at most L - 1 when
at least one token is generated). At L = k x block_size + 1 this is one block fewer than ceil(L / bs).

Weights per engine rank: the engine's parameters on rank 0 (relayrl.sync.layout.engine_param_shapes:
fused qkv / gate_up of its heads, o_proj / down_proj columns, embeddings, lm_head and norms whole; a
tied lm_head is the embedding). With LoRA, the adapters too, and under sync.lora = merge a second copy of
every targeted module's base weight (engine_weight_terms).

An MoE model's engine holds every expert, sharded by its TP like a dense MLP num_experts x moe_intermediate
(+ the shared expert) wide, and each layer's router (and shared-expert gate) whole (relayrl.planner.moe).

It imports relayrl.errors, relayrl.models.config, relayrl.sync (layouts, adapters) and the planner's moe only.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import ConfigError
from relayrl.models.config import ModelShape, MoEShape
from relayrl.planner.workload import DTYPE_BYTES
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.layout import EngineLayout, engine_heads, engine_param_shapes

LORA_SYNC = ("separate", "merge")  # the run's sync.lora (relayrl.engine.lora)


@dataclass
class EngineKV:
    tp: int
    dtype: str
    block_size: int
    kv_heads_per_rank: int
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    seq_len: int | None
    blocks_per_seq: int | None
    max_concurrent_seqs: int | None


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    return len(engine_heads(shape.num_attention_heads, shape.num_key_value_heads, tp, 0)[1])


def engine_kv(shape: ModelShape, tp: int = 1, dtype: str = "float32", block_size: int = 16,
              kv_cache_bytes: int | None = None, max_num_seqs: int = 256, seq_len: int | None = None, *,
              free_bytes: int | None = None, kv_cache_fraction: float = 0.05,
              max_position_embeddings: int | None = None) -> EngineKV:
    """The engine's KV pool per TP rank. Give kv_cache_bytes (the engine's own key), or free_bytes with
    kv_cache_fraction and max_position_embeddings (the engine's default sizing)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    heads = kv_heads_per_rank(shape, tp)
    per_token = 2 * shape.num_hidden_layers * heads * shape.head_dim * _dtype_bytes(dtype)
    per_block = per_token * block_size
    if kv_cache_bytes is not None:
        blocks = kv_cache_bytes // per_block
    elif free_bytes is not None and max_position_embeddings is not None:
        per_seq = -(-max_position_embeddings // block_size)
        blocks = min(int(free_bytes * kv_cache_fraction) // per_block, max_num_seqs * per_seq)
    else:
        raise ConfigError("engine_kv needs kv_cache_bytes, or free_bytes with max_position_embeddings")
    need = conc = None
    if seq_len is not None:
        need = -(-max(seq_len - 1, 1) // block_size)  # KV for L - 1 tokens (module docstring)
        conc = min(blocks // need, max_num_seqs)
    return EngineKV(tp=tp, dtype=dtype, block_size=block_size, kv_heads_per_rank=heads, bytes_per_token=per_token,
                    bytes_per_block=per_block, num_blocks=blocks, seq_len=seq_len, blocks_per_seq=need,
                    max_concurrent_seqs=conc)


def engine_weight_terms(shape: ModelShape, tp: int, dtype: str, lora: AdapterShape | None = None,
                        lora_sync: str = "separate") -> dict[str, int]:
    """Bytes of the engine's weights on its largest TP rank (rank 0; all ranks are equal), by kind:
    base (its parameters), adapters (LoRA's lora_A / lora_B in the engine's dtype: stacked A and per-part B
    on the fused modules, relayrl.engine.lora), merge copy (sync.lora = merge: `lora_base`, a clone of the
    whole weight of every module with a targeted part, the weight the sync writes the base into)."""
    if lora_sync not in LORA_SYNC:
        raise ConfigError(f"LoRA sync mode must be one of {', '.join(LORA_SYNC)}, got {lora_sync!r}")
    e = _dtype_bytes(dtype)
    out = {"base": 0, "adapters": 0, "merge copy": 0}
    if isinstance(shape, MoEShape):  # experts by the engine's TP, like one MLP E I + I_s wide; routers replicated
        if lora is not None:
            raise ConfigError("LoRA on an MoE model is not planned (per-expert adapters)")
        out["base"] = engine_weight_bytes(shape.total_shape(), tp, dtype) + shape.num_hidden_layers * (
            shape.num_experts + (1 if shape.shared_width else 0)) * shape.hidden_size * e
        return out
    shapes = engine_param_shapes(ModelShape.of(shape), EngineLayout(tp=tp), 0, lora)
    for name, shp in shapes.items():
        out["adapters" if ".lora_" in name else "base"] += _numel(shp) * e
        if lora is not None and lora_sync == "merge" and name.endswith(".lora_A"):
            out["merge copy"] += _numel(shapes[name.removesuffix(".lora_A") + ".weight"]) * e
    return out


def engine_weight_bytes(shape: ModelShape, tp: int, dtype: str, lora: AdapterShape | None = None,
                        lora_sync: str = "separate") -> int:
    """engine_weight_terms summed."""
    return sum(engine_weight_terms(shape, tp, dtype, lora, lora_sync).values())


def _numel(shp: tuple[int, ...]) -> int:
    n = 1
    for d in shp:
        n *= d
    return n
