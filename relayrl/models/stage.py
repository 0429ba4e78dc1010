"""This module cuts a CausalLM into pipeline stages by decoder-layer ranges, keeping the full model's names.
A stage is a plain module (no collectives, no parallelism inside); relayrl.parallel.pipeline runs them.

    stage 0            embed_tokens, layers [0, a)           input_ids [b, T] ─> h [b, T, H]
    stage s            layers [a_s, a_{s+1})                 h ─> h
    stage S - 1        layers [.., L), norm, lm_head         h ─> logits [b, T, V]

Layers are split evenly, the first (L % S) stages taking one more (the planner's
relayrl.planner.memory.stage_layers, so a planned stage holds what it was planned to hold). A stage module
takes the model's own submodules (no copy) under the same names: `model.layers.5.self_attn.q_proj.weight` on
the stage holding layer 5, `lm_head.weight` on the last, so its state_dict keys are the checkpoint's and
the sync plan's logical tensors. A tied model's last stage holds a copy of embed_tokens.weight as its
lm_head.weight (Megatron's way: the pipeline sums the two copies' gradients, so they stay equal). After
splitting, drop the full model to free the layers this rank does not hold.

Which stages a pp rank holds is the pipeline's business (relayrl.parallel.pipeline.stage_ids_this_rank); this
module only cuts: split_model(model, stage_ids, num_stages).

The stage's forward takes the attention inputs as keyword arguments (attention_mask, position_ids,
segment_ids, parent_ids, split into micro-batches like the input and handed to every stage), and builds
its mask and rotary tables from them itself: only the hidden states travel between ranks.

It imports torch and the models' own modules only; it must never import another relayrl layer: models hold no
parallelism, and every layer above imports them.
"""

from __future__ import annotations

import torch
from torch import nn

from relayrl.errors import ConfigError
from relayrl.models.config import ModelConfig
from relayrl.models.linear import Linear
from relayrl.models.rope import rope_cos_sin
from relayrl.models.transformer import CausalLM, build_attention_mask


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """Decoder layers of `stage`: an even split, the first (num_layers % num_stages) stages one more."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class HeldLayers(nn.Module):
    """The decoder layers one stage holds, registered under their index in the full model (so names stay
    `model.layers.<i>.…`) and iterated in order, as the full model's ModuleList is."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for i, layer in layers.items():
            self.add_module(str(i), layer)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def indices(self) -> list[int]:
        return [int(k) for k in self._modules]


class _StageBody(nn.Module):
    """Stands where CausalLM.model stands: embed_tokens (first stage only), layers, norm (last only)."""


class StageModule(nn.Module):
    """One pipeline stage of a CausalLM: its layer range, with embed_tokens on the first stage and norm +
    lm_head on the last, under the full model's names. Parallelism applies to it as to a whole model
    (relayrl.parallel.parallelize.parallelize_model)."""

    config: ModelConfig

    def __init__(self, model: CausalLM, stage: int, num_stages: int):
        super().__init__()
        cfg = model.config
        self.config = cfg
        self.stage_index, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        body = _StageBody()
        if self.is_first:
            body.embed_tokens = model.model.embed_tokens
        body.layers = HeldLayers({i: model.model.layers[i] for i in stage_layers(cfg.num_hidden_layers, num_stages,
                                                                                 stage)})
        if self.is_last:
            body.norm = model.model.norm
        self.model = body
        if self.is_last:
            self.lm_head = model.lm_head if not (cfg.tie_word_embeddings and num_stages > 1) else _head_copy(model)
        self.register_buffer("inv_freq", model.inv_freq.clone(), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        parent_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [b, T] (first stage) or hidden states [b, T, H] → hidden states, or logits on the last
        stage; the keyword arguments as CausalLM.forward's (no KV cache: pipelines train)."""
        B, T = x.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=x.device)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        mask = build_attention_mask(attention_mask, T, 0, self.config.sliding_window, segment_ids, parent_ids,
                                    position_ids if segment_ids is not None else None)
        h = self.model.embed_tokens(x) if self.is_first else x
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, mask, None)
        if not self.is_last:
            return h
        return self.lm_head(self.model.norm(h))


def _head_copy(model: CausalLM) -> nn.Linear:
    """The last stage's own lm_head for a tied model: a copy of embed_tokens.weight (the first stage keeps the
    original), so every stage's parameters are its own whatever parallelism is applied to it; the pipeline
    sums the two copies' gradients (relayrl.parallel.pipeline)."""
    weight = model.model.embed_tokens.weight
    head = Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    head.weight.requires_grad_(weight.requires_grad)
    return head


def split_model(model: CausalLM, stage_ids: tuple[int, ...], num_stages: int) -> list[StageModule]:
    """The stage modules of `stage_ids` out of `num_stages` (see the module docstring); they share the
    model's parameters."""
    cfg = model.config
    if num_stages > cfg.num_hidden_layers:
        raise ConfigError(f"{num_stages} pipeline stages for {cfg.num_hidden_layers} decoder layers: every stage "
                          f"needs a layer; use pp x stages per rank <= {cfg.num_hidden_layers}")
    if any(getattr(layer, "moe", False) for layer in model.model.layers):
        raise ConfigError("pipeline parallelism is for dense models so far (an MoE layer's routing record and "
                          "auxiliary losses do not cross stages yet); use pp=1")
    return [StageModule(model, s, num_stages) for s in stage_ids]


class _Merged(nn.Module):
    """merge_stages' root: the stages' submodules under the full model's names, and the model's config (a
    checkpoint reads tie_word_embeddings from it); reshard() reshards every stage that data parallelism made an FSDP
    module (their roots are not among the merged submodules)."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.config = stages[0].config
        object.__setattr__(self, "_stages", tuple(stages))  # not registered: their parameters are ours by name

    def reshard(self) -> None:
        for s in self._stages:
            if hasattr(s, "reshard"):
                s.reshard()


def merge_stages(stages: list[StageModule]) -> nn.Module:
    """One module over all of a rank's stages (interleaved and V schedules hold two), named as the full model:
    for the checkpoint's state dict, which is keyed by those names whatever the layout. It shares the stages'
    (possibly sharded) submodules and is not run."""
    if len(stages) == 1:
        return stages[0]
    root, body = _Merged(stages), _StageBody()
    layers: dict[int, nn.Module] = {}
    for s in sorted(stages, key=lambda s: s.stage_index):
        layers |= dict(zip(s.model.layers.indices(), s.model.layers, strict=True))
        for name in ("embed_tokens", "norm"):
            if hasattr(s.model, name):
                body.add_module(name, getattr(s.model, name))
    body.layers = HeldLayers(dict(sorted(layers.items())))
    root.model = body
    for s in stages:
        if s.is_last:
            root.lm_head = s.lm_head
    return root
