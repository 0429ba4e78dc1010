"""ScoreModel: the decoder with a small linear head instead of the language-model head, the layout of Hugging
Face's `*ForSequenceClassification` / `*ForTokenClassification` models.

    input_ids ──> DecoderModel (the same layers as CausalLM) ──> final norm ──> score: Linear(h, num_labels)
                                                                              ──> [B, T, num_labels]

Two uses: a critic (num_labels 1, a value per token: PPO's V(s_t)) and a reward model (a sequence
classifier, read at each row's last real token, the way transformers pools). Weights are named as
Hugging Face names them (`model.*`, `score.weight`), so a transformers sequence-classification
directory loads as is; a causal-LM directory gives the backbone and a fresh head (`from_causal_lm`,
how a critic starts from the policy).

It imports torch and the models' own modules only; like all of models, it must never import another
relayrl layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.errors import ModelDirError
from relayrl.models.config import ModelConfig
from relayrl.models.hf_io import load_config, load_state_dict
from relayrl.models.linear import Linear
from relayrl.models.rope import rope_inv_freq
from relayrl.models.transformer import CausalLM


class ScoreModel(CausalLM):
    """The decoder and a `score` head [num_labels, h] (no bias, as transformers' classifiers)."""

    def __init__(self, cfg: ModelConfig, num_labels: int = 1):
        super().__init__(cfg)
        del self.lm_head  # never used: a [V, h] matrix would be a large dead weight
        self.num_labels = num_labels
        self.score = Linear(cfg.hidden_size, num_labels, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                parent_ids: torch.Tensor | None = None, **_) -> torch.Tensor:
        """Scores [B, T, num_labels] at every position (a position sees only the tokens up to it)."""
        h = super().forward(input_ids, attention_mask, position_ids, return_hidden=True, segment_ids=segment_ids,
                              parent_ids=parent_ids)
        return self.score(h)


def last_token_scores(scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, num_labels]: each row's score at its last real token (right padding), as transformers pools."""
    last = attention_mask.long().sum(-1).clamp(min=1) - 1
    return scores[torch.arange(scores.shape[0]), last]


def _built(cfg: ModelConfig, num_labels: int, device) -> ScoreModel:
    with torch.device("meta"):
        model = ScoreModel(cfg, num_labels)
    model = model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model


def _load_into(model: ScoreModel, sd: dict[str, torch.Tensor], path, skip: set[str]) -> None:
    own = model.state_dict()
    expected = set(own) - skip
    missing = sorted(expected - set(sd))
    if missing:
        raise ModelDirError(f"{path}: weights missing tensor '{missing[0]}' ({len(missing)} missing in all)")
    for k in expected:
        if tuple(sd[k].shape) != tuple(own[k].shape):
            raise ModelDirError(f"{path}: tensor '{k}' has shape {tuple(sd[k].shape)}, "
                                f"the config implies {tuple(own[k].shape)}")
    model.load_state_dict({k: sd[k] for k in expected}, strict=False)


def load_score_model(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> ScoreModel:
    """A sequence/token-classification directory: backbone and `score.weight` (num_labels from its shape)."""
    cfg = load_config(path)
    sd = load_state_dict(path)
    if "score.weight" not in sd:
        raise ModelDirError(f"{path}: no 'score.weight': not a sequence-classification model "
                            "(a causal LM starts a critic with from_causal_lm)")
    model = _built(cfg, int(sd["score.weight"].shape[0]), device)
    _load_into(model, sd, path, skip=set())
    return model.to(dtype)


def from_causal_lm(path: str | Path, *, head_std: float = 0.0, seed: int = 0, dtype: torch.dtype = torch.float32,
                   device="cpu") -> ScoreModel:
    """A one-label ScoreModel whose backbone is the causal LM at `path` and whose head is fresh: zeros by
    default (every value starts at 0, so the first advantages are the returns), or normal(0, head_std)."""
    cfg = load_config(path)
    model = _built(cfg, 1, device)
    _load_into(model, load_state_dict(path), path, skip={"score.weight"})
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * head_std)
    return model.to(dtype)


def save_score_model(model: ScoreModel, path: str | Path) -> Path:
    """A directory transformers loads as `*ForSequenceClassification` (architectures and num_labels set)."""
    import json

    from relayrl.models.hf_io import save_pretrained

    out = save_pretrained(model, path)
    cfg = json.loads((out / "config.json").read_text())
    arch = cfg.get("architectures", ["LlamaForCausalLM"])[0].replace("ForCausalLM", "ForSequenceClassification")
    cfg.update(architectures=[arch], num_labels=model.num_labels)
    if model.num_labels != 2:
        cfg["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
        cfg["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
