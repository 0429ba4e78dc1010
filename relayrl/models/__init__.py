"""This package holds the plain decoder models (no parallelism inside), Hugging Face load/save, tokenizers
and the fusion map.

The package imports torch, safetensors, transformers' tokenizers and relayrl's ground floor only; it
must never import any other relayrl layer (everything above imports it). Names are imported on first
use, so `relayrl.models.config` (ModelConfig, TinyModelConfig) loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relayrl.lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "relayrl.models.config",
    "MoEConfig": "relayrl.models.config",
    "Routing": "relayrl.models.moe",
    "CausalLM": "relayrl.models.transformer",
    "load_config": "relayrl.models.hf_io",
    "load_pretrained": "relayrl.models.hf_io",
    "load_state_dict": "relayrl.models.hf_io",
    "save_pretrained": "relayrl.models.hf_io",
}
__all__ = ["CausalLM", "ModelConfig", "MoEConfig", "Routing", "load_config", "load_pretrained", "load_state_dict",
           "save_pretrained"]

if TYPE_CHECKING:
    from relayrl.models.config import ModelConfig, MoEConfig
    from relayrl.models.hf_io import load_config, load_pretrained, load_state_dict, save_pretrained
    from relayrl.models.moe import Routing
    from relayrl.models.transformer import CausalLM

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
