"""Offline export of a sharded checkpoint to a Hugging Face model directory.

    step_XXXXXXXX/  (N shard files + .metadata)     base model dir (meta["model_dir"] / --model-dir)
        │  dcp.load in one process, no process group:     │ config.json      │ tokenizer files
        │  every shard's chunks land in one full model    ▼                  │
        └──────────────────────────────────────────> CausalLM(config) ───────┴──> save_pretrained(out)
                                                     config.json, model.safetensors, tokenizer files

With LoRA (meta.json records the run's `lora` settings), the shards hold the frozen base and the
adapters: the default export merges them (W + alpha / r * B @ A, the model the policy ran, for any
transformers loader), and `peft=True` writes the adapters alone as a PEFT directory instead
(relayrl.checkpoint.peft_export).

Only the model's entries are read (the optimizer state in the shards is skipped), so memory is one
full copy of the weights. The checkpoint is verified first (every file's size and CRC-32 against its
COMPLETE manifest) and read as data only (relayrl.checkpoint.safe_dcp), so a corrupt or crafted
checkpoint stops the export in one line naming the file. The output is written under a temporary name
and renamed when complete (save_pretrained), and an existing output directory is never replaced unless
asked. This module may import models and the other checkpoint modules; never the trainer, engine or
controller.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from relayrl.checkpoint.distributed import MODEL_KEY, check_model_entries, open_checkpoint
from relayrl.checkpoint.peft_export import save_peft_adapter
from relayrl.checkpoint.safe_dcp import dcp_load
from relayrl.errors import ConfigError, UserError
from relayrl.models import CausalLM, load_config, save_pretrained
from relayrl.models.lora import is_lora_param, merge_lora_state_dict
from relayrl.models.lora_config import LoRAConfig
from relayrl.models.rope import rope_inv_freq


def _saved_dtype(path: Path, index: Metadata) -> torch.dtype:
    """The dtype the trainer held its (base) parameters in (the first model tensor's)."""
    for key, entry in index.state_dict_metadata.items():
        if (key.startswith(MODEL_KEY + ".") and not is_lora_param(key)  # adapters may be fp32 over a bf16 base
                and isinstance(entry, TensorStorageMetadata)):
            return entry.properties.dtype
    raise UserError(f"checkpoint {path} holds no model tensors")


def export_hf(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    model_dir: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    peft: bool = False,
) -> Path:
    """Merge the sharded checkpoint into a Hugging Face directory `out_dir`; return its path.

    `model_dir`: the base model directory whose config.json and tokenizer files are used; default
    the one the run recorded at save time (meta.json "model_dir"). `dtype`: default the dtype the
    checkpoint holds. `peft`: write the LoRA adapters as a PEFT adapter directory instead of the merged
    model (a run without LoRA is refused). Runs in a single process and never touches torch.distributed.
    """
    ckpt = Path(checkpoint_dir)
    meta, index, _ = open_checkpoint(ckpt, checksums=True)  # extra too: every file must be sound
    src = model_dir if model_dir is not None else meta.get("model_dir")
    if src is None:
        raise UserError(f"checkpoint {ckpt} does not record its base model directory (meta.json has no "
                        "'model_dir'): pass the model directory it was trained from (--model-dir DIR)")
    if type(src) is not str and not isinstance(src, os.PathLike):
        raise UserError(f"checkpoint {ckpt}: meta.json's 'model_dir' is not a path; pass --model-dir DIR")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; remove it or choose another output directory")

    lora = _lora_of(ckpt, meta)
    if peft and lora is None:
        raise UserError(f"checkpoint {ckpt} was not trained with LoRA (meta.json has no 'lora'): export the "
                        "full model without --peft")
    cfg = load_config(src)  # a clear ModelDirError when the base directory is gone or malformed
    saved_dtype = _saved_dtype(ckpt, index)
    with torch.device("meta"):  # no random init: every tensor is overwritten by the load
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu").to(saved_dtype)
    if cfg.tie_word_embeddings:  # to_empty gives the tied pair two separate storages; tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    state = model.state_dict()
    check_model_entries(ckpt, state, index)
    adapters = _adapter_buffers(ckpt, index) if lora is not None else {}
    dcp_load({MODEL_KEY: {**state, **adapters}}, ckpt, index, no_dist=True)
    if peft:
        return save_peft_adapter(adapters, lora, Path(src).resolve(), out, overwrite=overwrite)
    if adapters:
        merged = merge_lora_state_dict({**state, **adapters}, lora.alpha / lora.rank)
        with torch.no_grad():
            for name, t in state.items():
                t.copy_(merged[name])
    return save_pretrained(model, out, tokenizer_dir=src, dtype=dtype)


def _lora_of(path: Path, meta: dict) -> LoRAConfig | None:
    if meta.get("lora") is None:
        return None
    try:
        return LoRAConfig.from_dict(meta["lora"])
    except ConfigError as e:
        raise UserError(f"checkpoint {path}: meta.json's 'lora' is not a LoRA config ({e})") from None


def _adapter_buffers(path: Path, index: Metadata) -> dict[str, torch.Tensor]:
    """An empty full tensor for each adapter the checkpoint holds (`<module>.lora_A` / `.lora_B`), to load into."""
    out = {}
    for key, entry in index.state_dict_metadata.items():
        name = key[len(MODEL_KEY) + 1:]
        if key.startswith(MODEL_KEY + ".") and is_lora_param(name) and isinstance(entry, TensorStorageMetadata):
            out[name] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    if not out:
        raise UserError(f"checkpoint {path}: meta.json records LoRA but the shards hold no adapters")
    return out
