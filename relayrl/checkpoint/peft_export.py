"""Write LoRA adapters as a PEFT adapter directory, which `peft.PeftModel.from_pretrained(base, DIR)` loads.

    relayrl name (relayrl.models.lora)          peft name (adapter_model.safetensors)
    model.layers.0.self_attn.q_proj.lora_A  ->  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    model.layers.0.self_attn.q_proj.lora_B  ->  base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight

adapter_config.json carries r, lora_alpha, lora_dropout, target_modules and base_model_name_or_path (the
run's base model directory); the shapes already agree (A [r, in], B [out, r], scaling alpha / r). The JSON
is written by hand, so exporting needs no peft import; the tests load the result with peft itself. The
directory is written under a temporary name and renamed when complete.

This module imports torch, safetensors, relayrl.models (the LoRA names and config) and relayrl.errors; it
must never import the trainer, engine or controller.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from relayrl.errors import UserError
from relayrl.models.lora_config import LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def peft_key(name: str) -> str:
    """`<module>.lora_A` -> `base_model.model.<module>.lora_A.weight` (peft's saved name, adapter name dropped)."""
    return f"{PEFT_PREFIX}{name}.weight"


def adapter_config(cfg: LoRAConfig, base_model: str) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft_adapter(adapters: dict[str, torch.Tensor], cfg: LoRAConfig, base_model: str | os.PathLike[str],
                      out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """`adapters`: {`<module>.lora_A` / `.lora_B`: full tensor} (relayrl.models.lora.lora_state, gathered)."""
    final = Path(out_dir)
    if final.exists() and not overwrite:
        raise UserError(f"{final} already exists; remove it or choose another output directory")
    if not adapters:
        raise UserError("no LoRA adapters to export: the run did not train with trainer.lora")
    tmp = final.parent / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {peft_key(n): t.detach().contiguous().cpu() for n, t in sorted(adapters.items())}
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, str(base_model)), indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final
