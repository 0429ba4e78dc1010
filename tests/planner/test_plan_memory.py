"""relayrl.planner against hand-computed cases on a tiny shape, relayrl's engine arithmetic, one measured
FSDP2 run (padded shards). The CLI: tests/planner/test_plan_cli.py."""

from __future__ import annotations

import pytest
import torch

from relayrl.models.config import ModelConfig, ModelShape
from relayrl.planner import Layout, Workload, engine_kv, engine_weight_bytes, korthikanti_layer_bytes, train_memory
from relayrl.planner.activations import activation_terms
from relayrl.planner.comm import Network, step_collectives
from relayrl.planner.compute import bubble, flops_per_token, matmul_params
from relayrl.planner.memory import stage_layers, stage_tensors
from relayrl.sync.presets import preset

# the shape the FSDP2 padding was measured on: 33 vocab rows (uneven over 2 and 3 shards), one layer
TINY = ModelShape(vocab_size=33, hidden_size=12, intermediate_size=20, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=4, tie_word_embeddings=True)
FP32 = Workload(seq=5, micro_batch=2, dtype="float32", mixed_precision=False)
# TINY's tensors: embed [33,12], in_ln [12], q [16,12], k [8,12], v [8,12], o [12,16], post_ln [12],
# gate [20,12], up [20,12], down [12,20], norm [12]  (tied: no lm_head) -> 11 tensors
LAYER_ELEMS = 12 + 16 * 12 + 2 * 8 * 12 + 12 * 16 + 12 + 3 * 20 * 12  # 1128
N_ALL = 33 * 12 + LAYER_ELEMS + 12  # 1536


@pytest.mark.unit
def test_single_process_is_16_bytes_per_element_plus_steps():
    m = train_memory(TINY, Layout(), FP32, rank=0)
    assert (m.params, m.grads, m.optim) == (4 * N_ALL, 4 * N_ALL, 8 * N_ALL + 4 * 11)


@pytest.mark.unit
def test_ddp_holds_everything_on_every_rank():
    for r in (0, 1):
        m = train_memory(TINY, Layout(dp_replicate=2, dp_mode="ddp"), FP32, rank=r)
        assert (m.params, m.grads, m.optim) == (4 * N_ALL, 4 * N_ALL, 8 * N_ALL + 44)


@pytest.mark.unit
def test_fsdp2_params_and_grads_are_padded_chunks_optim_exact():
    # dim-0 chunks of ceil(d0/2): embed 17 rows (rank 1 holds 16, stored as 17), the rest even
    padded = 17 * 12 + LAYER_ELEMS // 2 + 6
    lay = Layout(dp_shard=2)
    m0, m1 = (train_memory(TINY, lay, FP32, rank=r) for r in (0, 1))
    assert (m0.params, m0.grads) == (m1.params, m1.grads) == (4 * padded, 4 * padded)
    assert m0.optim == 8 * (17 * 12 + LAYER_ELEMS // 2 + 6) + 44
    assert m1.optim == 8 * (16 * 12 + LAYER_ELEMS // 2 + 6) + 44
    # 3 shards: q 16 rows -> 6, 6, 4; gate/up 20 -> 7, 7, 6; embed 33 -> 11 each; 12 -> 4 each; k/v 8 -> 3, 3, 2
    m2 = train_memory(TINY, Layout(dp_shard=3), FP32, rank=2)
    exact2 = 11 * 12 + 4 + 4 * 12 + 2 * 2 * 12 + 4 * 16 + 4 + 2 * 6 * 12 + 4 * 20 + 4
    padded3 = 11 * 12 + 4 + 6 * 12 + 2 * 3 * 12 + 4 * 16 + 4 + 2 * 7 * 12 + 4 * 20 + 4
    assert (m2.params, m2.grads, m2.optim) == (4 * padded3, 4 * padded3, 8 * exact2 + 44)
    # the largest rank is a first shard
    assert train_memory(TINY, Layout(dp_shard=3), FP32).optim == train_memory(TINY, Layout(dp_shard=3), FP32, 0).optim


@pytest.mark.unit
def test_tp_shards_weights_and_replicates_norms():
    shape = ModelShape(**{**TINY.__dict__, "vocab_size": 34})
    m = train_memory(shape, Layout(tp=2), FP32, rank=1)
    local = 17 * 12 + 12 + 8 * 12 + 2 * 4 * 12 + 12 * 8 + 12 + 2 * 10 * 12 + 12 * 10 + 12
    assert (m.params, m.grads, m.optim) == (4 * local, 4 * local, 8 * local + 44)
    # TP 2 x FSDP 2 (rank 2 = shard 1, t 0): the TP-local block is then chunked (embed 17 rows -> 9 / 8)
    m = train_memory(shape, Layout(dp_shard=2, tp=2), FP32, rank=2)
    half_layer = (local - 17 * 12 - 12) // 2
    assert m.params == 4 * (9 * 12 + half_layer + 6)
    assert m.optim == 8 * (8 * 12 + half_layer + 6) + 44


@pytest.mark.unit
def test_zero_levels_shard_progressively():
    mix = Workload(seq=5, micro_batch=1)  # bf16 params and grads, fp32 master + m + v
    ms = {mode: train_memory(TINY, Layout(dp_shard=3, dp_mode=mode), mix, rank=0)
          for mode in ("zero1", "zero2", "fsdp")}
    exact0 = 11 * 12 + 4 + 6 * 12 + 2 * 3 * 12 + 4 * 16 + 4 + 2 * 7 * 12 + 4 * 20 + 4
    assert ms["zero1"].params == ms["zero2"].params == 2 * N_ALL and ms["zero1"].grads == 2 * N_ALL
    assert ms["zero2"].grads == 2 * exact0
    assert ms["zero1"].optim == ms["zero2"].optim == ms["fsdp"].optim == 12 * exact0 + 44
    master = [t for t in ms["zero1"].terms if t[0] == "optim: fp32 master copy"]
    assert master[0][1] == 4 * exact0


@pytest.mark.unit
def test_lora_base_is_frozen_adapters_train():
    w = Workload(seq=5, micro_batch=1, dtype="float32", mixed_precision=False, lora_rank=2)
    m = train_memory(TINY, Layout(), w, rank=0)
    adapters = 2 * (12 + 16) * 2 + 2 * 2 * (12 + 8) + 2 * 3 * (12 + 20)  # r (in + out) on 7 targets
    assert m.params == 4 * (N_ALL + adapters) and m.grads == 4 * adapters
    assert m.optim == 8 * adapters + 4 * 14  # lora_A and lora_B per target
    assert [t for t in m.terms if t[0] == "params (frozen base)"][0][1] == 4 * N_ALL


@pytest.mark.unit
def test_pipeline_stages_split_layers_and_tie_the_lm_head_copy():
    shape = ModelShape(**{**TINY.__dict__, "num_hidden_layers": 5})
    assert [list(stage_layers(5, 2, s)) for s in (0, 1)] == [[0, 1, 2], [3, 4]]
    lay = Layout(pp=2)
    names1 = [n for n, _, _ in stage_tensors(shape, lay, FP32, 1, 0)]
    assert "model.embed_tokens.weight" in names1 and "model.norm.weight" in names1
    assert "model.norm.weight" not in [n for n, _, _ in stage_tensors(shape, lay, FP32, 0, 0)]
    # rank 1 is stage 1 (pp slowest)
    assert lay.coords(1)["stage"] == 1
    assert train_memory(shape, lay, FP32, rank=1).params == 4 * (33 * 12 + 2 * LAYER_ELEMS + 12)


@pytest.mark.unit
def test_korthikanti_formula_and_our_adaptation():
    s, b, h, a = 2048, 1, 4096, 32
    assert korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t=8, sp=True) == s * b * h * (34 / 8 + 5 * a * s / (h * 8))
    assert korthikanti_layer_bytes(s, b, h, a, t=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert korthikanti_layer_bytes(s, b, h, a, recompute="selective") == 34 * s * b * h
    assert korthikanti_layer_bytes(s, b, h, a, recompute="full") == 2 * s * b * h
    # ours, TINY at fp32 (e = 4), s = 5, b = 2, eager attention (the softmax output kept)
    w = Workload(seq=5, micro_batch=2, dtype="float32", mixed_precision=False, attention="eager")
    terms = dict((n, v) for n, v, _ in activation_terms(TINY, Layout(), w, 0))
    sbh = 5 * 2 * 12
    assert terms["norm inputs"] == terms["qkv + mlp inputs"] == 2 * 4 * sbh
    assert terms["norm outputs"] == 2 * 4 * sbh + 2 * 4 * 5 * 2  # normalised x and the fp32 rsqrt per token
    assert terms["q, k, v"] == 4 * 5 * 2 * (16 + 2 * 8)
    assert terms["attention output"] == 4 * 5 * 2 * 16
    assert terms["swiglu"] == 4 * 4 * 5 * 2 * 20
    assert terms["attention scores"] == 4 * 4 * 5 * 5 * 2
    assert terms["log-softmax"] == 4 * 2 * 4 * 33 and terms["attention mask"] == 2 * 5 * 5  # s - 1 = 4 positions
    sel = dict((n, v) for n, v, _ in activation_terms(TINY, Layout(), Workload(**{**w.__dict__, "recompute":
                                                                                    "selective"}), 0))
    assert "attention scores" not in sel and sel["swiglu"] == terms["swiglu"]
    full = dict((n, v) for n, v, _ in activation_terms(TINY, Layout(), Workload(**{**w.__dict__, "recompute":
                                                                                     "full"}), 0))
    assert full["layer inputs (full recompute)"] == 4 * sbh


@pytest.mark.unit
def test_sequence_parallel_and_context_parallel_divide_activations():
    shape = ModelShape(**{**TINY.__dict__, "vocab_size": 34})
    w = Workload(seq=8, micro_batch=1, dtype="float32", mixed_precision=False)
    base = dict((n, v) for n, v, _ in activation_terms(shape, Layout(), w, 0))
    tp = dict((n, v) for n, v, _ in activation_terms(shape, Layout(tp=2), w, 0))
    sp = dict((n, v) for n, v, _ in activation_terms(shape, Layout(tp=2, sp=True), w, 0))
    cp = dict((n, v) for n, v, _ in activation_terms(shape, Layout(cp=2), w, 0))
    assert tp["norm inputs"] == base["norm inputs"] and sp["norm inputs"] == base["norm inputs"] // 2
    assert sp["norm outputs"] == base["norm outputs"] // 2
    assert sp["qkv + mlp inputs"] == base["qkv + mlp inputs"]  # relayrl's SP keeps the all-gathered input
    assert tp["swiglu"] == sp["swiglu"] == base["swiglu"] // 2 == cp["swiglu"]
    assert cp["norm inputs"] == base["norm inputs"] // 2


@pytest.mark.unit
def test_pipeline_in_flight_micro_batches():
    shape = ModelShape(**{**TINY.__dict__, "num_hidden_layers": 4})
    w = Workload(seq=4, micro_batch=1, dtype="float32", mixed_precision=False, num_micro_batches=8)
    one = dict((n, v) for n, v, _ in activation_terms(shape, Layout(), w, 0))["swiglu"] / 4  # per layer
    f1b = dict((n, v) for n, v, _ in activation_terms(shape, Layout(pp=4), w, 0))["swiglu"]
    last = dict((n, v) for n, v, _ in activation_terms(shape, Layout(pp=4), w, 3))["swiglu"]
    gpipe = dict((n, v) for n, v, _ in activation_terms(shape, Layout(pp=4, pp_schedule="gpipe"), w, 0))["swiglu"]
    assert (f1b, last, gpipe) == (4 * one, 1 * one, 8 * one)
    assert bubble(Layout(pp=4), 8) == 3 / 11


@pytest.mark.unit
def test_engine_kv_matches_relayrl_engine_arithmetic():
    from relayrl.engine.model_runner import kv_blocks, kv_bytes_per_block
    from relayrl.engine.parallel_state import TPInfo, head_layout

    shape = preset("tiny-gqa")  # 8 Q heads over 2 KV heads: tp 4 replicates KV heads
    cfg = ModelConfig(model_type="qwen2", **shape.__dict__, max_position_embeddings=64)
    for tp in (1, 2, 4, 8):
        for dtype, td in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            heads = len(head_layout(8, 2, TPInfo(0, tp))[1])
            per = kv_bytes_per_block(cfg, td, 16, heads)
            kv = engine_kv(shape, tp=tp, dtype=dtype, block_size=16, kv_cache_bytes=100_000, seq_len=40,
                           max_num_seqs=256)
            assert kv.bytes_per_block == per and kv.num_blocks == 100_000 // per
            assert kv.max_concurrent_seqs == min(kv.num_blocks // 3, 256)  # 40 tokens: 3 blocks of 16
            free = engine_kv(shape, tp=tp, dtype=dtype, free_bytes=10**7, kv_cache_fraction=0.05,
                             max_position_embeddings=64, max_num_seqs=4)
            assert free.num_blocks == kv_blocks(cfg, per, 16, free_bytes=10**7, kv_cache_bytes=None,
                                                kv_cache_fraction=0.05, max_num_seqs=4)
    assert engine_kv(shape, kv_cache_bytes=10**9, seq_len=16, max_num_seqs=7).max_concurrent_seqs == 7


@pytest.mark.unit
def test_engine_kv_blocks_per_sequence_are_the_schedulers():
    """A sequence of L tokens needs KV for L - 1 (its last token is never fed back): the scheduler's own rule,
    at and around block edges (L = k bs + 1 is one block fewer than ceil(L / bs))."""
    from relayrl.engine.block_manager import BlockManager
    from relayrl.engine.sampling_params import SamplingParams
    from relayrl.engine.scheduler import Scheduler
    from relayrl.engine.sequence import Sequence

    shape = preset("tiny-gqa")
    assert engine_kv(shape, block_size=4, kv_cache_bytes=10**9, seq_len=9).blocks_per_seq == 2  # 8 KV tokens
    assert engine_kv(shape, block_size=4, kv_cache_bytes=10**9, seq_len=10).blocks_per_seq == 3
    for bs in (1, 4, 16):
        sched = Scheduler(BlockManager(1000, bs), max_num_seqs=8, max_num_batched_tokens=4096)
        for length in range(2, 40):
            for prompt in (1, length // 2, length - 1):
                seq = Sequence(0, [1] * prompt, SamplingParams(max_tokens=length - prompt), bs)
                kv = engine_kv(shape, block_size=bs, kv_cache_bytes=10**9, seq_len=length)
                assert kv.blocks_per_seq == sched.blocks_for(sched.max_kv_tokens(seq)), (bs, length, prompt)


@pytest.mark.unit
def test_engine_weights_match_the_engine_model():
    from relayrl.engine.model import EngineModel
    from relayrl.engine.parallel_state import TPInfo

    for name in ("tiny-gqa", "qwen2.5-0.5b"):
        shape = preset(name)
        cfg = ModelConfig(model_type="qwen2", **shape.__dict__)
        for tp in (1, 2):
            with torch.device("meta"):
                model = EngineModel(cfg, TPInfo(0, tp))
            n = sum(p.numel() for p in model.parameters())  # a tied lm_head is the embedding (once)
            assert engine_weight_bytes(shape, tp, "bfloat16") == 2 * n


@pytest.mark.unit
def test_collectives_bytes_and_links():
    shape = preset("llama-3.1-8b")
    w = Workload(seq=1024, micro_batch=1, num_micro_batches=2)
    net = Network(gpus_per_node=8)
    g = train_memory(shape, Layout(), w, rank=0).grads
    n_all = g // 2
    ddp = step_collectives(shape, Layout(dp_replicate=16, dp_mode="ddp"), w, net, (n_all, n_all), 32)
    assert [c.name for c in ddp] == ["ddp grad all-reduce"] and ddp[0].bytes == int(2 * 15 / 16 * g)
    assert ddp[0].crosses_nodes and ddp[0].seconds == pytest.approx(ddp[0].bytes / 50e9)
    tp = step_collectives(shape, Layout(dp_shard=2, tp=8), w, net, (n_all // 8, n_all // 8), 32)
    names = {c.name: c for c in tp}
    assert not names["tp all-reduce"].crosses_nodes and names["fsdp param all-gather"].crosses_nodes
    assert names["tp all-reduce"].bytes == int(32 * 2 * 4 * 2 * 7 / 8 * 2 * 1024 * 4096)
    assert names["fsdp param all-gather"].bytes == int(2 * 2 * 1 / 2 * (n_all // 8) * 2)


@pytest.mark.unit
def test_flops_match_the_benchmark_formula():
    shape = preset("qwen2.5-0.5b")
    w = Workload(seq=256, micro_batch=1)
    n = matmul_params(shape)
    assert n == 24 * (896 * (2 * 896 + 2 * 128) + 3 * 896 * 4864) + 151936 * 896
    model, hw = flops_per_token(shape, w)
    assert model == hw == 6 * n + 12 * 24 * 14 * 64 * 256
    _, hw_full = flops_per_token(shape, Workload(seq=256, micro_batch=1, recompute="full"))
    assert hw_full == 8 * n + 16 * 24 * 14 * 64 * 256
    # LoRA rank 8 on the 7 projections: r (in + out) per target, q/o 896+896, k/v 896+128, gate/up/down 896+4864
    adapters = 24 * 8 * (2 * 1792 + 2 * 1024 + 3 * 5760)  # 4,399,104
    model, hw = flops_per_token(shape, Workload(seq=256, micro_batch=1, lora_rank=8))
    assert model == hw == 4 * n + 6 * adapters + 12 * 24 * 14 * 64 * 256


@pytest.mark.unit
def test_flops_are_models_flops():
    """One count of FLOPs in relayrl: the planner uses relayrl.models.flops (the benchmarks' and the run's MFU)."""
    from relayrl.models import flops
    from relayrl.planner import compute

    assert compute.matmul_params is flops.matmul_params and compute.adapter_params is flops.adapter_params
    shape, w = preset("llama-3.1-8b"), Workload(seq=1024, micro_batch=1, lora_rank=16)
    assert flops_per_token(shape, w)[0] == flops.lora_train_flops(shape, 1, 1024, rank=16)
    assert flops_per_token(shape, Workload(seq=1024, micro_batch=1))[0] == flops.train_flops(shape, 1, 1024)


def _storage_bytes(tensors, seen: set) -> int:
    """benchmarks/bench_trainer.py's count: each distinct storage once (a DTensor: its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _fsdp_held(rank: int, world: int) -> dict:
    from relayrl.models import CausalLM
    from relayrl.parallel.dims import ParallelDims
    from relayrl.parallel.parallelize import parallelize_model

    cfg = ModelConfig(model_type="llama", **TINY.__dict__)
    model = CausalLM(cfg)
    model.reset_parameters(std=0.02, seed=0)
    dims = ParallelDims(world_size=world, dp_shard=world)
    parallelize_model(model, dims, dims.build_mesh("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(torch.randint(0, 33, (2, 5)))
    (out.logits if hasattr(out, "logits") else out).float().pow(2).mean().backward()
    opt.step()
    seen: set = set()
    params = list(model.parameters())
    return {"params": _storage_bytes(params, seen), "grads": _storage_bytes([p.grad for p in params], seen),
            "optim": _storage_bytes([v for st in opt.state.values() for v in st.values()], seen)}


@pytest.mark.equivalence
def test_fsdp2_held_bytes_are_what_the_planner_counts():
    """Measured: FSDP2's padded parameter storage, one padded grad buffer per group, exact Adam state."""
    from dist_harness import run_distributed

    held = run_distributed(_fsdp_held, 2)
    for r, h in enumerate(held):
        m = train_memory(TINY, Layout(dp_shard=2), FP32, rank=r)
        assert (m.params, m.grads, m.optim) == (h["params"], h["grads"], h["optim"])


@pytest.mark.unit
def test_pp_tp_fsdp_and_cp_in_the_shard_group_by_hand():
    """qwen2.5-7b on pp 2 x dp_shard 2 x tp 2: stage 1 holds layers 14-27, the final norm and the untied lm_head;
    each TP-local tensor (every dim even here) halved again by FSDP. CP ranks shard the parameters as FSDP ranks
    do (torchtitan folds CP into the FSDP mesh): dp_shard 2 x cp 2 holds what dp_shard 4 holds."""
    shape, w = preset("qwen2.5-7b"), Workload(seq=1024, micro_batch=1)
    lay = Layout(pp=2, tp=2, dp_shard=2)
    # one layer at TP 2: q 1792 x 3584 + bias, k, v 256 x 3584 + bias, o 3584 x 1792, gate, up 9472 x 3584,
    # down 3584 x 9472, two norms of 3584 (replicated)
    layer = 1792 * 3584 + 1792 + 2 * (256 * 3584 + 256) + 3584 * 1792 + 2 * 9472 * 3584 + 3584 * 9472 + 2 * 3584
    stage1 = 14 * layer + 3584 + 152064 // 2 * 3584  # + final norm + the lm_head's vocabulary half
    m = train_memory(shape, lay, w, rank=lay.rank_of(stage=1, shard=1, t=1))
    assert m.params == m.grads == stage1 // 2 * 2 == 1_903_956_992  # bf16, padded chunks = halves
    a = train_memory(shape, Layout(dp_shard=2, cp=2), w, rank=3)
    b = train_memory(shape, Layout(dp_shard=4), w, rank=3)
    assert (a.params, a.grads, a.optim) == (b.params, b.grads, b.optim)
