"""ModelConfig holds the fields of a Hugging Face config.json that the decoder needs, for the Llama,
Mistral, Qwen2 and Qwen3 families.

Read from both config spellings: transformers 4 (`rope_theta`, `rope_scaling` at the top level)
and transformers 5 (`rope_parameters` holding `rope_theta` and `rope_type`). Fields we do not use
are kept in `extra` so that a save writes back what was loaded.

It imports pydantic and relayrl.config only, so a run's config loads without torch; it must never import
another relayrl layer: models hold no parallelism, and every layer above imports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from relayrl.config import Config

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(kw_only=True, unsafe_hash=True)
class ModelShape:
    """The fields of a model config that decide its tensors' names and shapes: what a weight-sync plan
    or a checkpoint layout depends on. Hashable (plans are cached by it). A ModelConfig is a ModelShape
    plus everything else; `ModelShape.of(cfg)` keeps only these fields."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 when attention_bias
    o_bias: bool = False  # Llama/Qwen3 attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    tie_word_embeddings: bool = False

    @classmethod
    def of(cls, cfg: ModelShape) -> ModelShape:
        """The shape of a ModelConfig (or a shape itself)."""
        if type(cfg) is cls:
            return cfg
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


@dataclass(kw_only=True, eq=True)
class ModelConfig(ModelShape):
    """The decoder's config: its shape (ModelShape) plus model type, norms, RoPE, lengths and token ids."""

    __hash__ = None  # mutable and holds dicts: not hashable (its ModelShape.of is)
    model_type: str
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(f"unsupported model_type '{self.model_type}' (supported: {', '.join(ARCHITECTURES)})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        mt = d.get("model_type")
        if mt not in ARCHITECTURES:
            raise ValueError(f"unsupported model_type {mt!r} (supported: {', '.join(ARCHITECTURES)})")
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        attention_bias = bool(d.get("attention_bias", False))
        sliding = d.get("sliding_window")
        if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size but only use it when asked
        known = {f.name for f in dataclasses.fields(cls)} | {
            "rope_parameters", "attention_bias", "use_sliding_window", "hidden_act",
        }
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            qkv_bias=(mt == "qwen2") or attention_bias,
            o_bias=attention_bias and mt != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=(mt == "qwen3"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            sliding_window=sliding,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        rope_params = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope_params.update(self.rope_scaling)
        d.update(
            architectures=[ARCHITECTURES[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            # both spellings, so transformers 4 and 5 read the same rope
            rope_theta=self.rope_theta,
            rope_parameters=rope_params,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.model_type in ("llama",):
            d["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        elif self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
        return d


class TinyModelConfig(Config):
    """The `model.tiny` section: the shape of the tiny model built for a built-in task (no download)."""

    model_type: Literal["llama", "mistral", "qwen2", "qwen3"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    tie_word_embeddings: bool = True
    init_std: float = Field(0.02, gt=0)
    seed: int = 0
