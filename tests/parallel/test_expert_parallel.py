"""Expert parallelism against one process: logits, loss, routing, every parameter's gradient and the grad norm.

The ranks are launched once per world size (cached) and compute every case through parallelize_model; the
comparisons happen here against the plain model run in this process. Each case's loss is a token-mean NLL over
the masked tokens divided by the GLOBAL token count, so FSDP's summed gradients equal the single-process ones.

Tiny MoE models (hidden 32, 2 layers, 4 experts, top-2): Qwen3-MoE, Mixtral, and Qwen2-MoE with its gated shared
expert. Routings: the router's own, a replayed random one (Routing(replay=...)), one that sends no token to the
ep ranks holding experts 2 and 3, and one that sends every token of each rank to the other rank's experts.
"""

from __future__ import annotations

import functools
import math
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from relayrl.errors import ConfigError
from relayrl.models.config import MoEConfig
from relayrl.models.moe import Routing, grouped_experts
from relayrl.parallel.config import ParallelConfig
from relayrl.parallel.context_parallel import apply_context_parallel
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.expert_parallel import ExpertParallel, apply_expert_parallel, grad_norm_ep
from relayrl.parallel.parallelize import parallelize_model

from dist_harness import run_distributed
from helpers import masked_nll, perturbed_model, small_config

pytestmark = pytest.mark.equivalence

REL = 1e-5  # max |a - b| <= REL * max |b|, fp32
B, T, E, K = 4, 8, 4, 2
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16)
CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", qk_norm=True, norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", norm_topk_prob=True),
    "qwen2_moe_shared": dict(model_type="qwen2_moe", qkv_bias=True, shared_expert_intermediate_size=24,
                             tie_word_embeddings=True),
}

# name: ParallelDims degrees, config, routing, activation checkpointing, grad_reduce
CASES = {
    "qwen3_moe": (dict(dp_shard=2, ep=2), "qwen3_moe", "routed", False, "sum"),
    "mixtral": (dict(dp_shard=2, ep=2), "mixtral", "routed", False, "sum"),
    "qwen2_moe_shared": (dict(dp_shard=2, ep=2), "qwen2_moe_shared", "routed", False, "sum"),
    "qwen3_moe_replay": (dict(dp_shard=2, ep=2), "qwen3_moe", "replay", False, "sum"),
    "mixtral_no_tokens_for_ep_rank_1": (dict(dp_shard=2, ep=2), "mixtral", "experts_0_1", False, "sum"),
    "qwen2_moe_crossed": (dict(dp_shard=2, ep=2), "qwen2_moe_shared", "crossed", False, "sum"),
    "qwen3_moe_ac_replay": (dict(dp_shard=2, ep=2), "qwen3_moe", "replay", True, "sum"),
    # ep borrows the cp ranks: each holds half of every row's tokens and half of the experts
    "cp2_ep2_ring_mixtral": (dict(cp=2, ep=2), "mixtral", "routed", False, "sum"),
}
# 4 ranks (slow: one more launch): the experts FSDP-sharded over the efsdp ranks holding the same ones, HSDP
CASES4 = {
    "efsdp2_qwen3_moe": (dict(dp_shard=4, ep=2), "qwen3_moe", "routed", False, "sum"),
    "ep4_mixtral_no_tokens_for_ep_ranks_2_3": (dict(dp_shard=4, ep=4), "mixtral", "experts_0_1", False, "sum"),
    "hsdp2_ep2_qwen2_moe_replay": (dict(dp_replicate=2, dp_shard=2, ep=2), "qwen2_moe_shared", "replay", False,
                                   "sum"),
    "efsdp2_qwen3_moe_mean": (dict(dp_shard=4, ep=2), "qwen3_moe", "crossed", True, "mean"),
}


def build(config: str, num_experts: int = E):
    model = perturbed_model(MoEConfig(**{**BASE, "num_experts": num_experts}, **CONFIGS[config]))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".gate.weight"):  # routers far from uniform: top-k without near-ties
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def batch():
    """ids [4, 8], attention mask (right / left padding in two rows), loss mask on the slots that predict."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 6:] = 0
    attn[2, :3] = 0
    pos = torch.arange(T)[None].expand(B, T)
    loss_mask = ((pos >= 2) & attn.bool()).float()
    labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    mask = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], 1)
    return ids, attn, labels, mask


def replay_of(kind: str) -> torch.Tensor | None:
    """[B, T, 2 MoE layers, k] expert ids, or None (the router's own top-k)."""
    if kind == "routed":
        return None
    if kind == "replay":  # k distinct random experts per token and layer
        g = torch.Generator().manual_seed(11)
        return torch.rand(B, T, 2, E, generator=g).argsort(-1)[..., :K]
    if kind == "experts_0_1":  # experts 2 and 3 (ep rank 1 of 2; ranks 2 and 3 of 4) receive nothing
        return torch.tensor([1, 0]).expand(B, T, 2, K).clone()
    # crossed: rows 0, 1 go to experts 3, 2, rows 2, 3 to experts 1, 0: with dp 2 and ep 2 (rows 0, 1 on the rank
    # holding experts 0, 1) each rank sends all its pairs to the other and receives all the other's
    out = torch.tensor([1, 0]).expand(B, T, 2, K).clone()
    out[: B // 2] = torch.tensor([3, 2])
    return out


nll = masked_nll


@functools.cache
def reference(config: str, kind: str):
    model = build(config)
    ids, attn, labels, mask = batch()
    rec = Routing(replay=replay_of(kind))
    logits = model(ids, attention_mask=attn, routing=rec)
    loss = nll(logits, labels, mask, mask.sum())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    return logits.detach(), loss.detach(), grads, rec.selected_experts(), norm


# ---------------------------------------------------------------- rank side
def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


@functools.cache
def _dims(**degrees) -> ParallelDims:
    """One ParallelDims (and mesh, and process groups) per layout in a rank process: the cases share them."""
    dims = ParallelDims(world_size=dist.get_world_size(), **degrees)
    dims.build_mesh("cpu")
    return dims


def _case(degrees, config, kind, ac, grad_reduce):
    dims = _dims(**degrees)
    mesh = dims.mesh
    model = parallelize_model(build(config), dims, mesh, activation_checkpointing=ac, grad_reduce=grad_reduce,
                              gather_logits=True)
    ids, attn, labels, mask = batch()
    replay = replay_of(kind)
    rows = B // dims.dp
    mine = slice(dims.dp_rank * rows, (dims.dp_rank + 1) * rows)
    ids, attn, labels, local_mask = ids[mine], attn[mine], labels[mine], mask[mine]
    replay = None if replay is None else replay[mine]
    cp = None
    if dims.cp > 1:
        cp = apply_context_parallel(model, dims.cp_mesh.get_group(), "ring")
        labels, local_mask, replay = cp.shard(labels), cp.shard(local_mask), None if replay is None else cp.shard(
            replay)
    rec = Routing(replay=replay)
    logits = (cp or model)(ids, attention_mask=attn, routing=rec)
    loss = nll(logits, labels, local_mask, mask.sum())
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if cp is not None:
        logits = cp.gather(logits.detach())
    blocks = [m.experts_fn for m in model.modules() if isinstance(getattr(m, "experts_fn", None), ExpertParallel)]
    return dict(dp_rank=dims.dp_rank, ep_rank=dims.ep_mesh.get_local_rank(), logits=logits.detach(), loss=total,
                grads={n: _full(p.grad) for n, p in model.named_parameters()},
                selected=None if cp is not None else rec.selected_experts(),
                norm=grad_norm_ep(model, dims.ep_mesh), local=[list(b.local) for b in blocks],
                ep_group=dims.ep_mesh.mesh.tolist(), expert_fsdp_group=dims.expert_fsdp_mesh.mesh.tolist())


def _refusals():
    """E = 3 over ep = 2 is refused in one line, and leaves the model as it was; a dense model has no experts."""
    out = {}
    model = build("qwen3_moe", num_experts=3)
    mesh = _dims(dp_shard=2).mesh
    try:
        apply_expert_parallel(model, mesh["dp_shard"])
    except ConfigError as e:
        out["experts3"] = str(e)
    block = model.model.layers[0].mlp
    out["untouched"] = len(block.experts) == 3 and block.experts_fn is grouped_experts
    try:
        apply_expert_parallel(perturbed_model(small_config()), mesh["dp_shard"])
    except ConfigError as e:
        out["dense"] = str(e)
    return out


def _checkpoint(root: str):
    """Save under ep = 2 (each rank its experts, its FSDP shards of the rest); load one process's save into an EP
    model whose weights were all zero: what it then holds, gathered."""
    dims = _dims(dp_shard=2, ep=2)
    model = parallelize_model(build("mixtral"), dims, dims.mesh)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=Path(root) / "from_ep2")
    zeroed = build("qwen2_moe_shared")
    with torch.no_grad():
        for p in zeroed.parameters():
            p.zero_()
    zeroed = parallelize_model(zeroed, dims, dims.mesh)
    state = {"model": get_model_state_dict(zeroed)}
    dcp.load(state, checkpoint_id=Path(root) / "from_one")
    set_model_state_dict(zeroed, state["model"])
    return {n: _full(p.detach()) for n, p in zeroed.named_parameters()}


def _rank(rank, world_size, cases, root):
    results = {name: _case(*spec) for name, spec in cases.items()}
    if world_size == 2:
        results["refusals"] = _refusals()
        results["checkpoint"] = _checkpoint(root)
    else:  # pp outermost: each stage's (dp_shard 2) ranks are its ep group, and no expert is sharded (efsdp 1)
        dims = ParallelDims(pp=2, dp_shard=2, ep=2, world_size=4)
        dims.build_mesh("cpu")
        results["pp2_ep2_meshes"] = dims.ep_mesh.mesh.tolist(), dims.expert_fsdp_mesh.mesh.tolist()
    return results


@functools.cache
def distributed(world_size: int):
    root = checkpoint_dir()
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": build("qwen2_moe_shared").state_dict()}, checkpoint_id=Path(root) / "from_one",
                 no_dist=True)
    return run_distributed(_rank, world_size, CASES if world_size == 2 else CASES4, root, timeout=240.0)


@functools.cache
def checkpoint_dir() -> str:
    return tempfile.mkdtemp(prefix="relayrl_ep_ckpt_")


# ---------------------------------------------------------------- tests
def assert_close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= REL * b.abs().max().item(), f"{what}: max |diff| {err:.3g} vs max |ref| {b.abs().max():.3g}"


def expert_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


@pytest.mark.parametrize("case", list(CASES) + [pytest.param(name, marks=pytest.mark.slow) for name in CASES4])
def test_equals_one_process(case):
    degrees, config, kind, _, grad_reduce = CASES.get(case) or CASES4[case]
    ref_logits, ref_loss, ref_grads, ref_selected, ref_norm = reference(config, kind)
    world = 2 if case in CASES else 4
    ep = degrees["ep"]
    dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    scale = 1.0 / (dp * degrees.get("cp", 1)) if grad_reduce == "mean" else 1.0
    held = set()
    for rank, results in enumerate(distributed(world)):
        r = results[case]
        rows = B // dp
        mine = slice(r["dp_rank"] * rows, (r["dp_rank"] + 1) * rows)
        assert_close(r["logits"], ref_logits[mine], f"{case} rank {rank} logits")
        assert_close(r["loss"], ref_loss, f"{case} rank {rank} loss")
        if r["selected"] is not None:  # the EP model routes (or replays) its tokens exactly as one process
            assert torch.equal(r["selected"], ref_selected[mine]), f"{case} rank {rank} routing"
        # this rank holds E / ep whole experts, those of its ep rank, under the checkpoint's names
        want = list(range(r["ep_rank"] * E // ep, (r["ep_rank"] + 1) * E // ep))
        assert r["local"] == [want, want]
        experts = {expert_of(n) for n in r["grads"]} - {None}
        assert experts == set(want), (case, rank, experts)
        for name, g in r["grads"].items():
            assert_close(g, ref_grads[name] * scale, f"{case} rank {rank} grad {name}")
        held |= set(r["grads"])
        if grad_reduce == "sum":
            assert abs(r["norm"] - ref_norm) <= REL * ref_norm, (case, rank, r["norm"], ref_norm)
    assert held == set(ref_grads)  # every parameter is on some rank, every expert's on the ranks of one ep rank


def test_a_rank_without_tokens_still_takes_part():
    """No token chose experts 2 and 3: the ep rank holding them received no row, ran them on empty chunks, and their
    gradients are zeros (present, so FSDP reduces the same tensors everywhere); the other experts' are not."""
    for results in distributed(2):
        r = results["mixtral_no_tokens_for_ep_rank_1"]
        for name, g in r["grads"].items():
            e = expert_of(name)
            if e is not None:
                assert (g.abs().max() == 0) == (e >= 2), (name, g.abs().max())


def test_meshes():
    for rank, results in enumerate(distributed(2)):
        assert results["qwen3_moe"]["ep_group"] == [0, 1] and results["qwen3_moe"]["expert_fsdp_group"] == [rank]


@pytest.mark.slow
def test_meshes_4():
    """dp_shard 4, ep 2: ep groups {0, 1} {2, 3}, the same experts on {0, 2} {1, 3}; HSDP (2, 2) with ep 2: the ep
    groups are the dp_shard pairs, and each expert is replicated over dp_replicate, never sharded (efsdp 1); pp 2 x
    dp_shard 2 with ep 2: each stage's pair."""
    for rank, results in enumerate(distributed(4)):
        r = results["efsdp2_qwen3_moe"]
        assert r["ep_group"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r["expert_fsdp_group"] == [rank % 2, rank % 2 + 2]
        h = results["hsdp2_ep2_qwen2_moe_replay"]
        assert h["ep_group"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert h["expert_fsdp_group"] == [[rank % 2], [rank % 2 + 2]]
        assert results["ep4_mixtral_no_tokens_for_ep_ranks_2_3"]["ep_group"] == [0, 1, 2, 3]
        assert results["pp2_ep2_meshes"] == ([rank // 2 * 2, rank // 2 * 2 + 1], [rank])


def test_refusals():
    out = distributed(2)[0]["refusals"]
    assert out["experts3"] == ("parallel.ep=2 must divide the model's num_experts=3: each ep rank holds "
                               "num_experts / ep whole experts")
    assert out["untouched"]
    assert "has no MoE block" in out["dense"]
    with pytest.raises(ConfigError, match=r"^ep=4 must divide dp_shard x cp = 2: "):
        ParallelDims(dp_shard=2, ep=4, world_size=2)
    with pytest.raises(ConfigError, match=r"^ep=2 must divide dp_shard x cp = 3: "):
        ParallelDims(dp_shard=3, ep=2, world_size=3)
    with pytest.raises(ConfigError, match="ep=2 with tp=2 is not supported"):
        ParallelDims(dp_shard=2, tp=2, ep=2, world_size=4)
    with pytest.raises(ConfigError, match="parallel degree ep must be an integer >= 1"):
        ParallelDims(ep=0)
    dims = ParallelDims(dp_shard=2, cp=2, ep=4, world_size=4)  # ep borrows dp_shard x cp
    assert dims.efsdp == 1 and dims.ep_enabled and dims.world_size == 4
    with pytest.raises(ConfigError, match=r"parallel.ep=2 must divide parallel.dp_shard=1 \(expert parallelism "):
        ParallelConfig.from_dict({"ep": 2})  # a run's ep borrows dp_shard (tests/e2e/test_moe_run.py runs it)
    with pytest.raises(ConfigError, match="parallel.ep=2 with parallel.tp=2"):
        ParallelConfig.from_dict({"dp_shard": 2, "tp": 2, "ep": 2})
    assert ParallelConfig.from_dict({"dp_shard": 2, "ep": 2}).ep == 2


def test_checkpoint_saved_on_ep_ranks_loads_on_one_process_and_back():
    """torch.distributed.checkpoint over EP: every expert comes from the one rank holding it, the dense tensors from
    their FSDP shards; an EP model loads one process's checkpoint (each rank its experts)."""
    results = distributed(2)
    ref = build("mixtral").state_dict()
    loaded = {k: torch.zeros_like(v) for k, v in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": loaded}, checkpoint_id=Path(checkpoint_dir()) / "from_ep2", no_dist=True)
    for name, t in ref.items():
        assert torch.equal(loaded[name], t), name
    want = dict(build("qwen2_moe_shared").named_parameters())
    held = set()
    for results_r in results:
        for name, t in results_r["checkpoint"].items():
            assert torch.equal(t, want[name]), name
            held.add(name)
    assert held == set(want)
