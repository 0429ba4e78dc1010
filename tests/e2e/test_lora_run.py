"""A LoRA run end to end: `relayrl train` with trainer.lora in the driver's process and as an FSDP worker group
(the same metrics), its final model is the merged policy, and its checkpoint exports (merged, and for peft) to
that same model."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from relayrl.checkpoint import export_hf, latest_checkpoint, open_checkpoint
from relayrl.models.lora import is_lora_param

from helpers import assert_same_metrics, cfg_for, step_metrics

pytestmark = pytest.mark.e2e

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]}


def _cfg(tmp_path, name, **parallel):
    """helpers.group_cfg's run (a KL term, a reward with spread) with LoRA; adapters start at B = 0, so a larger
    learning rate lets two steps move the policy visibly."""
    return cfg_for(tmp_path, name, algo={"kl_coef": 0.05}, run={"steps": 2, "save_every": 2},
                   reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}, parallel=parallel,
                   trainer={"lora": LORA, "lr": 1e-2})


def test_lora_run_single_and_fsdp_and_its_exports(tmp_path):
    from relayrl.jobs.train import train

    single = train(_cfg(tmp_path, "single"), show_progress=False)
    fsdp = train(_cfg(tmp_path, "fsdp2", backend="local", dp_shard=2), show_progress=False)
    assert_same_metrics(step_metrics(fsdp["run_dir"]), step_metrics(single["run_dir"]))

    run = tmp_path / "single"
    ckpt = latest_checkpoint(run)
    meta, index, _ = open_checkpoint(ckpt)
    assert meta["lora"]["rank"] == 4
    assert any(is_lora_param(k.removeprefix("model.")) for k in index.state_dict_metadata)

    # the final model is the merged policy: the export of the last checkpoint, tensor for tensor
    final = load_file(run / "final_model" / "model.safetensors")
    export_hf(ckpt, tmp_path / "merged")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(final) == set(merged) and not any(is_lora_param(k) for k in final)
    for k, t in final.items():
        torch.testing.assert_close(merged[k], t, atol=0, rtol=0, msg=k)
    base = load_file(run / "base_model" / "model.safetensors")
    q, gate = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"
    assert (final[q] - base[q]).abs().max() > 1e-4  # a target: merged, moved
    assert torch.equal(final[gate], base[gate])  # not a target: the base's

    # the peft adapter on the base model gives the final model's logits
    export_hf(ckpt, tmp_path / "adapter", peft=True)
    ids = torch.randint(3, 20, (2, 10), generator=torch.Generator().manual_seed(0))
    want = transformers.AutoModelForCausalLM.from_pretrained(run / "final_model", dtype=torch.float32).eval()
    pm = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, want(input_ids=ids).logits, atol=1e-5, rtol=0)
