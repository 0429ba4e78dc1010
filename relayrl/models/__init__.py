"""Plain decoder models (no parallelism inside), Hugging Face load/save, tokenizers."""

from relayrl.models.config import ModelConfig
from relayrl.models.hf_io import load_config, load_pretrained, load_state_dict, save_pretrained
from relayrl.models.transformer import CausalLM

__all__ = ["CausalLM", "ModelConfig", "load_config", "load_pretrained", "load_state_dict", "save_pretrained"]
