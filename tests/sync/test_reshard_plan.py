"""The reshard planner against the engine's own loader: for every trainer x engine layout on a grid,
sharding a full state dict per trainer rank and executing the plan must give each engine rank exactly
the parameters EngineModel.load_weights(full state dict) gives it."""

import itertools

import pytest
import torch

from relayrl.engine.model import EngineModel
from relayrl.engine.parallel_state import TPInfo, head_layout
from relayrl.errors import ConfigError
from relayrl.models import CausalLM, ModelConfig
from relayrl.sync.apply import empty_engine_params, execute_plan, pack, shard_state_dict, unpack
from relayrl.sync.boxes import Box
from relayrl.sync.layout import (
    EngineLayout,
    TrainerLayout,
    engine_heads,
    engine_holdings,
    logical_tensors,
    trainer_holdings,
)
from relayrl.sync.plan import choose_source, plan_sync

from helpers import SYNC_CONFIGS, naive_plan

pytestmark = pytest.mark.unit

CONFIGS = SYNC_CONFIGS
TRAINER = [(tp, dp) for tp in (1, 2) for dp in (1, 2, 4)]
ENGINE_TP = (1, 2, 4)


def _cfg(key: str) -> ModelConfig:
    return ModelConfig(**CONFIGS[key])


def _full_sd(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Random values everywhere (norms too: all-ones would hide a misplaced slice), logical names only."""
    model = CausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return {k: sd[k] for k in logical_tensors(cfg)}


_REFS: dict = {}


def _reference(key: str, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """What the engine's own loader puts on `rank` (parameters, tied ones once)."""
    if (key, tp, rank) not in _REFS:
        cfg = _cfg(key)
        eng = EngineModel(cfg, TPInfo(rank, tp))
        eng.load_weights(_full_sd(cfg).items())
        _REFS[key, tp, rank] = {n: p.detach().clone() for n, p in eng.named_parameters()}
    return _REFS[key, tp, rank]


def _cases():
    for key, (tp, dp), etp in itertools.product(CONFIGS, TRAINER, ENGINE_TP):
        if CONFIGS[key]["num_key_value_heads"] % tp == 0:  # the trainer's TP shards KV heads evenly
            yield pytest.param(key, tp, dp, etp, id=f"{key}-t{tp}x{dp}-e{etp}")


def _sources(cfg, tl):
    full = _full_sd(cfg)
    return {r: shard_state_dict(full, cfg, tl, r) for r in range(tl.world_size)}


@pytest.mark.parametrize("key,tp,dp,etp", list(_cases()))
def test_plan_reproduces_engine_loader(key, tp, dp, etp):
    cfg = _cfg(key)
    tl, el = TrainerLayout(tp=tp, dp_shard=dp), EngineLayout(etp)
    plan = plan_sync(cfg, tl, el)
    sources = _sources(cfg, tl)
    dst = {}
    for r in range(etp):
        eng = EngineModel(cfg, TPInfo(r, etp))  # write into the engine's real parameters
        dst[r] = {n: p.data.fill_(float("nan")) for n, p in eng.named_parameters()}
    execute_plan(plan, sources, dst)
    nbytes = plan.bytes_per_dst_rank(torch.bfloat16)
    for r in range(etp):
        ref = _reference(key, etp, r)
        assert set(dst[r]) == set(ref) == set(plan.engine_param_shapes(r))
        for name, want in ref.items():
            assert plan.engine_param_shapes(r)[name] == tuple(want.shape), name
            assert torch.equal(dst[r][name], want), (name, r)
        # received bytes = the engine rank's own shard, replicated parameters included
        assert nbytes[r] == sum(p.numel() for p in ref.values()) * 2


@pytest.mark.parametrize("key,tp,dp,etp", list(_cases()))
def test_sources_are_the_holders(key, tp, dp, etp):
    """Brute force over trainer ranks: the ranks whose boxes meet each destination piece; a piece
    held by one rank comes from it, a replicated one from the documented choice."""
    cfg = _cfg(key)
    tl, el = TrainerLayout(tp=tp, dp_shard=dp), EngineLayout(etp)
    plan = plan_sync(cfg, tl, el)
    held = {r: trainer_holdings(cfg, tl, r) for r in range(tl.world_size)}
    for dst in range(etp):
        expected = set()
        for pieces in engine_holdings(cfg, el, dst).values():
            for piece in pieces:
                by_box: dict[Box, list[int]] = {}
                for r in range(tl.world_size):
                    (h,) = held[r][piece.name]
                    if piece.box & h.box is not None:
                        by_box.setdefault(h.box, []).append(r)
                expected |= {choose_source(tuple(hs), dst) for hs in by_box.values()}
        assert plan.sources(dst) == expected
        for t in plan.for_dst(dst):
            (h,) = held[t.src_rank][t.name]
            assert h.box.contains(t.logical) and h.local_shape == h.box.shape


def test_seed_case_pieces_by_hand():
    """Trainer TP 2 (no FSDP) -> engine TP 4, 8 Q / 2 KV heads, head_dim 4: trainer rank t holds
    q_proj rows [16t, 16t+16) (Q heads 4t..4t+3) and KV head t; engine rank r holds Q heads 2r, 2r+1
    and KV head r // 2."""
    cfg = _cfg("gqa8x2")
    plan = plan_sync(cfg, TrainerLayout(tp=2), EngineLayout(4))
    qkv = "layers.0.self_attn.qkv_proj.weight"
    got = {r: [(t.src_rank, t.name.split(".")[-2], t.src_offset, t.shape, t.dst_offset)
               for t in plan.for_dst(r) if t.dst_param == qkv] for r in range(4)}
    h = 18
    assert got[1] == [(0, "q_proj", (8, 0), (8, h), (0, 0)),   # Q heads 2,3: trainer 0's local rows 8:16
                      (0, "k_proj", (0, 0), (4, h), (8, 0)),   # KV head 0, shared with engine rank 0
                      (0, "v_proj", (0, 0), (4, h), (12, 0))]
    assert got[2] == [(1, "q_proj", (0, 0), (8, h), (0, 0)),   # Q heads 4,5 = trainer 1's local rows 0:8
                      (1, "k_proj", (0, 0), (4, h), (8, 0)),
                      (1, "v_proj", (0, 0), (4, h), (12, 0))]
    o = [(t.src_rank, t.src_offset, t.shape) for t in plan.for_dst(3)
         if t.dst_param == "layers.0.self_attn.o_proj.weight"]
    assert o == [(1, (0, 8), (h, 8))]  # Q heads 6,7 = columns 24:32 = trainer 1's (16:32) local columns 8:16
    assert plan.sources(0) == {0, 1}  # embed_tokens is vocab-sharded on the trainer, whole on the engine
    assert plan_sync(cfg, TrainerLayout(tp=2), EngineLayout(4)) is plan  # cached


def test_pack_unpack_equals_execute():
    """The buffer a transfer layer would send per (trainer, engine) pair lands the same bytes."""
    cfg = _cfg("gqa8x2")
    tl = TrainerLayout(tp=2, dp_shard=2)
    plan = plan_sync(cfg, tl, EngineLayout(4))
    sources = _sources(cfg, tl)
    for r in range(4):
        params = {n: t.fill_(float("nan")) for n, t in empty_engine_params(plan, r).items()}
        for s in range(tl.world_size):
            unpack(plan, s, r, pack(plan, s, r, sources[s]), params)
        for name, want in _reference("gqa8x2", 4, r).items():
            assert torch.equal(params[name], want), name
    with pytest.raises(ValueError, match="expects"):
        unpack(plan, 0, 0, torch.zeros(3), empty_engine_params(plan, 0))


def test_hsdp_replicas_spread_the_reads():
    cfg = _cfg("gqa8x2")
    tl = TrainerLayout(tp=2, dp_shard=2, dp_replicate=2)
    plan = plan_sync(cfg, tl, EngineLayout(2))
    sources = _sources(cfg, tl)
    dst = {r: empty_engine_params(plan, r) for r in range(2)}
    execute_plan(plan, sources, dst)
    for r in range(2):
        for name, want in _reference("gqa8x2", 2, r).items():
            assert torch.equal(dst[r][name], want)
    # round-robin over the replicas: engine rank 0 reads replica 0 (trainer ranks 0-3), engine
    # rank 1 reads its own rank 1 where it can and replica 1 (ranks 4-7) otherwise
    assert plan.sources(0) <= {0, 1, 2, 3} and plan.sources(1) & {4, 5, 6, 7}
    sent = plan.bytes_per_src_rank(torch.float32)
    assert sum(sent.values()) == sum(plan.bytes_per_dst_rank(torch.float32).values())


def test_naive_fused_slicing_is_wrong():
    """Assemble qkv = [q; k; v] and cut it in equal row blocks: with 8 Q / 2 KV heads (head_dim 4)
    and engine TP 2 the shapes match (24 rows) but the rows are not the rank's heads."""
    cfg = _cfg("gqa8x2")
    full = _full_sd(cfg)
    q, k, v = (full[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv")
    naive = naive_plan(full, cfg, 2)
    name = "layers.0.self_attn.qkv_proj.weight"
    right0, right1 = _reference("gqa8x2", 2, 0)[name], _reference("gqa8x2", 2, 1)[name]
    assert naive[0][name].shape == right0.shape == (24, 18)
    # rank 0: Q heads 0-3 (rows 0:16) happen to be right; rows 16:24 should be K / V head 0 but are Q heads 4, 5
    assert torch.equal(naive[0][name][:16], right0[:16])
    assert torch.equal(naive[0][name][16:], q[16:24])
    assert not torch.equal(naive[0][name][16:], torch.cat([k[:4], v[:4]]))
    # rank 1: gets Q heads 6, 7 and BOTH KV heads' K and V, instead of Q heads 4-7 and KV head 1
    assert torch.equal(naive[1][name], torch.cat([q[24:], k, v]))
    wrong_rows = (naive[1][name] != right1).any(dim=1).nonzero().flatten().tolist()
    assert wrong_rows == list(range(20))  # only rows 20:24 (V of KV head 1) land right, by coincidence
    # engine TP 4 > KV heads: the naive blocks are not even the right size (12 rows, not 2*4 + 4 + 4)
    naive4 = naive_plan(full, cfg, 4)
    assert naive4[1][name].shape == (12, 18) != _reference("gqa8x2", 4, 1)[name].shape == (16, 18)
    # gate_up likewise: rank 0 of 2 gets all of gate, none of up
    gu = "layers.0.mlp.gate_up_proj.weight"
    assert torch.equal(naive[0][gu], full["model.layers.0.mlp.gate_proj.weight"])
    assert not torch.equal(naive[0][gu], _reference("gqa8x2", 2, 0)[gu])


# ---------------------------------------------------------------------------- layouts and boxes
@pytest.mark.parametrize("key", list(CONFIGS))
def test_logical_tensors_are_the_checkpoint(key):
    cfg = _cfg(key)
    sd = CausalLM(cfg).state_dict()
    want = {k: tuple(v.shape) for k, v in sd.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert logical_tensors(cfg) == want


def test_engine_heads_match_engine():
    for hq, hkv, tp in [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8), (4, 4, 2), (4, 1, 4), (12, 4, 2)]:
        for r in range(tp):
            assert engine_heads(hq, hkv, tp, r) == head_layout(hq, hkv, TPInfo(r, tp))


def test_fsdp_chunks_follow_torch_chunk():
    """dp 4 over 6 rows: torch.chunk gives 2, 2, 2 and FSDP pads with an empty 4th chunk."""
    cfg = ModelConfig(**{**CONFIGS["mha4"], "vocab_size": 6})
    sizes = [trainer_holdings(cfg, TrainerLayout(dp_shard=4), r)["model.embed_tokens.weight"][0].box.shape[0]
             for r in range(4)]
    assert sizes == [c.shape[0] for c in torch.arange(6).chunk(4)] + [0] == [2, 2, 2, 0]
    # rank numbering: tp fastest — rank 3 of (dp_shard 2, tp 2) is shard 1, tp rank 1
    holdings = trainer_holdings(_cfg("gqa8x2"), TrainerLayout(tp=2, dp_shard=2), 3)
    (h,) = holdings["model.layers.0.self_attn.q_proj.weight"]
    assert h.box == Box(24, 32, 0, 18)


def test_bad_layouts_say_what_is_wrong():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        plan_sync(_cfg("mqa4x1"), TrainerLayout(tp=2), EngineLayout(1))
    with pytest.raises(ConfigError, match="attention heads"):
        plan_sync(_cfg("gqa8x2"), TrainerLayout(), EngineLayout(3))
    with pytest.raises(ConfigError, match="intermediate_size"):
        plan_sync(ModelConfig(**{**CONFIGS["gqa8x2"], "intermediate_size": 18}), TrainerLayout(), EngineLayout(4))
    with pytest.raises(ConfigError, match="dp_shard"):
        TrainerLayout(dp_shard=0)


def test_boxes():
    a, b = Box(0, 4, 2, 6), Box(2, 8, 0, 3)
    assert a & b == Box(2, 4, 2, 3) and (a & b).size == 2 and (a & b).shape == (2, 1)
    assert a & Box(4, 5, 0, 9) is None and Box(0, 3) & Box(3, 5) is None
    assert Box(3, 7) & Box(5, 9) == Box(5, 7) and Box(5, 7).relative_to(Box(3, 9)) == Box(2, 4)
    assert Box(2, 4, 2, 3).relative_to(a) == Box(2, 4, 0, 1) and Box.at((1, 2), (3, 4)) == Box(1, 4, 2, 6)
    t = torch.arange(48).view(6, 8)
    assert torch.equal(t[Box(1, 3, 2, 5).slices()], t[1:3, 2:5])
    with pytest.raises(ValueError):
        Box(0, 2) & Box(0, 2, 0, 2)
    with pytest.raises(ValueError):
        Box(3, 2)


def test_describe_reads_like_a_table():
    text = plan_sync(_cfg("gqa8x2"), TrainerLayout(tp=2, dp_shard=2), EngineLayout(4)).describe()
    assert "trainer tp=2 dp_shard=2" in text and "engine tp=4" in text
    assert "layers.0.self_attn.qkv_proj.weight [16, 18]" in text
    assert "layers.1." not in text and "(layers 1..1: the same pattern)" in text


def test_sync_imports_neither_trainer_nor_engine():
    """The layering rule: sync speaks of logical tensors; it knows the engine only as data."""
    import ast
    import pathlib

    import relayrl.sync

    for path in pathlib.Path(relayrl.sync.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert not n.startswith(("relayrl.trainer", "relayrl.engine", "relayrl.controller")), (path.name, n)


def test_presets_plan():
    from relayrl.sync.presets import PRESETS, preset

    plan = plan_sync(preset("qwen2.5-0.5b"), TrainerLayout(tp=2, dp_shard=2), EngineLayout(2))
    # one engine rank of 2: all of embed (tied, so no lm_head), half of every layer's projections
    assert plan.param_shapes[0][0] == ("embed_tokens.weight", (151936, 896))
    assert "lm_head.weight" not in plan.engine_param_shapes(0)
    assert plan.engine_param_shapes(1)["layers.0.self_attn.qkv_proj.weight"] == ((7 + 2) * 64, 896)
    assert set(PRESETS) >= {"tiny-gqa", "qwen3-8b"}
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("gpt-2")
