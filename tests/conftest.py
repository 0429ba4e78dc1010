import pytest
import torch

from relayrl.models import CausalLM, ModelConfig
from relayrl.single_controller.process_setup import configure_process

torch.set_num_threads(2)
configure_process()  # the models' CPU kernels, as every relayrl process that runs models sets them up


def tiny_config(**kw) -> ModelConfig:
    base = dict(
        model_type="qwen2", vocab_size=61, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, eos_token_id=2, pad_token_id=0,
        bos_token_id=1, tie_word_embeddings=True, qkv_bias=True,
    )
    base.update(kw)
    return ModelConfig(**base)


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    m = CausalLM(tiny_config())
    # a larger init than 0.02 gives peaked, varied distributions: a stricter test of sampling
    m.reset_parameters(std=0.3, seed=0)
    return m.eval()
