"""LoRA checkpoints: the shards hold the base and the adapters, the optimizer state only the adapters; a resume
(in one process, or from FSDP 2 ranks into one) continues exactly; `relayrl export` writes the merged model
that transformers loads and, with --peft, an adapter directory peft loads — both give the LoRA model's logits."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

from relayrl.algorithms import AlgoConfig
from relayrl.checkpoint import export_hf, open_checkpoint
from relayrl.cli.main import main as cli_main
from relayrl.errors import UserError
from relayrl.models.lora import is_lora_param, lora_state
from relayrl.models.lora_config import LoRAConfig
from relayrl.parallel.dims import ParallelDims
from relayrl.parallel.parallelize import parallelize_model
from relayrl.roles.actor_workers import actor_model
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.checkpointing import load_actor, save_actor
from relayrl.trainer.config import TrainerConfig

from dist_harness import run_distributed
from helpers import random_rows

LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    out = tmp_path_factory.mktemp("lora") / "base"
    hf.save_pretrained(out)
    return out


def _cfgs(lora=LORA):
    return (TrainerConfig(lr=1e-2, adam_eps=1e-3, micro_batch_size=4, ppo_epochs=1, lora=lora),
            AlgoConfig(kl_coef=0.0, entropy_coef=0.0))


def _batch(model) -> TrainBatch:
    ids, attn, resp = build_rows(*random_rows(seed=3))
    old = Actor(model, *_cfgs(), total_steps=1).compute_logprobs(TrainBatch(ids, attn, resp))
    g = torch.Generator().manual_seed(4)
    return TrainBatch(ids, attn, resp, advantages=torch.randn(8, generator=g), old_logp=old, rollout_logp=old)


def _actor(base_dir, lora=LORA) -> Actor:
    return Actor(actor_model(str(base_dir), lora, seed=0), *_cfgs(lora), total_steps=4)


def _state(actor):
    return {n: p.detach().clone() for n, p in actor.model.named_parameters()}


@pytest.mark.equivalence
def test_resume_continues_exactly_and_saves_adapter_optimizer_only(base_dir, tmp_path):
    a = _actor(base_dir)
    batch = _batch(a.model)
    a.update(batch)
    ckpt = save_actor(a, tmp_path / "run", 1, extra={}, meta={"model_dir": str(base_dir)}, keep_last=None)
    meta, index, _ = open_checkpoint(ckpt)
    assert meta["lora"] == LORA.to_dict()
    keys = index.state_dict_metadata
    optim_params = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.state.")}
    assert optim_params == set(lora_state(a.model))  # Adam's moments for the adapters only
    assert {k[len("model."):] for k in keys if k.startswith("model.")} == set(a.model.state_dict())

    b = _actor(base_dir)
    load_actor(b, ckpt)
    for n, t in _state(a).items():
        assert torch.equal(_state(b)[n], t), n
    sa, sb = a.update(batch), b.update(batch)
    assert sa == sb
    for n, t in _state(a).items():
        assert torch.equal(_state(b)[n], t), n


@pytest.mark.equivalence
def test_base_never_changes(base_dir):
    a = _actor(base_dir)
    before = _state(a)
    batch = _batch(a.model)
    for _ in range(3):
        a.update(batch)
    after = _state(a)
    for n, t in before.items():
        if is_lora_param(n):
            assert not torch.equal(after[n], t), n
        else:
            assert torch.equal(after[n], t), n


def _logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids) if isinstance(model, torch.nn.Module) and hasattr(model, "generate") else model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.equivalence
def test_export_merged_and_peft_give_the_lora_models_logits(base_dir, tmp_path):
    a = _actor(base_dir)
    batch = _batch(a.model)
    for _ in range(2):
        a.update(batch)
    ckpt = save_actor(a, tmp_path / "run", 2, extra={}, meta={"model_dir": str(base_dir)}, keep_last=None)
    ids = batch.input_ids
    want = _logits(a.model.eval(), ids)
    base_logits = _logits(transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval(), ids)
    assert (want - base_logits).abs().max() > 1e-3  # the adapters moved the model

    assert cli_main(["export", str(ckpt), "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-5, rtol=0)

    assert cli_main(["export", str(ckpt), "--peft", "--out", str(tmp_path / "adapter")]) == 0
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (conf["r"], conf["lora_alpha"], conf["base_model_name_or_path"]) == (4, 8.0, str(base_dir.resolve()))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(pm, ids), want, atol=1e-5, rtol=0)
    # every adapter made it into peft's modules (a wrong key would leave peft's zero-initialised B)
    peft_sd = pm.state_dict()
    for n, p in lora_state(a.model).items():
        torch.testing.assert_close(peft_sd[f"base_model.model.{n}.default.weight"], p.detach(), atol=0, rtol=0)


@pytest.mark.unit
def test_peft_export_refused_without_lora(base_dir, tmp_path):
    a = _actor(base_dir, lora=None)
    ckpt = save_actor(a, tmp_path / "run", 1, extra={}, meta={"model_dir": str(base_dir)}, keep_last=None)
    with pytest.raises(UserError, match="not trained with LoRA"):
        export_hf(ckpt, tmp_path / "adapter", peft=True)


def _fsdp_save(rank, world, base_dir, run_dir, batch):
    dims = ParallelDims(world_size=world, dp_shard=world)
    model = parallelize_model(actor_model(str(base_dir), LORA, seed=0), dims, dims.build_mesh("cpu"))
    actor = Actor(model, *_cfgs(), total_steps=4, dims=dims)
    actor.update(batch.split(len(batch) // world)[rank])
    save_actor(actor, run_dir, 1, extra={}, meta={"model_dir": str(base_dir)}, keep_last=None)
    actor.update(batch.split(len(batch) // world)[rank])
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if is_lora_param(n)}


@pytest.mark.equivalence
def test_fsdp_checkpoint_resumes_in_one_process(base_dir, tmp_path):
    batch = _batch(actor_model(str(base_dir), LORA, seed=0))
    after_two = run_distributed(_fsdp_save, 2, base_dir, tmp_path / "run", batch)[0]
    one = _actor(base_dir)
    load_actor(one, tmp_path / "run" / "checkpoints" / "step_00000001")
    one.update(batch)
    for n, t in after_two.items():
        torch.testing.assert_close(dict(one.model.named_parameters())[n].detach(), t, atol=1e-6, rtol=0, msg=n)


@pytest.mark.unit
def test_resume_with_other_lora_settings_is_refused(base_dir, tmp_path):
    from relayrl.checkpoint import CheckpointError

    a = _actor(base_dir)
    ckpt = save_actor(a, tmp_path / "run", 1, extra={}, meta={"model_dir": str(base_dir)}, keep_last=None)
    other = LoRAConfig(**{**LORA.to_dict(), "alpha": 16.0})
    with pytest.raises(CheckpointError, match="trained with trainer.lora=.*'alpha': 8.0.*this run has.*16.0"):
        load_actor(_actor(base_dir, other), ckpt)
    with pytest.raises(CheckpointError, match="this run has None"):
        load_actor(_actor(base_dir, None), ckpt)
    # a bf16 base from an fp32 checkpoint would round every base weight silently on load
    bf16 = LoRAConfig(**{**LORA.to_dict(), "base_dtype": "bfloat16"})
    with pytest.raises(CheckpointError, match="'base_dtype': 'float32'.*this run has.*'base_dtype': 'bfloat16'"):
        load_actor(_actor(base_dir, bf16), ckpt)
