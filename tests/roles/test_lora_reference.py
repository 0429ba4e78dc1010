"""With trainer.lora the reference model is the actor's own frozen base (its adapters off), as verl does for LoRA:
no second model and no reference worker are built, the reference logprobs are a separately loaded base model's,
and with adapters at B = 0 the first update's KL is exactly 0 for an fp32 and a bf16 base (a separate fp32
reference would not equal a bf16 policy). Under FSDP2 (a no-grad forward that still gathers the unused adapters)
the same numbers as in one process."""

from __future__ import annotations

import pytest
import torch
import transformers

from relayrl.jobs.build import build_policy
from relayrl.models import load_pretrained
from relayrl.models.lora import lora_modules
from relayrl.roles.group_policy import GroupPolicy
from relayrl.trainer.batch import TrainBatch, build_rows
from relayrl.trainer.reference import Reference

from helpers import cfg_for, policy_model, random_rows, step_metrics

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]}


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
    out = tmp_path_factory.mktemp("lora_ref") / "base"
    hf.save_pretrained(out)
    return out


def _cfg(tmp_path, base_dtype="float32", lora=True, **parallel):
    """One optimiser step over the whole batch in one micro-batch: the update's forward sees exactly the rows the
    reference pass saw, so B = 0 gives the same logprobs bit for bit."""
    trainer = {"micro_batch_size": 16, "mini_batches": 1, "ppo_epochs": 1, "shuffle": False}
    if lora:
        trainer["lora"] = {**LORA, "base_dtype": base_dtype}
    return cfg_for(tmp_path, f"run_{base_dtype}_{lora}", algo={"kl_coef": 0.1}, trainer=trainer, parallel=parallel)


def _batch(n=8) -> TrainBatch:
    ids, attn, resp = build_rows(*random_rows(seed=3, n=n))
    g = torch.Generator().manual_seed(4)
    return TrainBatch(ids, attn, resp, advantages=torch.randn(n, generator=g))


def _base_logprobs(base_dir, batch, dtype=torch.float32):
    """A separately loaded base model's logprobs, computed in the trainer's default layout (padding-free rows
    with shared prompts, one micro-batch of 16 rows) so that bit-equality compares the same arithmetic."""
    base = load_pretrained(base_dir).to(dtype).eval()
    ref = Reference(base, temperature=1.0, micro_batch_size=16, padding_free=True, shared_prefix=True)
    return ref.compute_ref_logprobs(batch).float()


def _first_update(policy, batch) -> tuple[torch.Tensor, dict]:
    """ref and old logprobs, then one update with the KL term: its stats."""
    ref = policy.compute_ref_logprobs(batch)
    old = policy.compute_logprobs(batch)
    assert torch.equal(ref, old)  # adapters start at B = 0: the base IS the policy at step 0
    stats = policy.update(batch.replace(old_logp=old, rollout_logp=old, ref_logp=ref))
    return ref, stats


@pytest.mark.equivalence
@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_reference_is_the_actors_base_in_one_process(base_dir, tmp_path, base_dtype):
    policy = build_policy(_cfg(tmp_path, base_dtype), base_dir)
    assert policy.inline and policy.ref_in_actor and policy.ref is None  # no second model
    assert "reference" not in policy.roles
    batch = _batch()
    ref, stats = _first_update(policy, batch)
    assert stats["kl"] == 0.0
    dtype = getattr(torch, base_dtype)  # a separately loaded base model, in the base's dtype
    torch.testing.assert_close(ref, _base_logprobs(base_dir, batch, dtype), atol=0, rtol=0)
    # the adapters are back on after the reference pass, and the update moved them: the policy left its base
    assert all(m.lora_enabled for m in lora_modules(policy_model(policy)).values())
    moved = policy.compute_logprobs(batch)
    assert (moved - ref).abs().max() > 1e-4
    torch.testing.assert_close(policy.compute_ref_logprobs(batch), ref, atol=0, rtol=0)  # the base never moves


@pytest.mark.unit
def test_full_finetuning_keeps_its_reference_model(base_dir, tmp_path):
    policy = build_policy(_cfg(tmp_path, lora=False), base_dir)
    assert policy.ref is not None and not policy.ref_in_actor


@pytest.mark.e2e
def test_first_step_kl_is_zero_through_the_driver(tmp_path):
    """`relayrl train` (its tiny model) with trainer.lora, a bf16 base and a KL term: step 1's KL is exactly 0."""
    from relayrl.jobs.train import train

    cfg = _cfg(tmp_path, "bfloat16")
    d = cfg.to_dict()
    d["run"].update(steps=1, save_every=0)
    res = train(type(cfg).from_dict(d), show_progress=False)
    (first,) = step_metrics(res["run_dir"])
    assert first["kl"] == 0.0 and first["time/ref_logp"] > 0


@pytest.mark.equivalence
def test_fsdp2_reference_in_the_actor_equals_one_process(base_dir, tmp_path):
    batch = _batch()
    single = build_policy(_cfg(tmp_path), base_dir)
    want_ref, want_stats = _first_update(single, batch)
    policy = build_policy(_cfg(tmp_path, backend="local", dp_shard=2), base_dir)
    try:
        assert isinstance(policy, GroupPolicy) and policy.ref is None and "reference" not in policy.roles
        ref, stats = _first_update(policy, batch)
        moved = policy.compute_logprobs(batch)
        ref_after = policy.compute_ref_logprobs(batch)
    finally:
        policy.close()
    # to fp32 rounding, not bit for bit: each rank packs its own rows (padding-free, prompts shared), so the
    # matmuls see other row groupings than one process's; within each layout the reference is exact (KL 0)
    torch.testing.assert_close(ref, want_ref, atol=1e-6, rtol=1e-6)
    assert stats["kl"] == 0.0
    assert stats["loss"] == pytest.approx(want_stats["loss"], rel=1e-5)
    torch.testing.assert_close(ref_after, ref, atol=0, rtol=0)  # the base never moved, adapters back on
    torch.testing.assert_close(moved, single.compute_logprobs(batch), atol=1e-5, rtol=0)
    assert (moved - ref).abs().max() > 1e-4
