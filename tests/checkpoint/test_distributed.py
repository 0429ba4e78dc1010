"""Sharded checkpoints: saved by 4 ranks (FSDP 4), resumed by 2 (FSDP 2, TP 2) and by one plain
process; the write is atomic across ranks; the export is a Hugging Face directory transformers loads.

    world 4 (FSDP 4): 2 AdamW steps, save after each, gather the full state, take step 3  ─┐
    world 2: load into FSDP 2, gather, step 3;  load into TP 2, gather, step 3;             │ compared
             save from TP 2, then a save whose rank 0 fails before the rename               │ here
    this process: load into a plain model, step 3; export → transformers                   ─┘

Resumed state must equal the saved state exactly (it is copied, never recomputed); the step after
the resume must match the step the world-4 run took without stopping (a different layout sums in
a different order, hence a 1e-5 scale-relative tolerance, as in tests/parallel/test_parallelize.py). The loss divides
by the GLOBAL token count, so the data-parallel ranks' losses sum to the full-batch loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from relayrl.algorithms.aggregation import token_mean
from relayrl.checkpoint import (
    capture_rng_state,
    export_hf,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_distributed,
    read_meta,
    restore_rng_state,
    save_checkpoint,
    save_distributed,
)
from relayrl.checkpoint import layout as ckpt_layout  # where both writers fsync and rename (publish)
from relayrl.errors import ModelDirError, UserError
from relayrl.models import CausalLM, ModelConfig, load_pretrained, save_pretrained
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.parallel.vocab_parallel import vocab_parallel_logprobs

from dist_harness import run_distributed
from helpers import perturbed_model, small_config

REL = 1e-5
LR = 1e-2
OPTIM_FIELDS = ("step", "exp_avg", "exp_avg_sq")


def tiny_config(**kw) -> ModelConfig:
    return small_config(**kw)


def build_model(seed: int) -> CausalLM:
    return perturbed_model(small_config(), seed)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-3, weight_decay=0.1)


def global_batch():
    """8 rows of 10 tokens, right padding; loss on the tokens after a per-row prompt."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (8, 10), generator=g)
    lengths = torch.tensor([10, 7, 10, 5, 9, 10, 6, 8])
    prompts = torch.tensor([3, 2, 4, 1, 3, 5, 2, 2])
    pos = torch.arange(10)[None]
    attn = (pos < lengths[:, None]).long()
    loss_mask = ((pos >= prompts[:, None]) & (pos < lengths[:, None])).float()
    return ids, attn, loss_mask


def local_batch(dims: ParallelDims | None):
    """This rank's rows, and the global token count (local counts summed over data-parallel ranks)."""
    ids, attn, loss_mask = global_batch()
    if dims is not None:
        rows = ids.shape[0] // dims.dp
        mine = slice(dims.dp_rank * rows, (dims.dp_rank + 1) * rows)
        ids, attn, loss_mask = ids[mine], attn[mine], loss_mask[mine]
    num_tokens = loss_mask[:, 1:].sum()
    if dims is not None:
        dist.all_reduce(num_tokens, group=dims.dp_mesh.get_group())
    return ids, attn, loss_mask, num_tokens


def train_step(model, opt, dims: ParallelDims | None, batch) -> torch.Tensor:
    ids, attn, loss_mask, num_tokens = batch
    opt.zero_grad()
    logits = model(ids, attention_mask=attn)
    if dims is not None and dims.tp > 1:
        logp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], dims.tp_mesh.get_group())
    else:
        logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = token_mean(-logp, loss_mask[:, 1:], num_tokens=num_tokens)
    loss.backward()
    opt.step()
    return loss.detach()


def full_state(model, opt):
    """Full (gathered) parameters, and exp_avg / exp_avg_sq / step per parameter name."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    params = {n: t.detach().clone() for n, t in msd.items()}
    optim = {n: {f: s[f].detach().clone() for f in OPTIM_FIELDS} for n, s in osd["state"].items()}
    return params, optim


def full_params(model):
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {n: t.detach().clone() for n, t in sd.items()}


# ---------------------------------------------------------------- rank side


def _save_on_fsdp4(rank, world_size, run_dir, model_dir):
    dims = ParallelDims(dp_shard=4, world_size=world_size)
    model = parallelize_model(build_model(seed=0), dims, dims.build_mesh("cpu"))
    opt = adamw(model)
    batch = local_batch(dims)
    for step in (1, 2):
        train_step(model, opt, dims, batch)
        extra = {"step": step, "sampler": {"epoch": 0, "position": 8 * step}, "rank": rank,
                 "rng": capture_rng_state()}
        save_distributed(run_dir, step, model, opt, extra, meta={"model_dir": model_dir})
    params, optim = full_state(model, opt)
    loss = train_step(model, opt, dims, batch)  # the run that never stopped: its step 3
    next_weights = full_params(model)  # collective: every rank gathers
    out = {"loss": loss, "tp_rank": 0}
    if rank == 0:
        out.update(params=params, optim=optim, next_weights=next_weights)
    return out


def _resume(world_size, degrees, ckpt):
    dims = ParallelDims(**degrees, world_size=world_size)
    mesh = dims.build_mesh("cpu")
    model = parallelize_model(build_model(seed=7), dims, mesh)  # different weights until loaded
    opt = adamw(model)
    extra = load_distributed(ckpt, model, opt)
    params, optim = full_state(model, opt)
    loss = train_step(model, opt, dims, local_batch(dims))
    out = dict(extra=extra, params=params, optim=optim, loss=loss, tp_rank=mesh["tp"].get_local_rank(),
               next_weights=full_params(model))
    return out, model, opt


def _failing_fsync(path):
    if path.name.startswith(".tmp_"):  # every shard, extra.*, meta.json, COMPLETE are written by now
        raise OSError("injected: power cut before the rename")
    _REAL_FSYNC_DIR(path)


_REAL_FSYNC_DIR = ckpt_layout.fsync_dir


def _resume_on_2(rank, world_size, ckpt, run_dir):
    results = {"fsdp2": _resume(world_size, {"dp_shard": 2}, ckpt)[0]}
    results["tp2"], model, opt = _resume(world_size, {"tp": 2}, ckpt)
    # a save from the TP layout (step 3 taken), then one that fails on rank 0 before the rename
    save_distributed(run_dir, 3, model, opt, {"step": 3})
    ckpt_layout.fsync_dir = _failing_fsync
    try:
        save_distributed(run_dir, 4, model, opt, {"step": 4})
        results["crash"] = "no error"
    except Exception as e:  # the test checks what each rank saw
        results["crash"] = f"{type(e).__name__}: {e}"
    finally:
        ckpt_layout.fsync_dir = _REAL_FSYNC_DIR
    return results


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The world-4 run: its run dir, base model dir, and rank results."""
    from relayrl.models.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("ckpt_dist")
    tok_dir = root / "tok"
    build_char_tokenizer(tok_dir, "0123456789+-= ", "llama")
    model_dir = save_pretrained(build_model(seed=0), root / "base", tokenizer_dir=tok_dir)
    run_dir = root / "run"
    ranks = run_distributed(_save_on_fsdp4, 4, str(run_dir), str(model_dir), timeout=90)
    return dict(run_dir=run_dir, model_dir=model_dir, ranks=ranks, ref=ranks[0], root=root)


@pytest.fixture(scope="module")
def resumed(saved):
    ckpt = latest_checkpoint(saved["run_dir"])
    run_dir2 = saved["root"] / "run2"
    ranks = run_distributed(_resume_on_2, 2, str(ckpt), str(run_dir2), timeout=90)
    return dict(ranks=ranks, run_dir=run_dir2)


# ---------------------------------------------------------------- comparisons


def assert_close_scaled(actual, expected, what):
    scale = float(expected.abs().max()) or 1.0
    err = float((actual - expected).abs().max())
    assert err <= REL * scale, f"{what}: max abs error {err:.3g} > {REL:g} x scale {scale:.3g}"


def assert_same_state(params, optim, ref, what):
    assert params.keys() == ref["params"].keys(), what
    for n, t in ref["params"].items():
        assert torch.equal(params[n], t), f"{what}: parameter {n} differs from the saved one"
    assert optim.keys() == ref["optim"].keys(), what
    for n, fields in ref["optim"].items():
        for f, t in fields.items():
            assert torch.equal(optim[n][f], t), f"{what}: optimizer {f} of {n} differs from the saved one"


def assert_continues(loss_parts, weights, ref, what):
    """The resumed step 3 equals the never-stopped run's: summed loss and updated weights."""
    assert_close_scaled(torch.stack(loss_parts).sum(), torch.stack([r["loss"] for r in ref]).sum(), f"{what}: loss")
    for n, w in ref[0]["next_weights"].items():
        assert_close_scaled(weights[n], w, f"{what}: {n} after the resumed step")


# ---------------------------------------------------------------- tests


@pytest.mark.equivalence
def test_fsdp4_save_is_complete_and_sharded(saved):
    ckpts = list_checkpoints(saved["run_dir"])
    assert [p.name for p in ckpts] == ["step_00000001", "step_00000002"]
    files = {p.name for p in ckpts[-1].iterdir()}
    data_files = {".metadata", "extra.json", "extra.safetensors", "meta.json", "COMPLETE"}
    assert {f"__{r}_0.distcp" for r in range(4)} | data_files == files
    meta = read_meta(ckpts[-1])
    assert meta["step"] == 2 and meta["world_size"] == 4 and meta["model_dir"] == str(saved["model_dir"])
    assert not [p for p in (saved["run_dir"] / "checkpoints").iterdir() if p.name.startswith(".")]
    # io.load_checkpoint reads the extra entry too
    assert load_checkpoint(ckpts[-1], names=["extra"])[0]["extra"]["step"] == 2


@pytest.mark.equivalence
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_resume_on_two_ranks(saved, resumed, layout):
    parts = [r[layout] for r in resumed["ranks"]]
    for rank, r in enumerate(parts):
        assert r["extra"]["step"] == 2 and r["extra"]["sampler"] == {"epoch": 0, "position": 16}
        assert r["extra"]["rank"] == 0  # rank 0's extra, on every rank
        assert_same_state(r["params"], r["optim"], saved["ref"], f"{layout} rank {rank}")
        assert_continues([p["loss"] for p in parts if p["tp_rank"] == 0], r["next_weights"], saved["ranks"],
                         f"{layout} rank {rank}")


@pytest.mark.equivalence
def test_resume_in_one_plain_process(saved):
    model = build_model(seed=7)
    opt = adamw(model)
    extra = load_distributed(latest_checkpoint(saved["run_dir"]), model, opt)
    assert extra["step"] == 2 and extra["rank"] == 0
    restore_rng_state(extra["rng"])
    assert_same_state(*full_state(model, opt), saved["ref"], "plain process")
    loss = train_step(model, opt, None, local_batch(None))
    assert_continues([loss], full_params(model), saved["ranks"], "plain process")


@pytest.mark.equivalence
def test_tp_save_loads_in_plain_process(resumed):
    model = build_model(seed=9)
    extra = load_distributed(latest_checkpoint(resumed["run_dir"]), model)  # model only, no optimizer
    assert extra == {"step": 3}
    tp = resumed["ranks"][0]["tp2"]["next_weights"]
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), tp[n]), n


@pytest.mark.faults
def test_failed_save_on_rank0_raises_everywhere_and_keeps_previous(resumed):
    seen = [r["crash"] for r in resumed["ranks"]]
    assert seen[0] == "OSError: injected: power cut before the rename"
    assert seen[1].startswith("RuntimeError: checkpoint write failed on rank 0: OSError: injected")
    assert latest_checkpoint(resumed["run_dir"]).name == "step_00000003"
    assert sorted(p.name for p in (resumed["run_dir"] / "checkpoints").iterdir()) == ["step_00000003"]


@pytest.mark.equivalence
def test_export_loads_in_transformers(saved, tmp_path):
    import transformers

    ckpt = latest_checkpoint(saved["run_dir"])
    out = export_hf(ckpt, tmp_path / "hf")  # the base model dir comes from meta.json
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    ours = load_pretrained(out)
    for n, p in ours.named_parameters():
        assert torch.equal(p.detach(), saved["ref"]["params"][n]), n
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, attn, _ = global_batch()
    real = attn.bool()  # padded slots hold whatever each implementation computes there
    with torch.no_grad():
        torch.testing.assert_close(hf(ids, attention_mask=attn).logits[real], ours(ids, attention_mask=attn)[real],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="already exists"):
        export_hf(ckpt, out)


@pytest.mark.equivalence
def test_export_needs_a_model_dir(resumed, saved, tmp_path):
    ckpt = latest_checkpoint(resumed["run_dir"])  # saved without meta["model_dir"]
    with pytest.raises(UserError, match="--model-dir"):
        export_hf(ckpt, tmp_path / "a")
    with pytest.raises(ModelDirError):
        export_hf(ckpt, tmp_path / "a", model_dir=tmp_path / "missing")
    out = export_hf(ckpt, tmp_path / "b", model_dir=saved["model_dir"])
    tp = resumed["ranks"][0]["tp2"]["next_weights"]
    for n, p in load_pretrained(out).named_parameters():
        assert torch.equal(p.detach(), tp[n]), n


# ---------------------------------------------------------------- single process, no process group


def _trained(seed=0):
    model = build_model(seed)
    opt = adamw(model)
    train_step(model, opt, None, local_batch(None))
    return model, opt


@pytest.mark.unit
def test_single_process_crash_before_rename_keeps_previous(tmp_path, monkeypatch):
    model, opt = _trained()
    good = save_distributed(tmp_path, 1, model, opt, {"step": 1})
    monkeypatch.setattr(ckpt_layout, "fsync_dir", _failing_fsync)
    with pytest.raises(OSError, match="injected"):
        save_distributed(tmp_path, 2, model, opt, {"step": 2})
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [good.name]

    # a hard kill leaves the temp dir (even with COMPLETE inside): never listed, removed by the next save
    leftover = tmp_path / "checkpoints" / ".tmp_step_00000002"
    leftover.mkdir()
    (leftover / "COMPLETE").touch()
    (leftover / "meta.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == good
    save_distributed(tmp_path, 2, model, opt, {"step": 2}, keep_last=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000002"]


@pytest.mark.unit
def test_non_data_extra_fails_before_any_shard(tmp_path):
    model, opt = _trained()
    with pytest.raises(TypeError, match=r"^extra\['sched'\]\['fn'\]: cannot store a builtins.function"):
        save_distributed(tmp_path, 1, model, opt, {"step": 1, "sched": {"fn": lambda: 0}})
    root = tmp_path / "checkpoints"
    assert not root.exists() or list(root.iterdir()) == []


@pytest.mark.unit
def test_load_errors_are_clear(tmp_path):
    model, opt = _trained()
    path = save_distributed(tmp_path / "dcp", 1, model, None, {"step": 1})
    other = build_model(3)
    with pytest.raises(UserError, match="no optimizer state"):
        load_distributed(path, other, adamw(other))
    wide = CausalLM(tiny_config(intermediate_size=96))
    with pytest.raises(UserError, match=r"mlp.gate_proj.weight.*shape \(64, 32\).*\(96, 32\)"):
        load_distributed(path, wide)
    plain = save_checkpoint(tmp_path / "io", 1, {"model": model.state_dict()})
    with pytest.raises(UserError, match="single-process checkpoint"):
        load_distributed(plain, model)
    (path / "COMPLETE").unlink()
    with pytest.raises(UserError, match="incomplete"):
        load_distributed(path, model)
    with pytest.raises(UserError, match="does not exist"):
        load_distributed(tmp_path / "nope", model)
