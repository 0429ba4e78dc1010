"""Pipeline parallelism against one process: the GRPO loss, every parameter's gradient, the global gradient
norm, and the forward-only token logprobs.

Two gloo ranks are launched once (cached) and run every schedule; the comparisons happen here against the
plain model in this process. The loss is the GRPO objective (clipped ratio, TIS, k3 KL, entropy bonus,
token-mean) over padded rows, in several micro-batches, each dividing by the GLOBAL token count: the
micro-batch losses sum to the single-process loss and their gradients to its gradient (fp32, REL).
The 4-rank compositions (pp 2 x FSDP 2, pp 2 x TP 2) are slow: one more launch.

Beside the numerics: the split by hand (which names on which rank), a sharded checkpoint saved on pp = 2 loaded
on one process and on pp = 2 again, and one saved on one process loaded on pp = 2 (bit for bit; a tied model's
lm_head copy too, which one process holds as the embedding itself), the weight-sync plan reading each tensor from
the pipeline rank that holds it, and the refusals.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from relayrl.algorithms import AlgoConfig, policy_objective
from relayrl.checkpoint import CheckpointError, load_distributed, save_distributed
from relayrl.errors import ConfigError
from relayrl.models.stage import merge_stages, split_model, stage_layers
from relayrl.parallel.config import PP_SCHEDULES, ParallelConfig
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.grad_norm import grad_norm
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.pipeline import SCHEDULES, Pipeline, TokenLoss, rank_stages
from relayrl.parallel.pipeline_stages import check_schedule, schedule_stages, stage_ids_this_rank
from relayrl.sync.layout import EngineLayout, TrainerLayout
from relayrl.sync.plan import plan_sync
from relayrl.trainer.logprobs import token_logprobs

from dist_harness import run_distributed
from helpers import perturbed_model, small_config

PP = 2
REL = 1e-5  # max |a - b| <= REL * max |b|, fp32
# with TP: TP alone (pp = 1) leaves qwen3's q_norm / k_norm grads 1.05e-5 off one process here (their per-head
# grads summed over the TP ranks in another order); pp x TP measured the same 1.05e-5, so the pipeline adds none
REL_TP = 2e-5
ALGO = AlgoConfig(kl_coef=0.05, entropy_coef=0.01, tis_cap=2.0)
CONFIGS = {
    "llama4": dict(num_hidden_layers=4),
    "llama8": dict(num_hidden_layers=8),
    "qwen3_tied5": dict(model_type="qwen3", num_hidden_layers=5, tie_word_embeddings=True, qk_norm=True,
                        qkv_bias=True),  # 5 layers: 3 + 2 over 2 stages
}
# name: (schedule, config, micro-batches[, activation checkpointing])
CASES = {name: (name, "llama4", 4) for name in SCHEDULES}
CASES |= {
    "1f1b_tied_uneven": ("1f1b", "qwen3_tied5", 4),
    "1f1b_ac": ("1f1b", "llama4", 4, True),  # activation checkpointing inside the stages
    "gpipe_m2": ("gpipe", "llama4", 2),
    "interleaved_1f1b_m8": ("interleaved_1f1b", "llama4", 8),
    "zbv_tied": ("zbv", "qwen3_tied5", 4),  # V placement: embed_tokens and lm_head both on rank 0
}


def batch():
    """ids [8, 12], right and left padding, a response mask, advantages, old / rollout / reference logprobs."""
    g = torch.Generator().manual_seed(7)
    B, T = 8, 12
    ids = torch.randint(0, 64, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 9:] = 0
    attn[3, :4] = 0  # left padding
    attn[4, 6:] = 0
    attn[6, 10:] = 0
    pos = torch.arange(T)[None].expand(B, T)
    mask = ((pos >= 5) & attn.bool()).float()
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).contiguous()
    old = -torch.rand(B, T, generator=g) * 4
    rollout = old + 0.2 * torch.randn(B, T, generator=g)
    ref = old + 0.3 * torch.randn(B, T, generator=g)
    return ids, attn, mask, adv, old, rollout, ref


def build(config: str):
    torch.manual_seed(0)
    return perturbed_model(small_config(**CONFIGS[config]))


def objective(rows, logp, ent, num_tokens=None, num_seqs=None):
    _, _, mask, adv, old, rollout, ref = batch()
    return policy_objective(logp, old[rows], adv[rows], mask[rows], ALGO, rollout_logp=rollout[rows],
                            ref_logp=ref[rows], entropy=ent, num_tokens=num_tokens, num_seqs=num_seqs)


@functools.cache
def reference(config: str):
    model = build(config)
    ids, attn, mask, *_ = batch()
    logp, ent = token_logprobs(model, ids, attn, with_entropy=True)
    loss, _ = objective(torch.arange(len(ids)), logp, ent)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}  # a tied weight once
    return loss.detach(), grads, logp.detach() * attn, grad_norm(p for _, p in model.named_parameters())


# ---------------------------------------------------------------- rank side
# ---------------------------------------------------------------- rank side
def _local(grad):
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _run(dims, mesh, schedule, config, m, rows=None, ac=False, vocab_parallel=False):
    pipe = Pipeline(split_model(build(config), *rank_stages(dims, schedule)), dims, schedule)
    for module in pipe.modules:
        parallelize_model(module, dims, mesh, gather_logits=not vocab_parallel, activation_checkpointing=ac)
    tp_group = dims.tp_mesh.get_group() if vocab_parallel else None  # logprobs from vocab-sharded logits
    ids, attn, mask, *_ = batch()
    rows = torch.arange(len(ids)) if rows is None else rows(dims)
    n_tok, n_seq = mask.sum(), float(len(ids))  # global counts: every data-parallel rank divides by them

    def mine(rows_mb, logp, ent):  # the pipeline's micro-batch rows index this rank's rows
        return objective(rows[rows_mb], logp, ent, num_tokens=n_tok, num_seqs=n_seq)

    loss = pipe.step(ids[rows], TokenLoss(ids[rows], mine, with_entropy=True, tp_group=tp_group), m,
                     attention_mask=attn[rows])
    grads = {n: _local(p.grad) for n, p in pipe.named_parameters()}
    norm = pipe.clip_grad_norm(float("inf"))
    # the weights before any step
    logp = pipe.logprobs(ids[rows], m, tp_group=tp_group, attention_mask=attn[rows]) * attn[rows]
    return dims.dp_rank, loss, grads, norm, rows, logp


def _errors(dims):
    """Refusals raised before any message is sent (every rank raises the same)."""
    out = {}
    ids, attn, *_ = batch()
    for name, schedule, m in (("dualpipev_m2", "dualpipev", 2), ("rows_8_m3", "1f1b", 3)):
        pipe = Pipeline(split_model(build("llama4"), *rank_stages(dims, schedule)), dims, schedule)
        try:
            pipe.step(ids, TokenLoss(ids, objective), m, attention_mask=attn)
        except ConfigError as e:
            out[name] = str(e)
    try:
        Pipeline(split_model(build("llama4"), (0,), 2), dims, "interleaved_1f1b")
    except ConfigError as e:
        out["wrong_stages"] = str(e)
    return out


def _rank(rank, world_size):
    dims = ParallelDims(pp=PP, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    out = {name: _run(dims, mesh, *spec[:3], ac=spec[3:] == (True,)) for name, spec in CASES.items()}
    out["errors"] = _errors(dims)
    return out


@functools.cache
def distributed():
    return run_distributed(_rank, PP, timeout=240.0)


# ---------------------------------------------------------------- checkpoints across pp degrees
CKPT_SCHEDULES = ("1f1b", "interleaved_1f1b")  # one stage per rank, and two (merged for the state dict)


def _trained(model_or_pipe, step_fn):
    """One GRPO step and one AdamW step; the full (gathered) model and optimizer state by name."""
    opt = torch.optim.AdamW(model_or_pipe.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)
    step_fn()
    opt.step()
    return opt


def _full_state(module, opt):
    msd, osd = get_state_dict(module, opt, options=StateDictOptions(full_state_dict=True))
    return ({n: t.detach().clone() for n, t in msd.items()},
            {n: {f: v.detach().clone() for f, v in st.items()} for n, st in osd["state"].items()})


def _pipeline_step(pipe):
    ids, attn, mask, *_ = batch()
    mine = functools.partial(objective, num_tokens=mask.sum(), num_seqs=float(len(ids)))
    pipe.step(ids, TokenLoss(ids, mine, with_entropy=True), 4, attention_mask=attn)


def _ckpt_rank(rank, world_size, root, pp1_ckpt):
    dims = ParallelDims(pp=PP, world_size=world_size)
    dims.build_mesh("cpu")
    out = {}
    for schedule in CKPT_SCHEDULES:
        pipe = Pipeline(split_model(build("llama4"), *rank_stages(dims, schedule)), dims, schedule)
        opt = _trained(pipe, lambda pipe=pipe: _pipeline_step(pipe))
        merged = merge_stages(pipe.modules)
        path = save_distributed(f"{root}/pp2_{schedule}", 1, merged, opt)
        # a pp = 1 checkpoint loaded onto this layout (other weights until loaded)
        loaded = [_ckpt_fresh(dims, schedule, p) for p in (pp1_ckpt, path)]
        out[schedule] = dict(path=str(path), saved=_full_state(merged, opt), loaded=loaded[0], resumed=loaded[1])
    return out


def _ckpt_fresh(dims, schedule, path, config="llama4"):
    """A pipeline of other weights and an AdamW of another lr, loaded from `path`: its full state and lr."""
    fresh = Pipeline(split_model(perturbed_model(small_config(**CONFIGS[config]), seed=3),
                                 *rank_stages(dims, schedule)), dims, schedule)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_distributed(path, merge_stages(fresh.modules), fresh_opt)
    return _full_state(merge_stages(fresh.modules), fresh_opt), fresh_opt.param_groups[0]["lr"]


def _half_rows(dims):  # data parallelism: dp rank d trains rows [4d, 4d + 4) of the 8
    return torch.arange(4) + 4 * dims.dp_rank


# name: (ParallelDims degrees (pp 2 unless given; ac: activation checkpointing; vocab_parallel: the loss on
# vocab-sharded logits), schedule, config, micro-batches);
# 4 ranks, one launch (slow)
COMPOSED = {
    "pp2_fsdp2_1f1b": (dict(dp_shard=2), "1f1b", "llama4", 2),
    "pp2_fsdp2_interleaved_tied": (dict(dp_shard=2), "interleaved_1f1b", "qwen3_tied5", 2),
    "pp2_tp2_gpipe": (dict(tp=2), "gpipe", "llama4", 4),
    "pp2_tp2_1f1b_vocab_parallel": (dict(tp=2, vocab_parallel=True), "1f1b", "llama4", 4),  # logits never gathered
    "pp2_tp2_zbv_tied": (dict(tp=2), "zbv", "qwen3_tied5", 4),
    "pp4_1f1b_tied": (dict(pp=4), "1f1b", "qwen3_tied5", 4),  # the tied copies on pp ranks 0 and 3: a pair group
    "pp4_interleaved_ac": (dict(pp=4, ac=True), "interleaved_1f1b", "llama8", 4),  # 8 stages, checkpointed layers
}


def _rank4(rank, world_size):
    meshes, out = {}, {}
    for name, (degrees, schedule, config, m) in COMPOSED.items():
        degrees = {"pp": PP, **degrees}
        ac, vocab_parallel = degrees.pop("ac", False), degrees.pop("vocab_parallel", False)
        key = tuple(sorted(degrees.items()))
        if key not in meshes:
            dims = ParallelDims(world_size=world_size, **degrees)
            meshes[key] = dims, dims.build_mesh("cpu")
        dims, mesh = meshes[key]
        out[name] = _run(dims, mesh, schedule, config, m, rows=_half_rows if dims.dp > 1 else None, ac=ac,
                         vocab_parallel=vocab_parallel)
    return out


@functools.cache
def composed():
    return run_distributed(_rank4, 4, timeout=300.0)


# ---------------------------------------------------------------- tests
def assert_close(a, b, what, rel=REL):
    err = (a - b).abs().max().item()
    assert err <= rel * b.abs().max().item(), f"{what}: max |diff| {err:.3g} vs max |ref| {b.abs().max():.3g}"


def _check(results, config, what, dp=1, rel=REL):
    """Every rank's gradients equal one process's; each pipeline holds every parameter; the pipelines'
    losses (one per data-parallel rank, the same on all its pp ranks) sum to the single-process loss."""
    ref_loss, ref_grads, ref_logp, ref_norm = reference(config)
    # tied: the last stage's lm_head.weight is its copy of embed_tokens.weight and takes the same gradient
    alias = {"lm_head.weight": "model.embed_tokens.weight"} if "lm_head.weight" not in ref_grads else {}
    held: dict[int, set] = {}
    losses: dict[int, torch.Tensor] = {}
    for rank, (dp_rank, loss, grads, norm, rows, logp) in enumerate(results):
        # the global gradient norm over all stages (clipping's), and the forward-only logprobs on every pp rank
        assert abs(norm - ref_norm) <= REL * ref_norm, (what, rank, norm, ref_norm)
        assert_close(logp, ref_logp[rows], f"{what} rank {rank} logprobs")
        for name, g in grads.items():
            assert_close(g, ref_grads[alias.get(name, name)], f"{what} rank {rank} grad {name}", rel)
        held.setdefault(dp_rank, set()).update(alias.get(n, n) for n in grads)
        losses.setdefault(dp_rank, loss)
        assert torch.equal(loss, losses[dp_rank]), f"{what}: every pp rank reports its pipeline's loss"
    for dp_rank, names in held.items():
        assert names == set(ref_grads), f"{what}: dp rank {dp_rank}'s pipeline holds {sorted(names)}"
    assert len(losses) == dp
    total = float(sum(losses.values()))
    assert abs(total - float(ref_loss)) <= REL * abs(float(ref_loss)), (what, total, float(ref_loss))


@pytest.mark.equivalence
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_equal_one_process(case):
    _check([r[case] for r in distributed()], CASES[case][1], case)


@pytest.mark.equivalence
@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMPOSED))
def test_composes_with_fsdp_and_tp(case):
    degrees, _, config, _ = COMPOSED[case]
    _check([r[case] for r in composed()], config, case, dp=2 if "dp_shard" in degrees else 1,
           rel=REL_TP if "tp" in degrees else REL)


@pytest.mark.equivalence
def test_checkpoint_saved_on_one_pp_degree_loads_on_another(tmp_path):
    """pp = 1 → pp = 2 (one stage per rank, and two), pp = 2 → pp = 2 (resume) and pp = 2 → pp = 1: model and AdamW
    state by name, bit for bit, and the checkpoint's lr on every rank (a tied model: the tests below)."""
    model = build("llama4")
    ids, attn, *_ = batch()

    def single_step():
        logp, ent = token_logprobs(model, ids, attn, with_entropy=True)
        objective(torch.arange(len(ids)), logp, ent)[0].backward()

    opt = _trained(model, single_step)
    pp1 = save_distributed(tmp_path / "pp1", 1, model, opt)
    params1, optim1 = _full_state(model, opt)
    results = run_distributed(_ckpt_rank, PP, str(tmp_path), str(pp1), timeout=240.0)
    for schedule in CKPT_SCHEDULES:
        held = set()
        for rank, r in enumerate(results):
            (params, optim), lr = r[schedule]["loaded"]  # pp 1 → this rank's stages
            held |= set(params)
            assert lr == 1e-2, (schedule, rank, lr)
            assert optim.keys() == params.keys()
            for n, t in params.items():
                assert torch.equal(t, params1[n]), (schedule, rank, n)
                for f, v in optim[n].items():
                    assert torch.equal(v, optim1[n][f]), (schedule, rank, n, f)
        assert held == set(params1)
        for rank, r in enumerate(results):  # pp 2 → pp 2: every rank's state as it saved it, and the lr
            (params, optim), lr = r[schedule]["resumed"]
            saved_params, saved_optim = r[schedule]["saved"]
            assert params.keys() == saved_params.keys() and lr == 1e-2, (schedule, rank, lr)
            for n, t in params.items():
                assert torch.equal(t, saved_params[n]), (schedule, rank, n)
                assert all(torch.equal(v, saved_optim[n][f]) for f, v in optim[n].items()), (schedule, rank, n)
        # pp 2 → one process: every tensor as the rank that held it had it
        single = perturbed_model(small_config(**CONFIGS["llama4"]), seed=3)
        single_opt = torch.optim.AdamW(single.parameters(), lr=1e-2)
        load_distributed(results[0][schedule]["path"], single, single_opt)
        params, optim = _full_state(single, single_opt)
        saved = [r[schedule]["saved"] for r in results]
        for n, t in params.items():
            (p_r, o_r), = [(p, o) for p, o in saved if n in p]
            assert torch.equal(t, p_r[n]), (schedule, n)
            assert all(torch.equal(v, o_r[n][f]) for f, v in optim[n].items()), (schedule, n)
        # and the pipeline's step is the single process's (to Adam's rounding of equal-to-1e-5 gradients)
        for n, t in params.items():
            assert (t - params1[n]).abs().max() <= 1e-4, (schedule, n)


# ---------------------------------------------------------------- a tied model's checkpoints across pp degrees
# One process holds the tied weight once (`model.embed_tokens.weight`, which `lm_head.weight` is) with one AdamW
# state; at pp = 2 the last stage holds its own copy as `lm_head.weight`, with its own state: on the other rank
# (1f1b, interleaved_1f1b) or on the same one (zbv's V placement). A pp = 1 checkpoint gives the copy the
# embedding's weight and state; a pp = 2 one loads into one process (the copy's entries redundant) and into pp = 2
# again (resume), also under the other placement of the copies.
TIED = "qwen3_tied5"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TIED_CKPT_SCHEDULES = ("1f1b", "interleaved_1f1b", "zbv")
HEAD_RANK = {"1f1b": 1, "interleaved_1f1b": 1, "zbv": 0}  # the pp rank holding the lm_head copy (embed: rank 0)


def _canonical(name: str) -> str:
    return EMBED if name == HEAD else name


def _tied_rank(rank, world_size, root, pp1_ckpt):
    dims = ParallelDims(pp=PP, world_size=world_size)
    dims.build_mesh("cpu")
    out = {}
    for schedule in TIED_CKPT_SCHEDULES:
        pipe = Pipeline(split_model(build(TIED), *rank_stages(dims, schedule)), dims, schedule)
        opt = _trained(pipe, lambda pipe=pipe: _pipeline_step(pipe))
        merged = merge_stages(pipe.modules)
        path = save_distributed(f"{root}/pp2_{schedule}", 1, merged, opt)
        out[schedule] = dict(path=str(path), saved=_full_state(merged, opt),
                             from_pp1=_ckpt_fresh(dims, schedule, pp1_ckpt, TIED),  # pp 1 → pp 2
                             resumed=_ckpt_fresh(dims, schedule, path, TIED))  # pp 2 → pp 2, same schedule
    # the copies on two ranks → both on rank 0, and back
    out["1f1b->zbv"] = _ckpt_fresh(dims, "zbv", out["1f1b"]["path"], TIED)
    out["zbv->1f1b"] = _ckpt_fresh(dims, "1f1b", out["zbv"]["path"], TIED)
    return out


@functools.cache
def _tied_pp1():
    """The one-process model and its AdamW after one GRPO step (the tied weight: one parameter, one state)."""
    model = build(TIED)
    ids, attn, *_ = batch()

    def single_step():
        logp, ent = token_logprobs(model, ids, attn, with_entropy=True)
        objective(torch.arange(len(ids)), logp, ent)[0].backward()

    opt = _trained(model, single_step)
    return model, opt


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    model, opt = _tied_pp1()
    pp1 = save_distributed(root / "pp1", 1, model, opt)
    return _full_state(model, opt), run_distributed(_tied_rank, PP, str(root), str(pp1), timeout=240.0)


def _assert_state_equal(state, ref, what, one_process=False):
    """Every tensor of `state` (params, optim) equals ref's under its canonical name when ref lacks its own."""
    params, optim = state
    ref_params, ref_optim = ref
    # every parameter has AdamW state, a pipeline's copy included; one process: the tied weight once
    assert optim.keys() == params.keys() - ({HEAD} if one_process else set()), what
    for n, t in params.items():
        assert torch.equal(t, ref_params[n if n in ref_params else _canonical(n)]), (what, n)
        if n not in optim:
            continue
        ref_state = ref_optim[n if n in ref_optim else _canonical(n)]
        assert optim[n].keys() == ref_state.keys() == {"exp_avg", "exp_avg_sq", "step"}, (what, n)
        for f, v in optim[n].items():
            assert torch.equal(v, ref_state[f]), (what, n, f)


def _merged_saved(results, key):
    """One name → tensor view over the ranks' saved states; a tensor two ranks both hold must agree."""
    params, optim = {}, {}
    for r in results:
        p, o = r[key]["saved"]
        for n, t in p.items():
            assert n not in params or torch.equal(params[n], t), (key, n)
        params |= p
        optim |= o
    return params, optim


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule", TIED_CKPT_SCHEDULES)
def test_tied_pp1_checkpoint_loads_on_pp2(tied_runs, schedule):
    """pp 1 → pp 2: each rank's tensors are the one process's; the lm_head copy takes the embedding's weight and
    AdamW state (exp_avg, exp_avg_sq, step), on the rank the schedule puts it; lr comes from the checkpoint."""
    (params1, optim1), results = tied_runs
    assert HEAD not in optim1 and EMBED in optim1  # one process: one state for the tied weight
    held = set()
    for rank, r in enumerate(results):
        state, lr = r[schedule]["from_pp1"]
        assert (HEAD in state[0]) == (rank == HEAD_RANK[schedule]), (schedule, rank)
        assert (EMBED in state[0]) == (rank == 0), (schedule, rank)
        _assert_state_equal(state, (params1, optim1), f"{schedule} rank {rank} from pp1")
        assert lr == 1e-2, (schedule, rank, lr)
        held |= set(state[0])
    assert held == set(params1)


@pytest.mark.equivalence
@pytest.mark.parametrize("schedule", TIED_CKPT_SCHEDULES)
def test_tied_pp2_checkpoint_resumes_and_loads_on_pp1(tied_runs, schedule):
    """pp 2 → pp 2 (resume): every rank's state as saved; pp 2 → one process: the tied weight and its state as
    the pipeline had them (its two copies equal, so the copy's entries are redundant)."""
    (params1, _), results = tied_runs
    for rank, r in enumerate(results):
        state, lr = r[schedule]["resumed"]
        _assert_state_equal(state, r[schedule]["saved"], f"{schedule} rank {rank} resumed")
        assert lr == 1e-2, (schedule, rank, lr)
    saved_params, saved_optim = _merged_saved(results, schedule)
    # the pipeline kept its copies equal (their gradients summed), and stepped as one process did
    assert torch.equal(saved_params[HEAD], saved_params[EMBED])
    assert all(torch.equal(v, saved_optim[EMBED][f]) for f, v in saved_optim[HEAD].items())
    for n, t in saved_params.items():
        assert (t - params1[n]).abs().max() <= 1e-4, (schedule, n)

    single = perturbed_model(small_config(**CONFIGS[TIED]), seed=3)
    single_opt = torch.optim.AdamW(single.parameters(), lr=1e-3)
    load_distributed(results[0][schedule]["path"], single, single_opt)
    assert single.lm_head.weight is single.model.embed_tokens.weight  # still tied
    params, optim = _full_state(single, single_opt)
    _assert_state_equal((params, optim), (saved_params, saved_optim), f"{schedule} to pp1", one_process=True)
    assert single_opt.param_groups[0]["lr"] == 1e-2


@pytest.mark.equivalence
@pytest.mark.parametrize("case", ["1f1b->zbv", "zbv->1f1b"])
def test_tied_checkpoint_moves_between_placements(tied_runs, case):
    """The copies on two ranks (1f1b) → both on rank 0 (zbv), and back: every tensor as saved, by name."""
    _, results = tied_runs
    saved = _merged_saved(results, case.split("->")[0])
    for rank, r in enumerate(results):
        _assert_state_equal(r[case][0], saved, f"{case} rank {rank}")


# pp 2 x FSDP 2 / TP 2 (4 ranks, slow): the copy's reads as DTensor shards, on its own rank and beside the embedding
TIED_COMPOSED = {"fsdp2_zbv": (dict(dp_shard=2), "zbv"), "tp2_1f1b": (dict(tp=2), "1f1b")}


def _tied_parallel(dims, mesh, schedule, seed):
    pipe = Pipeline(split_model(perturbed_model(small_config(**CONFIGS[TIED]), seed=seed),
                                *rank_stages(dims, schedule)), dims, schedule)
    for module in pipe.modules:
        parallelize_model(module, dims, mesh, gather_logits=True)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3)


def _tied_rank4(rank, world_size, root, pp1_ckpt):
    out = {}
    for name, (degrees, schedule) in TIED_COMPOSED.items():
        dims = ParallelDims(pp=PP, world_size=world_size, **degrees)
        mesh = dims.build_mesh("cpu")
        pipe, opt = _tied_parallel(dims, mesh, schedule, seed=3)
        load_distributed(pp1_ckpt, merge_stages(pipe.modules), opt)  # pp 1 → pp 2 x (FSDP | TP)
        loaded = _full_state(merge_stages(pipe.modules), opt)
        opt.zero_grad()
        _pipeline_step(pipe)  # every dp rank the same rows
        opt.step()
        path = save_distributed(f"{root}/{name}", 1, merge_stages(pipe.modules), opt)
        resumed, resumed_opt = _tied_parallel(dims, mesh, schedule, seed=4)
        load_distributed(path, merge_stages(resumed.modules), resumed_opt)  # and again on this layout
        out[name] = dict(loaded=loaded, saved=_full_state(merge_stages(pipe.modules), opt),
                         resumed=_full_state(merge_stages(resumed.modules), resumed_opt))
    return out


@pytest.mark.equivalence
@pytest.mark.slow
def test_tied_checkpoint_composes_with_fsdp_and_tp(tmp_path):
    """pp 1 → pp 2 x FSDP 2 (zbv: the copy beside the embedding) and pp 2 x TP 2 (1f1b), then a resume on that
    layout: every rank's full tensors as one process's / as saved, bit for bit."""
    model, opt = _tied_pp1()
    pp1 = save_distributed(tmp_path / "pp1", 1, model, opt)
    ref = _full_state(model, opt)
    results = run_distributed(_tied_rank4, 4, str(tmp_path), str(pp1), timeout=300.0)
    for name in TIED_COMPOSED:
        held = set()
        for rank, r in enumerate(results):
            _assert_state_equal(r[name]["loaded"], ref, f"{name} rank {rank} from pp1")
            _assert_state_equal(r[name]["resumed"], r[name]["saved"], f"{name} rank {rank} resumed")
            held |= set(r[name]["loaded"][0])
        assert held == set(ref[0]), name


@pytest.mark.unit
def test_tied_checkpoint_into_untied_model_is_one_error(tmp_path):
    """A tied model's checkpoint (one state for both names) into an untied model: one CheckpointError line."""
    model, opt = _tied_pp1()
    path = save_distributed(tmp_path, 1, model, opt)
    untied = perturbed_model(small_config(**{**CONFIGS[TIED], "tie_word_embeddings": False}))
    with pytest.raises(CheckpointError, match="tie_word_embeddings") as e:
        load_distributed(path, untied, torch.optim.AdamW(untied.parameters()))
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_missing_optimizer_state_is_one_error(tmp_path):
    """Optimizer state the checkpoint lacks: one CheckpointError naming it (saved with SGD, loaded with AdamW: the
    hyperparameters; saved before a parameter trained: its state)."""
    model = perturbed_model(small_config(**CONFIGS["llama4"]))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "model.norm.weight"])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    adamw.step()
    sgd_ckpt = save_distributed(tmp_path / "sgd", 1, model, sgd)
    adamw_ckpt = save_distributed(tmp_path / "adamw", 1, model, adamw)
    model.zero_grad(set_to_none=True)
    for path, match in ((sgd_ckpt, r"no \['amsgrad', 'betas', .*\] for optimizer param group 0"),
                        (adamw_ckpt, r"no optimizer state '\w+' for 'model.norm.weight'")):
        with pytest.raises(CheckpointError, match=match) as e:
            load_distributed(path, model, torch.optim.AdamW(model.parameters()))
        assert "\n" not in str(e.value)


@pytest.mark.unit
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b", "zbv"])
def test_sync_plan_reads_each_tensor_from_the_stage_holding_it(schedule):
    """pp 2 x dp_shard 2 trainer → engine TP 2: every transfer reads a tensor its source rank's stage modules hold
    (split as the pipeline splits), in a box of that tensor; each engine rank receives exactly its shard."""
    cfg = small_config(**CONFIGS["qwen3_tied5"])
    layout = TrainerLayout(pp=PP, dp_shard=2, pp_schedule=schedule)
    plan = plan_sync(cfg, layout, EngineLayout(tp=2))
    model = perturbed_model(cfg)
    held = {q: dict(merge_stages(split_model(model, *schedule_stages(schedule, q, PP))).named_parameters())
            for q in range(PP)}
    for t in plan.transfers:
        tensors = held[layout.pp_rank(t.src_rank)]
        assert t.name in tensors, (t.name, t.src_rank)
        assert all(o + n <= d for o, n, d in zip(t.logical.offset, t.shape, tensors[t.name].shape, strict=True))
    for dst, shapes in enumerate(plan.param_shapes):
        got = sum(math.prod(t.shape) for t in plan.transfers if t.dst_rank == dst)
        assert got == sum(math.prod(shp) for _, shp in shapes)  # bytes per engine rank = its shard (ratio 1.00)
    # the last layer and the norm come from the pp rank holding the last stage: 1 (loop), 0 (V)
    last = ("model.layers.4.", "model.norm")
    sources = {layout.pp_rank(t.src_rank) for t in plan.transfers if t.name.startswith(last)}
    assert sources == {0 if schedule == "zbv" else 1}
    # by hand for 1f1b: layers 0-2 and embed_tokens from pp rank 0, layers 3-4 and the norm from pp rank 1
    if schedule == "1f1b":
        assert {t.name.split(".")[2] for t in plan.transfers if layout.pp_rank(t.src_rank) == 1
                and t.name.startswith("model.layers.")} == {"3", "4"}


def _held(stages):
    """Parameter names of stages, layers shown by their q_proj only."""
    return sorted(n for s in stages for n, _ in s.named_parameters() if "layers" not in n or "q_proj.w" in n)


@pytest.mark.unit
def test_split_by_hand():
    model = build("llama4")
    q = "model.layers.{}.self_attn.q_proj.weight".format
    # 1f1b, pp 2: rank 0 holds embed_tokens + layers 0, 1; rank 1 layers 2, 3 + norm + lm_head
    assert stage_ids_this_rank(0, 2, 1) == (0,) and stage_ids_this_rank(1, 2, 1) == (1,)
    r0, r1 = split_model(model, (0,), 2), split_model(model, (1,), 2)
    assert _held(r0) == ["model.embed_tokens.weight", q(0), q(1)]
    assert _held(r1) == ["lm_head.weight", q(2), q(3), "model.norm.weight"]
    # the stage modules take the model's own parameters, under the model's names
    full = dict(model.named_parameters())
    assert all(p is full[n] for s in r0 + r1 for n, p in s.named_parameters())
    assert sorted([*r0[0].state_dict(), *r1[0].state_dict()]) == sorted(model.state_dict())
    # interleaved (loop placement): rank 0 holds stages 0 and 2 of 4 (layers 0 and 2), rank 1 stages 1 and 3
    assert stage_ids_this_rank(0, 2, 2) == (0, 2) and stage_ids_this_rank(1, 2, 2) == (1, 3)
    assert _held(split_model(model, (0, 2), 4)) == ["model.embed_tokens.weight", q(0), q(2)]
    # V placement: rank 0 holds the first and the last stage
    assert stage_ids_this_rank(0, 2, 2, "v") == (0, 3) and stage_ids_this_rank(1, 2, 2, "v") == (1, 2)
    assert _held(split_model(model, (0, 3), 4)) == ["lm_head.weight", "model.embed_tokens.weight", q(0), q(3),
                                                    "model.norm.weight"]
    # tied: the last stage holds its own copy of embed_tokens.weight as lm_head.weight (the pipeline sums their grads)
    tied = build("qwen3_tied5")
    first, last = split_model(tied, (0, 1), 2)
    assert last.lm_head.weight is not first.model.embed_tokens.weight is tied.model.embed_tokens.weight
    assert torch.equal(last.lm_head.weight, tied.lm_head.weight)
    # uneven: the first (L % S) stages take one more layer (the planner's split)
    assert [list(stage_layers(3, 2, s)) for s in range(2)] == [[0, 1], [2]]
    assert [list(stage_layers(10, 4, s)) for s in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


@pytest.mark.equivalence
def test_stages_chained_give_the_models_logits():
    """Each stage builds its mask and rotary tables from the keyword inputs; chained they are the model."""
    model = build("qwen3_tied5")
    ids, attn, *_ = batch()
    h = ids
    for stage in split_model(model, (0, 1, 2), 3):  # 2 + 2 + 1 layers
        h = stage(h, attention_mask=attn)
    assert torch.equal(h, model(ids, attention_mask=attn))


@pytest.mark.equivalence
def test_stages_pass_packed_rows_through():
    """segment_ids / position_ids reach every stage: packed rows chained through stages equal the model."""
    model = build("llama4")
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    seg = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    pos = torch.tensor([list(range(4)) + list(range(6)), list(range(7)) + list(range(3))])
    h = ids
    for stage in split_model(model, (0, 1), 2):
        h = stage(h, position_ids=pos, segment_ids=seg)
    assert torch.equal(h, model(ids, position_ids=pos, segment_ids=seg))


@pytest.mark.equivalence
def test_refusals_on_ranks():
    for rank, results in enumerate(distributed()):
        errors = results["errors"]
        assert errors["dualpipev_m2"] == ("pipeline schedule dualpipev with 2 micro-batches: DualPipeV requires at "
                                          "least as many microbatches as stages, but got 2 microbatches and 4 stages.")
        assert errors["rows_8_m3"].startswith("8 rows do not split into 3 equal micro-batches")
        expected = [0, 2] if rank == 0 else [1, 3]
        assert errors["wrong_stages"] == (f"schedule interleaved_1f1b on pp rank {rank} runs stages {expected}, got "
                                          f"modules of stages [0]")


@pytest.mark.unit
def test_refusals():
    assert tuple(SCHEDULES) == PP_SCHEDULES  # the config's names are the schedules there are
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zb'; choose one of gpipe, 1f1b"):
        check_schedule("zb")
    with pytest.raises(ConfigError, match="pp_schedule: .*unknown pipeline schedule .ZB1P."):
        ParallelConfig.from_dict({"pp_schedule": "ZB1P"})
    assert ParallelConfig.from_dict({"pp": 2}).world_size == 2  # runs take it (tests/e2e/test_pipeline_run.py)
    assert ParallelConfig.from_dict({"pp_schedule": "zbv"}).pp_schedule == "zbv"
    with pytest.raises(ConfigError, match="5 pipeline stages for 4 decoder layers"):
        split_model(build("llama4"), (0,), 5)
    with pytest.raises(ConfigError, match=r"pp \(2\) x dp_replicate \(1\) x dp_shard \(1\) x tp \(1\) = 2, but"):
        ParallelDims(pp=2, world_size=4)
    dims = ParallelDims(pp=2, dp_shard=-1, tp=2, world_size=8)
    assert dims.dp_shard == 2 and dims.pp_enabled and dims.dp == 2
