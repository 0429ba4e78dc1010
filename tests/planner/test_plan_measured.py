"""The memory planner (relayrl.planner) against what relayrl holds, exactly.

Trainer: for every CPU layout relayrl runs (one process, DDP 2, FSDP 2, TP 2; HSDP 2 x 2 and FSDP 2 x TP 2
on 4 ranks; activation checkpointing on and off), after one Actor.update the storage bytes of each rank's
parameters, gradients and AdamW state (benchmarks/bench_trainer._held_bytes: DTensor local shards, each
storage once) equal train_memory(..., rank=r).params / .grads / .optim. The models are tiny but shaped to
exercise what makes the bytes differ from 16 x params / ranks: odd sizes (FSDP2 pads each parameter's
dim 0 to a multiple of the shard count; the optimiser state is not padded), a tied embedding, q/k/v
biases, norms that TP replicates, a TP-local size FSDP then pads again, AdamW's per-tensor step; and
trainer.lora (rank 3, on every target; a float32 or bfloat16 frozen base: params only, adapters trained).

Engine: LLMEngine's bytes per KV block, number of blocks and each rank's allocated cache equal
engine_kv(...); and the planned maximum of concurrent sequences at a length is what the scheduler runs:
that many sequences of that length all decode their final token in one batch with no preemption, one more
makes it preempt (the pool cannot hold them all at that length).

The ±15% peak check (RSS) is benchmarks/bench_plan.py's, on the ~27M model: RSS is noise on tiny models.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_plan import LAYOUTS, engine_measure, measure, measure_layout, run_concurrent
from relayrl.engine.llm_engine import LLMEngine
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.planner import Layout, Workload, engine_kv, train_memory
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.config import TrainerConfig

pytestmark = pytest.mark.equivalence

SEQ, ROWS, MICRO = 12, 8, 2
shape_of = ModelShape.of


def config(**kw) -> ModelConfig:
    """Odd sizes everywhere FSDP shards dim 0 (vocab 63, hidden 45, MLP 99), a tied embedding, q/k/v biases."""
    base = dict(model_type="qwen2", vocab_size=63, hidden_size=45, intermediate_size=99, num_hidden_layers=2,
                num_attention_heads=5, num_key_value_heads=1, head_dim=10, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=128)
    base.update(kw)
    return ModelConfig(**base)


ODD = config()
# TP 2 splits evenly, but leaves odd local sizes for FSDP 2 to pad (vocab 33, MLP 49, K/V 12 rows each)
TP_MODEL = config(vocab_size=66, hidden_size=44, intermediate_size=98, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12)
TCFG = TrainerConfig(micro_batch_size=MICRO, shuffle=False, padding_free=False)  # padded rows: what the plan models


def batch(mc: ModelConfig) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, mc.vocab_size, (4,), generator=g).tolist() for _ in range(ROWS)]
    responses = [torch.randint(3, mc.vocab_size, (SEQ - 4,), generator=g).tolist() for _ in range(ROWS)]
    ids, attn, resp = build_rows(prompts, responses)
    old = -torch.rand(resp.shape, generator=g) * resp
    return TrainBatch(ids, attn, resp, advantages=torch.randn(ROWS, generator=g), old_logp=old,
                      rollout_logp=old, ref_logp=old)


def planned(run, mc: ModelConfig, rank: int):
    layout = Layout(dp_replicate=run.dp_replicate, dp_shard=run.dp_shard, tp=run.tp, dp_mode=run.dp_mode)
    workload = Workload(seq=SEQ, micro_batch=MICRO, dtype="float32", mixed_precision=False,
                        recompute="full" if run.ac else "none", lora_rank=run.lora_rank, base_dtype=run.lora_base)
    return train_memory(shape_of(mc), layout, workload, rank=rank)


def assert_held_equals_plan(run, mc: ModelConfig, per_rank: list[dict]) -> None:
    for rank, m in enumerate(per_rank):
        plan = planned(run, mc, rank)
        got = dict(params=plan.params, grads=plan.grads, optim=plan.optim)
        assert got == m["held"], f"{run.name} rank {rank}: planned {got}, measured {m['held']} ({m['detail']})"


def test_one_process_held_bytes_equal_the_plan():
    single = LAYOUTS["single"]
    for run in (single, single.with_ac(), single.with_lora(3), single.with_lora(2, "bfloat16")):
        m = measure_layout(run, ODD, batch(ODD), TCFG, steps=1, world=1)
        assert_held_equals_plan(run, ODD, [m])


def test_two_rank_layouts_held_bytes_equal_the_plan():
    ddp, fsdp, tp = LAYOUTS["ddp2"], LAYOUTS["fsdp2"], LAYOUTS["tp2"]
    runs = [(ddp, ODD), (fsdp, ODD), (tp, TP_MODEL), (fsdp.with_ac(), ODD),
            (ddp.with_lora(3), ODD), (fsdp.with_lora(3, "bfloat16"), ODD), (tp.with_lora(3), TP_MODEL)]
    results = measure([(run, mc, batch(mc)) for run, mc in runs], TCFG, steps=1, timeout=300)
    for (run, mc), per_rank in zip(runs, results, strict=True):
        assert_held_equals_plan(run, mc, per_rank)


@pytest.mark.slow  # ~14 s: `make bench`; CI: the two-rank layouts' held bytes against the plan (above)
def test_four_rank_layouts_held_bytes_equal_the_plan():
    hsdp, fsdp_tp = LAYOUTS["hsdp2x2"], LAYOUTS["fsdp2_tp2"]
    runs = [(hsdp, ODD), (fsdp_tp, TP_MODEL), (fsdp_tp.with_lora(3), TP_MODEL)]
    results = measure([(run, mc, batch(mc)) for run, mc in runs], TCFG, steps=1, timeout=300)
    for (run, mc), per_rank in zip(runs, results, strict=True):
        assert_held_equals_plan(run, mc, per_rank)


# ---------------------------------------------------------------------------------------------
# the engine's KV cache

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def assert_kv_equals_plan(mc: ModelConfig, *, tp: int, dtype: str, block_size: int, kv_cache_bytes: int) -> None:
    engine = LLMEngine(mc, dtype=DTYPES[dtype], tensor_parallel_size=tp, block_size=block_size,
                       kv_cache_bytes=kv_cache_bytes)
    try:
        m = engine_measure(engine)
    finally:
        engine.close()
    kv = engine_kv(shape_of(mc), tp=tp, dtype=dtype, block_size=block_size, kv_cache_bytes=kv_cache_bytes,
                   seq_len=mc.max_position_embeddings)
    assert (kv.bytes_per_block, kv.num_blocks) == (m["bytes_per_block"], m["num_blocks"])
    assert kv.bytes_per_token * block_size == kv.bytes_per_block
    # what each rank allocated: exactly the planned blocks, no more
    assert m["cache_bytes"] == [kv.num_blocks * kv.bytes_per_block] * tp


@pytest.mark.parametrize(("dtype", "block_size", "kv_cache_bytes"),
                         [("float32", 16, 50_000), ("bfloat16", 4, 12_345), ("float32", 1, 7_777)])
def test_engine_kv_cache_equals_the_plan(dtype, block_size, kv_cache_bytes):
    assert_kv_equals_plan(ODD, tp=1, dtype=dtype, block_size=block_size, kv_cache_bytes=kv_cache_bytes)


def test_engine_kv_cache_equals_the_plan_tensor_parallel():
    # 1 KV head on 2 ranks: each rank holds the KV head its Q heads use (replicated, not split)
    assert_kv_equals_plan(config(vocab_size=66, hidden_size=44, intermediate_size=98, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=12), tp=2, dtype="bfloat16", block_size=8,
                          kv_cache_bytes=20_000)


def _engine(block_size: int, kv_cache_bytes: int, max_num_seqs: int) -> LLMEngine:
    model = CausalLM(ODD)
    model.reset_parameters(std=0.02, seed=0)
    return LLMEngine.from_model(model, block_size=block_size, kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
                                enable_prefix_caching=False, max_num_batched_tokens=4096)


@pytest.mark.parametrize(("blocks", "max_num_seqs", "completion"), [
    pytest.param(7, 256, 5, id="blocks-bound"),
    pytest.param(7, 256, 6, id="blocks-bound-at-block-edge"),
    pytest.param(64, 2, 6, id="max_num_seqs-bound")])
def test_planned_max_concurrent_sequences_run_at_once(blocks, max_num_seqs, completion):
    """Sequences of L = 3 prompt + `completion` tokens (KV for the L - 1 tokens before the last: 7 or 8 tokens,
    2 blocks of 4 either way): the planned maximum all decode their final token in one batch, none preempted;
    one more never fits at full length."""
    block_size, prompt = 4, 3
    length = prompt + completion
    per_block = engine_kv(shape_of(ODD), block_size=block_size, kv_cache_bytes=1, seq_len=length).bytes_per_block
    budget = blocks * per_block + per_block // 2
    kv = engine_kv(shape_of(ODD), tp=1, dtype="float32", block_size=block_size, kv_cache_bytes=budget,
                   max_num_seqs=max_num_seqs, seq_len=length)
    n = kv.max_concurrent_seqs
    assert kv.num_blocks == blocks and n >= 2
    engine = _engine(block_size, budget, max_num_seqs)
    try:
        full = run_concurrent(engine, n, prompt, completion)
        over = run_concurrent(engine, n + 1, prompt, completion, seed=1)
    finally:
        engine.close()
    assert full == dict(most_batch=n, at_final=n, preemptions=0, lengths=[completion] * n)
    assert over["lengths"] == [completion] * (n + 1)  # all finish, but never all at once at full length
    assert over["at_final"] <= n  # never n + 1 at full length at once
    if max_num_seqs < blocks:  # bound by max_num_seqs: the extra one waits, nothing is preempted
        assert over["most_batch"] == n and over["preemptions"] == 0
    else:  # bound by blocks: all were admitted, and the pool ran out before they reached full length
        assert over["preemptions"] > 0
