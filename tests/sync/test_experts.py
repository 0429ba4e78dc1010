"""The reshard plan for MoE models (routers, per-expert tensors, the shared expert) against the engine's own loader:
trainer shards (TP, FSDP, HSDP, PP as sync lays them out) moved by the plan into the engine's stacked experts, placed
by TP or by EP, give each engine rank exactly what EngineModel.load_weights(full state dict) gives it, with exactly
its shard's bytes; and an engine filled by the plan scores the canary rows as the trainer's model does."""

import dataclasses
import functools
import itertools

import pytest
import torch
import torch.distributed as dist

import relayrl.parallel.tensor_parallel as tensor_parallel
from relayrl.engine import LLMEngine
from relayrl.engine.model import EngineModel
from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.parallel_state import TPInfo
from relayrl.errors import ConfigError
from relayrl.models import CausalLM
from relayrl.models.config import MoEConfig, MoEShape
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.rendezvous import serve_store
from relayrl.sync.apply import execute_plan, shard_state_dict
from relayrl.sync.boxes import Box
from relayrl.sync.experts import MoESyncShape, sync_shape
from relayrl.sync.layout import EngineLayout, TrainerLayout, logical_tensors, trainer_holdings
from relayrl.sync.plan import plan_sync
from relayrl.sync.transfer import Members, SyncComm, SyncSpec, sync_step, trainer_locals
from relayrl.trainer.logprobs import token_logprobs

from dist_harness import run_distributed
from helpers import SYNC_ROWS as ROWS

CONFIGS = {
    # a dense layer (1) between MoE layers, a shared expert; experts' width 6 over dp 4: chunks 2, 2, 2, 0
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=30, hidden_size=12, intermediate_size=8,
                      num_hidden_layers=3, mlp_only_layers=(1,), num_attention_heads=4, num_key_value_heads=2,
                      head_dim=4, qkv_bias=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
                      shared_expert_intermediate_size=4),
    # Mixtral's names (block_sparse_moe, w1 / w3 / w2), every layer MoE, hidden 10 over dp 4: 3, 3, 3, 1
    "mixtral": dict(model_type="mixtral", vocab_size=20, hidden_size=10, intermediate_size=6, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=6, norm_topk_prob=True),
}
# (tp, dp_shard, dp_replicate, pp, ep): one process, FSDP 4, FSDP 2 x TP 2, HSDP 2 x 2, PP 2 x TP 2, and EP 2 under
# FSDP 4 (each expert FSDP-cut over 2 ranks), EP 2 under HSDP 2 x 2, EP 4 (each expert on one rank per replica),
# PP 2 x EP 2 (each stage's dp_shard pair is its ep group)
TRAINER = [(1, 1, 1, 1, 1), (1, 4, 1, 1, 1), (2, 2, 1, 1, 1), (1, 2, 2, 1, 1), (2, 1, 1, 2, 1),
           (1, 4, 1, 1, 2), (1, 2, 2, 1, 2), (1, 4, 1, 1, 4), (1, 2, 1, 2, 2)]
ENGINE = [(1, "tp"), (2, "tp"), (2, "ep"), (4, "ep")]


def _cfg(key: str) -> MoEConfig:
    return MoEConfig(**CONFIGS[key])


def _model(key: str) -> CausalLM:
    """Every weight N(0, 0.5), norms too (all-ones would hide a misplaced slice); routers far from uniform."""
    torch.manual_seed(0)
    model = CausalLM(_cfg(key))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 2.0 if n.endswith(".gate.weight") else 0.5)
    return model.eval()


def _full_sd(key: str) -> dict[str, torch.Tensor]:
    sd = _model(key).state_dict()
    return {k: sd[k].detach().clone() for k in logical_tensors(_cfg(key))}


def _engine_params(model: EngineModel) -> dict[str, torch.Tensor]:
    """The engine's parameters as the sync sees them (ModelRunner.params: stacked experts as 2-D views)."""
    return {n: p.data.flatten(0, 1) if p.dim() == 3 else p.data for n, p in model.named_parameters()}


_REFS: dict = {}


def _reference(key: str, etp: int, placement: str, rank: int) -> dict[str, torch.Tensor]:
    """What the engine's own loader puts on `rank`."""
    if (key, etp, placement, rank) not in _REFS:
        eng = EngineModel(_cfg(key), TPInfo(rank, etp), placement)
        eng.load_weights(_full_sd(key).items())
        _REFS[key, etp, placement, rank] = {n: t.clone() for n, t in _engine_params(eng).items()}
    return _REFS[key, etp, placement, rank]


def _cases():
    for key, (tp, dp, rep, pp, ep), (etp, placement) in itertools.product(CONFIGS, TRAINER, ENGINE):
        if etp <= CONFIGS[key]["num_attention_heads"]:
            yield pytest.param(key, tp, dp, rep, pp, ep, etp, placement,
                               id=f"{key}-t{tp}x{dp}x{rep}p{pp}ep{ep}-e{etp}{placement}")


@pytest.mark.unit
@pytest.mark.parametrize("key,tp,dp,rep,pp,ep,etp,placement", list(_cases()))
def test_plan_reproduces_engine_loader(key, tp, dp, rep, pp, ep, etp, placement):
    cfg = _cfg(key)
    tl = TrainerLayout(tp=tp, dp_shard=dp, dp_replicate=rep, pp=pp, ep=ep)
    el = EngineLayout(etp, placement)
    plan = plan_sync(cfg, tl, el)
    full = _full_sd(key)
    sources = {r: shard_state_dict(full, cfg, tl, r) for r in range(tl.world_size)}
    dst = {}
    for r in range(etp):
        eng = EngineModel(cfg, TPInfo(r, etp), placement)  # write into the engine's real parameters
        dst[r] = {n: t.fill_(float("nan")) for n, t in _engine_params(eng).items()}
    execute_plan(plan, sources, dst)
    nbytes = plan.bytes_per_dst_rank(torch.bfloat16)
    for r in range(etp):
        ref = _reference(key, etp, placement, r)
        assert set(dst[r]) == set(ref) == set(plan.engine_param_shapes(r))
        for name, want in ref.items():
            assert plan.engine_param_shapes(r)[name] == tuple(want.shape), name
            assert torch.equal(dst[r][name], want), (name, r)
        # received bytes = the engine rank's own shard (ratio 1.00): under EP only its experts arrive
        assert nbytes[r] == sum(t.numel() for t in ref.values()) * 2


@pytest.mark.unit
def test_expert_pieces_by_hand():
    """Qwen2-MoE layer 0 (E = 4, I = 6, h = 12), trainer FSDP 2 (expert rows 0:3 on rank 0, 3:6 on rank 1):
    engine EP 2 rank 1 holds experts 2 and 3 whole, each from both trainer ranks; engine TP 2 rank 1 holds rows
    3:6 of every expert, all from trainer rank 1."""
    cfg = _cfg("qwen2_moe")
    ep = plan_sync(cfg, TrainerLayout(dp_shard=2), EngineLayout(2, "ep"))
    gu = "layers.0.mlp.experts.gate_up_proj"
    got = [(t.src_rank, t.name.split("experts.")[1], t.src_offset, t.shape, t.dst_offset)
           for t in ep.for_dst(1) if t.dst_param == gu]
    assert got[:4] == [(0, "2.gate_proj.weight", (0, 0), (3, 12), (0, 0)),
                       (1, "2.gate_proj.weight", (0, 0), (3, 12), (3, 0)),
                       (0, "2.up_proj.weight", (0, 0), (3, 12), (6, 0)),
                       (1, "2.up_proj.weight", (0, 0), (3, 12), (9, 0))]
    assert ep.engine_param_shapes(1)[gu] == (2 * 12, 12)  # 2 local experts x (gate 6 + up 6) rows
    assert ep.engine_param_shapes(1)["layers.0.mlp.experts.down_proj"] == (2 * 12, 6)
    tp = plan_sync(cfg, TrainerLayout(dp_shard=2), EngineLayout(2, "tp"))
    assert tp.engine_param_shapes(1)[gu] == (4 * 6, 12)  # 4 experts x (gate 3 + up 3) rows
    assert {t.src_rank for t in tp.for_dst(1) if t.dst_param == gu} == {1}
    downs = [(t.name.split("experts.")[1], t.src_offset, t.shape, t.dst_offset)
             for t in tp.for_dst(1) if t.dst_param == "layers.0.mlp.experts.down_proj"]
    # down_proj [h, I] is cut by FSDP along h (6 rows each) and by the engine's TP along I (columns 3:6)
    assert downs[:2] == [("0.down_proj.weight", (0, 3), (6, 3), (0, 0)), ("0.down_proj.weight", (0, 3), (6, 3), (6, 0))]
    # the router and the shared expert's gate are whole on every engine rank
    assert ep.engine_param_shapes(0)["layers.0.mlp.gate.weight"] == (4, 12)
    assert ep.engine_param_shapes(1)["layers.0.mlp.shared_expert_gate.weight"] == (1, 12)


@pytest.mark.unit
def test_moe_shapes_keep_their_names():
    cfg = _cfg("mixtral")
    shape = sync_shape(cfg)
    assert isinstance(shape, MoESyncShape) and shape.mixtral and hash(shape) == hash(sync_shape(cfg))
    names = logical_tensors(cfg)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert not any(".mlp." in n for n in names)
    # the logical tensors are the model's own state dict (lm_head untied: listed)
    assert set(names) == set(CausalLM(cfg).state_dict())
    q = logical_tensors(_cfg("qwen2_moe"))
    assert set(q) == set(CausalLM(_cfg("qwen2_moe")).state_dict())
    assert "model.layers.1.mlp.gate_proj.weight" in q and "model.layers.1.mlp.experts.0.gate_proj.weight" not in q
    # an MoEShape (no model type, e.g. a planner preset) plans with the Qwen names
    bare = MoEShape(**{k: v for k, v in CONFIGS["qwen2_moe"].items() if k != "model_type"})
    assert set(logical_tensors(bare)) == set(q)


@pytest.mark.unit
def test_placements_that_do_not_divide_are_refused():
    cfg = dataclasses.replace(_cfg("mixtral"), num_experts=3, moe_intermediate_size=5)
    with pytest.raises(ConfigError, match=r"does not divide the number of experts \(3\)"):
        plan_sync(cfg, TrainerLayout(), EngineLayout(2, "ep"))
    with pytest.raises(ConfigError, match=r"does not divide the experts' width \(5\)"):
        plan_sync(cfg, TrainerLayout(), EngineLayout(2, "tp"))
    with pytest.raises(ConfigError, match="expert_placement must be one of tp, ep"):
        EngineLayout(2, "experts")


def _write_plan(runner, plan, sources) -> int:
    """On an engine rank: every piece the plan sends it, from the trainer ranks' shards, into its parameters."""
    return execute_plan(plan, sources, {runner.tp.rank: runner.params()})


# engine EP at TP 2 starts two processes (~10 s here): slow; the plan grid above checks the same placement exactly
@pytest.mark.equivalence
@pytest.mark.parametrize("key,etp,placement", [("mixtral", 1, "tp"),
                                               pytest.param("qwen2_moe", 2, "ep", marks=pytest.mark.slow)])
def test_canary_engine_filled_by_the_plan_scores_as_the_trainer(key, etp, placement):
    """The canary: an engine whose weights came by the plan (trainer FSDP 2 x TP 2) scores the canary rows as the
    trainer's model does (fp32); one expert's tensors swapped between two experts moves it far past the bound."""
    model = _model(key)
    cfg = model.config
    ids = torch.tensor(ROWS)
    ref = token_logprobs(model, ids, torch.ones_like(ids))[0][:, 1:]
    tl = TrainerLayout(tp=2, dp_shard=2)
    plan = plan_sync(cfg, tl, EngineLayout(etp, placement))
    full = _full_sd(key)
    sources = {r: shard_state_dict(full, cfg, tl, r) for r in range(tl.world_size)}
    eng = LLMEngine(cfg, tensor_parallel_size=etp, expert_placement=placement, num_blocks=16)
    try:
        eng.begin_weight_update()
        moved = eng.run_on_ranks(_write_plan, plan, sources)
        eng.end_weight_update()
        assert moved == [sum(t.numel for t in plan.for_dst(r)) for r in range(etp)]
        gap = (eng.score(ROWS)[:, 1:] - ref).abs().max()
        assert gap < 1e-5
        block = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
        down = "w2" if cfg.model_type == "mixtral" else "down_proj"
        a, b = (f"model.layers.0.{block}.experts.{j}.{down}.weight" for j in (0, 3))
        swapped = {r: {**s, a: s[b], b: s[a]} for r, s in sources.items()}  # a misplaced expert
        eng.begin_weight_update()
        eng.run_on_ranks(_write_plan, plan, swapped)
        eng.end_weight_update()
        assert (eng.score(ROWS)[:, 1:] - ref).abs().max() > 100 * max(gap, 1e-6)
    finally:
        eng.close()


@pytest.mark.unit
def test_trainer_ep_holdings_by_hand():
    """dp_shard 4, ep 2 (ranks 0 1 | 2 3 split into ep groups {0, 1}, {2, 3}): ranks 0 and 2 hold experts 0 and 1,
    each FSDP-cut in two (rows 0:3 on rank 0, 3:6 on rank 2); the router stays FSDP-cut over all 4."""
    cfg = _cfg("qwen2_moe")
    tl = TrainerLayout(dp_shard=4, ep=2)
    held = {r: trainer_holdings(cfg, tl, r) for r in range(4)}
    up = "model.layers.0.mlp.experts.{}.up_proj.weight"
    assert held[0][up.format(1)][0].box == Box(0, 3, 0, 12) and held[2][up.format(1)][0].box == Box(3, 6, 0, 12)
    assert up.format(2) not in held[0] and held[1][up.format(2)][0].box == Box(0, 3, 0, 12)
    assert held[3][up.format(3)][0].box == Box(3, 6, 0, 12)
    assert held[3]["model.layers.0.mlp.gate.weight"][0].box == Box(3, 4, 0, 12)  # 4 router rows over 4
    plan = plan_sync(cfg, tl, EngineLayout(2, "ep"))
    # engine EP 2 rank 1 (experts 2, 3) reads routed experts from trainer ranks 1 and 3 only
    assert {t.src_rank for t in plan.for_dst(1) if ".experts." in t.name} == {1, 3}
    text = plan.describe()
    assert "dp_shard=4 dp_replicate=1 ep=2 (4 ranks)" in text
    assert "2 MoE layers x 4 experts (top 2) x width 6, shared expert 4; engine expert placement ep" in text
    with pytest.raises(ConfigError, match="must divide dp_shard"):
        TrainerLayout(dp_shard=3, ep=2)
    with pytest.raises(ConfigError, match="experts are not tensor-parallel under ep"):
        TrainerLayout(tp=2, dp_shard=2, ep=2)


@pytest.mark.unit
@pytest.mark.parametrize("rep,shard,tp,ep", [(1, 4, 1, 1), (1, 2, 2, 1), (1, 4, 1, 2), (2, 2, 1, 2)])
def test_layout_matches_parallelize_model(monkeypatch, rep, shard, tp, ep):
    """The trainer layout the plan assumes IS what parallelize_model (TP, EP, FSDP / HSDP) leaves on each rank of
    an MoE model: the same names, local shapes and values (torch's fake process group, a rank at a time)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    monkeypatch.setattr(tensor_parallel, "parallelize_module",  # the fake group moves no data: split locally
                        functools.partial(tensor_parallel.parallelize_module, src_data_rank=None))
    cfg = _cfg("qwen2_moe")
    full = _full_sd("qwen2_moe")
    layout = TrainerLayout(tp=tp, dp_shard=shard, dp_replicate=rep, ep=ep)
    for rank in range(layout.world_size):
        dist.init_process_group("fake", rank=rank, world_size=layout.world_size, store=fake_pg.FakeStore())
        try:
            dims = ParallelDims(dp_replicate=rep, dp_shard=shard, tp=tp, ep=ep, world_size=layout.world_size)
            model = CausalLM(cfg)
            model.load_state_dict(full, strict=False)
            parallelize_model(model, dims, dims.build_mesh("cpu"))
            local = trainer_locals(model)
            mine = shard_state_dict(full, cfg, layout, rank)
            assert set(mine) == set(local)  # every tensor this rank holds, and only those
            for name, want in mine.items():
                assert local[name].shape == want.shape, (rank, name)
                assert torch.equal(local[name], want), (rank, name)
        finally:
            dist.destroy_process_group()


# ---- the planned sync between real processes (relayrl.sync.transfer), trainer shards from parallelize_model
# (trainer layout (tp, dp_shard, ep), engine (tp, placement)), colocated on 2 gloo ranks
TRANSFER_CASES = [((1, 2, 2), (2, "ep")), ((1, 2, 2), (1, "tp")), ((1, 2, 1), (2, "tp")), ((2, 1, 1), (2, "ep"))]


def _transfer_grid(rank: int, world: int, store) -> list:
    """Each case: the trainer's model parallelised, synced into colocated engine ranks by sync_step; returns
    (case, engine rank, max |engine - reference| on the canary rows, bytes moved, the plan's bytes for it)."""
    comm = SyncComm(store, rank, world)
    groups = {1: None, 2: dist.group.WORLD}
    ref_model = _model("qwen2_moe")
    cfg = ref_model.config
    ids = torch.tensor(ROWS)
    ref = token_logprobs(ref_model, ids, torch.ones_like(ids))[0]
    full = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    out = []
    for (tp, shard, ep), (etp, placement) in TRANSFER_CASES:
        dims = ParallelDims(dp_shard=shard, tp=tp, ep=ep, world_size=world)
        model = CausalLM(cfg)
        model.load_state_dict(full)
        model = parallelize_model(model, dims, dims.build_mesh("cpu"))
        spec = SyncSpec(shape=sync_shape(cfg), trainer=TrainerLayout(tp=tp, dp_shard=shard, ep=ep),
                        engine=EngineLayout(etp, placement), members=Members(world, world, colocated=True),
                        dtype=torch.float32, bucket_bytes=512, window=2)
        hosts = rank < etp
        runner = ModelRunner(cfg, torch.float32, TPInfo(rank, etp, groups[etp]), expert_placement=placement) \
            if hosts else None
        if runner is not None:
            for p in runner.params().values():
                p.fill_(float("nan"))  # anything the sync misses shows
        stats = sync_step(spec, comm=comm, trainer_rank=rank, engine_rank=rank if hosts else None,
                          local=trainer_locals(model), params=runner.params() if hosts else None)
        if hosts:
            gap = float((runner.score(ROWS) - ref).abs().max())
            out.append((f"t{tp}x{shard}ep{ep}-e{etp}{placement}", rank, gap, stats.bytes_received + stats.bytes_copied,
                        spec.plan.bytes_per_dst_rank(torch.float32)[rank]))
        dist.barrier()
    comm.close()
    return out


@pytest.mark.equivalence
def test_sync_between_processes_moves_experts_into_the_engine():
    store = serve_store()
    rows = [r for per_rank in run_distributed(_transfer_grid, 2, store.address, timeout=300) for r in per_rank]
    assert len(rows) == sum(etp for _, (etp, _) in TRANSFER_CASES)
    for case, rank, gap, moved, shard_bytes in rows:
        assert gap < 1e-5, (case, rank, gap)
        assert moved == shard_bytes, (case, rank)  # exactly its shard: under EP only its own experts arrive
