"""This module reads and writes Hugging Face model directories (config.json + safetensors, one file or
sharded with `model.safetensors.index.json`), so the same code path serves tiny and real models. MoE experts
are written one tensor per expert, as the published checkpoints are; transformers 5's stacked layout
(`save_original_format=False`) is read too (relayrl.models.moe.unstack_experts).

A config.json is checked against its weights' shapes before anything of the config's size is allocated
(`check_weight_shapes`, safetensors headers only): `hidden_size: 1000000000` with a 32-wide checkpoint is one line,
not a 116 GB allocation.

It imports torch, safetensors, the models' own modules and relayrl's ground floor only; it must never import
another relayrl layer: models hold no parallelism, and every layer above imports them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from relayrl.config import parse_json
from relayrl.errors import ModelDirError
from relayrl.models.config import ModelConfig, MoEConfig
from relayrl.models.moe import unstack_experts
from relayrl.models.rope import rope_inv_freq
from relayrl.models.transformer import CausalLM

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json",
)


def load_config(path: str | Path) -> ModelConfig:
    p = Path(path)
    if not p.is_dir():
        raise ModelDirError(f"model directory not found: {p} "
                            "(expected a Hugging Face directory with config.json and *.safetensors)")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelDirError(f"{p} has no config.json: not a Hugging Face model directory")
    try:
        d = parse_json(cfg_file.read_text())  # bounded: nesting and digits
        return ModelConfig.from_hf_dict(d)
    except json.JSONDecodeError as e:
        raise ModelDirError(f"malformed {cfg_file}: {e}") from None
    except KeyError as e:
        raise ModelDirError(f"malformed {cfg_file}: missing field {e}") from None
    except (ValueError, TypeError) as e:  # TypeError: a field of the wrong JSON type (a rope_parameters list, ...)
        raise ModelDirError(f"{cfg_file}: {e}") from None


def generation_eos_ids(path: str | Path) -> list[int]:
    """The end-of-sequence ids of a model directory's generation_config.json ([] without one): an instruct model's
    end-of-turn token is often there only (HF's generate and vLLM stop at each of them)."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return []
    try:
        eos = parse_json(f.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ModelDirError(f"malformed {f}: {e}; fix or remove it") from None
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelDirError(f"{f}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return list(ids)


def resolve_model_path(path: str | Path, gguf_cache: str | Path, log=None) -> Path:
    """The Hugging Face directory a policy model path names, checked: a directory (its config.json readable, its
    tokenizer files present), or a GGUF file converted once into `gguf_cache` (relayrl.models.gguf.cached_conversion).
    Every entry point (train and sft's model.path, eval and generate's --model) resolves through here, by way of
    relayrl.jobs.base_model.resolve_model, before any worker starts."""
    p = Path(path)
    if p.is_file() or p.suffix.lower() == ".gguf":
        from relayrl.models.gguf import cached_conversion, is_gguf

        if is_gguf(p):
            return cached_conversion(p, gguf_cache, log=log)
        raise ModelDirError(f"{p} is a file, not a model directory: pass a Hugging Face directory (config.json, "
                            "*.safetensors, tokenizer files) or a .gguf file")
    check_weight_shapes(p, load_config(p))  # a missing or malformed directory, or weights of another shape: one line
    from relayrl.models.tokenizer import require_tokenizer_files

    require_tokenizer_files(p)
    return p


def _weight_files(p: Path) -> list[Path]:
    index = p / INDEX
    if index.is_file():
        try:
            weight_map = parse_json(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelDirError(f"malformed {index}: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ModelDirError(f"malformed {index}: weight_map must be an object of tensor name -> file name, got "
                                f"{type(weight_map).__name__}; rewrite the index or remove it")
        names = sorted(set(weight_map.values()))
        files = [p / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(f"{p}: {INDEX} lists missing shard(s) {', '.join(missing)}")
        return files
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelDirError(f"{p} has no *.safetensors weights")
    return files


def _config_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the model `cfg` describes -> its shape, from a model on the meta device (no storage)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _shape_error(path: Path, name: str, got: tuple[int, ...], want: tuple[int, ...]) -> ModelDirError:
    return ModelDirError(f"{path}: tensor '{name}' has shape {got}, the model config implies {want}; check that the "
                         "weights belong to this config.json")


def check_weight_shapes(path: str | Path, cfg: ModelConfig) -> None:
    """ModelDirError naming the first tensor of the weight files (their headers only: nothing is loaded) whose shape
    is not the one `cfg` implies: a config.json that does not describe its weights is refused before a model of its
    size is allocated. Names the config does not know (an MoE's stacked experts) are left to the load."""
    p = Path(path)
    shapes = _config_shapes(cfg)
    for f in _weight_files(p):
        try:
            with safe_open(str(f), framework="pt") as fh:
                found = [(k, tuple(fh.get_slice(k).get_shape())) for k in fh.keys() if k in shapes]
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelDirError(f"cannot read weights {f}: {e}") from None
        for k, got in found:
            if got != shapes[k]:
                raise _shape_error(p, k, got, shapes[k])


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(path)):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    out[k] = fh.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelDirError(f"cannot read weights {f}: {e}") from None
    return out


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> CausalLM:
    """Build the model from `path/config.json` and load its safetensors weights."""
    cfg = load_config(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    sd = load_state_dict(path)
    if isinstance(cfg, MoEConfig):
        sd = unstack_experts(sd, cfg)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    # checked on the meta model, before anything of the config's size is allocated
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {k for k in own if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - set(sd))
    if missing:
        raise ModelDirError(f"{path}: weights missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    for k in sorted(expected):
        if tuple(sd[k].shape) != own[k]:
            raise _shape_error(Path(path), k, tuple(sd[k].shape), own[k])
    model = model.to_empty(device=device)
    # built on the meta device (no wasted random init); the rope buffer is not in the checkpoint
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_state_dict({k: sd[k] for k in expected}, strict=False, assign=False)
    return model.to(dtype)


def save_pretrained(
    model: CausalLM,
    path: str | Path,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` as a Hugging Face directory (written under a temporary name, then renamed)."""
    final = Path(path)
    tmp = final.parent / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = model.config
    sd = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(v.numel() * v.element_size() for v in sd.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = str(next(iter(sd.values())).dtype).replace("torch.", "")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
    if final.exists():
        old = final.parent / f".old_{final.name}_{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    return final
