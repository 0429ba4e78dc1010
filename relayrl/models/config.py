"""ModelConfig holds the fields of a Hugging Face config.json that the decoder needs, for the Llama,
Mistral, Qwen2 and Qwen3 families; MoEConfig adds the experts of the Qwen2-MoE, Qwen3-MoE and Mixtral families.

Read from both config spellings: transformers 4 (`rope_theta`, `rope_scaling` at the top level)
and transformers 5 (`rope_parameters` holding `rope_theta` and `rope_type`). Fields we do not use
are kept in `extra` so that a save writes back what was loaded.

It imports pydantic, relayrl.config and relayrl.errors only, so a run's config loads without torch; it must
never import another relayrl layer: models hold no parallelism, and every layer above imports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field

from relayrl.config import Config
from relayrl.errors import ConfigError

DENSE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MOE_ARCHITECTURES = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
ARCHITECTURES = DENSE_ARCHITECTURES | MOE_ARCHITECTURES
QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # a sliding window only with use_sliding_window
# config.json's sizes, each a JSON integer of at least 1 where given (0 heads divided by zero, "32" failed deep in
# torch, 1e9 is a float): the minimum per key; shared_expert_intermediate_size 0 means no shared expert, and
# transformers writes sliding_window 0 into configs that use none
SIZE_FIELDS = {
    "vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 1, "max_position_embeddings": 1, "sliding_window": 0,
    "num_experts": 1, "num_local_experts": 1, "num_experts_per_tok": 1, "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 0, "decoder_sparse_step": 1,
}


def check_hf_sizes(d: dict[str, Any]) -> None:
    """ValueError naming the first size of a config.json that is not an integer of at least its minimum (a null is
    left to the field's default)."""
    for key, least in SIZE_FIELDS.items():
        v = d.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{key} must be an integer, got {v!r} ({type(v).__name__})")
        if v < least:
            raise ValueError(f"{key} must be at least {least}, got {v}")
    for key in ("rms_norm_eps", "rope_theta"):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{key} must be a number, got {v!r} ({type(v).__name__})")


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


@dataclass(kw_only=True, unsafe_hash=True)
class MoEShape(ModelShape):
    """A ModelShape whose MLPs are routers over num_experts SwiGLU experts (HF config names), moved here from
    the planner so that the models and the planner share one shape.

    MoE layers: every layer i with (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers (the Qwen
    families' rule; Mixtral's every layer); the others keep a dense MLP intermediate_size wide. The experts are
    moe_intermediate_size wide (Mixtral's: its intermediate_size); a Qwen2-MoE shared expert
    shared_expert_intermediate_size (0: none)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                              f"{self.num_experts}")
        if self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        self.mlp_only_layers = tuple(self.mlp_only_layers)  # a config.json list; a tuple keeps the shape hashable

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The MoE layers in order: position j here is index j of a routing record's layer axis."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def every_layer_moe(self) -> bool:
        return len(self.moe_layers) == self.num_hidden_layers

    def active_shape(self) -> ModelShape:
        """The dense shape whose FLOPs per token are this model's (router aside): an MLP k I + I_s wide."""
        return dataclasses.replace(ModelShape.of(self), intermediate_size=self.routed_width + self.shared_width)

    def total_shape(self) -> ModelShape:
        """The dense shape holding every expert: an MLP E I + I_s wide (the engine's weights, router aside)."""
        return dataclasses.replace(ModelShape.of(self),
                                   intermediate_size=self.num_experts * self.moe_intermediate_size + self.shared_width)

    @property
    def routed_width(self) -> int:
        return self.num_experts_per_tok * self.moe_intermediate_size

    @property
    def shared_width(self) -> int:
        return self.shared_expert_intermediate_size


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
        if (self.model_type in MOE_ARCHITECTURES) != isinstance(self, MoEShape):
            raise ValueError(f"model_type '{self.model_type}' needs "
                             f"{'MoEConfig' if self.model_type in MOE_ARCHITECTURES else 'ModelConfig'}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config of a config.json: a MoEConfig for the MoE families, a ModelConfig otherwise."""
        if not isinstance(d, dict):
            raise ValueError(f"the top level must be a JSON object, got {type(d).__name__}")
        check_hf_sizes(d)
        mt = d.get("model_type")
        if mt not in ARCHITECTURES:
            raise ValueError(f"unsupported model_type {mt!r} (supported: {', '.join(ARCHITECTURES)})")
        if mt in MOE_ARCHITECTURES and cls is ModelConfig:
            return MoEConfig.from_hf_dict(d)
        return cls(**cls._fields_from_hf(d))

    @classmethod
    def _fields_from_hf(cls, d: dict[str, Any]) -> dict[str, Any]:
        mt = d["model_type"]
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
        attention_bias = bool(d.get("attention_bias", False))
        sliding = d.get("sliding_window")
        if mt in QWEN_TYPES and not d.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window size but only use it when asked
        known = {f.name for f in dataclasses.fields(cls)} | {
            "rope_parameters", "attention_bias", "use_sliding_window", "hidden_act",
        }
        return dict(
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
            # Qwen2 biases q, k and v always, Qwen2-MoE unless qkv_bias says otherwise (transformers 5's field)
            qkv_bias=(mt == "qwen2") or (mt == "qwen2_moe" and bool(d.get("qkv_bias", True))) or attention_bias,
            o_bias=attention_bias and mt not in ("qwen2", "qwen2_moe"),
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
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
        if self.model_type == "qwen2_moe":
            d["qkv_bias"] = self.qkv_bias
        elif self.model_type != "qwen2":
            d["attention_bias"] = self.qkv_bias
        if self.model_type in ("llama",):
            d["mlp_bias"] = self.mlp_bias
        if self.model_type in ("mistral", "mixtral"):
            d["sliding_window"] = self.sliding_window
        elif self.model_type in QWEN_TYPES:
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
        return d


@dataclass(kw_only=True, eq=True)
class MoEConfig(ModelConfig, MoEShape):
    """A ModelConfig whose MLPs are mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral), with the routing and the
    router losses' coefficients (relayrl.models.router_losses):

        norm_topk_prob        renormalise the k selected probabilities to sum to 1 (Mixtral: always)
        router_aux_loss_coef  the load-balancing loss's weight (transformers' name and default)
        router_z_loss_coef    the router z-loss's weight (Switch Transformers' name; 0: off)
    """

    __hash__ = None
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        MoEShape.__post_init__(self)
        if self.model_type == "mixtral" and not self.norm_topk_prob:
            raise ValueError("mixtral always renormalises its top-k weights: norm_topk_prob must be true")
        if self.model_type != "qwen2_moe" and self.shared_expert_intermediate_size:
            raise ValueError(f"{self.model_type} has no shared expert (shared_expert_intermediate_size must be 0)")
        if self.model_type == "mixtral" and not self.every_layer_moe:
            raise ValueError("mixtral has no dense layers (decoder_sparse_step 1, no mlp_only_layers)")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MoEConfig:
        mt = d.get("model_type")
        if mt not in MOE_ARCHITECTURES:
            raise ValueError(f"model_type {mt!r} is not an MoE family (supported: {', '.join(MOE_ARCHITECTURES)})")
        if d.get("router_jitter_noise"):
            raise ValueError(f"router_jitter_noise={d['router_jitter_noise']} is not supported (a random routing "
                             "would differ between the trainer and the engine): set it to 0")
        f = cls._fields_from_hf(d)
        extra = f.pop("extra")
        mixtral = mt == "mixtral"
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts, the published checkpoints num_experts
        experts = d.get("num_experts", d.get("num_local_experts"))
        f.update(
            num_experts=experts,
            num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=d["intermediate_size"] if mixtral else d["moe_intermediate_size"],
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0,
            decoder_sparse_step=1 if mixtral else d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(() if mixtral else d.get("mlp_only_layers") or ()),
            norm_topk_prob=True if mixtral else bool(d.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
            router_z_loss_coef=float(d.get("router_z_loss_coef", 0.0)),
        )
        moe_keys = set(f) | {"num_local_experts", "router_jitter_noise"}
        return cls(**f, extra={k: v for k, v in extra.items() if k not in moe_keys})

    def to_hf_dict(self) -> dict[str, Any]:
        d = super().to_hf_dict()
        d.update(num_experts_per_tok=self.num_experts_per_tok, router_aux_loss_coef=self.router_aux_loss_coef,
                 router_z_loss_coef=self.router_z_loss_coef)
        if self.model_type == "mixtral":
            d.update(num_local_experts=self.num_experts, intermediate_size=self.moe_intermediate_size,
                     router_jitter_noise=0.0)
        else:
            d.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == "qwen2_moe":
            d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return d


class TinyModelConfig(Config):
    """The `model.tiny` section: the shape of the tiny model built for a built-in task or a dataset file (no
    download)."""

    model_type: Literal["llama", "mistral", "qwen2", "qwen3"] = "qwen2"
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    tie_word_embeddings: bool = True
    init_std: float = Field(0.02, gt=0)
    seed: int = 0
