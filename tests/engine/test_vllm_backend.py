"""The vLLM backend's conversions (vLLM itself runs only on GPU machines)."""

import sys
from types import SimpleNamespace

import pytest

from relayrl.engine import SamplingParams
from relayrl.engine.vllm_backend import VLLMEngine, from_vllm_output, vllm_sampling_kwargs

pytestmark = pytest.mark.unit


def test_sampling_params_map_to_vllm_names():
    kw = vllm_sampling_kwargs(SamplingParams(n=8, temperature=0.7, top_k=0, max_tokens=5, stop=["\n"], seed=3))
    assert kw["n"] == 8 and kw["top_k"] == -1 and kw["stop"] == ["\n"] and kw["logprobs"] == 0
    assert kw["stop_token_ids"] is None and kw["seed"] == 3 and kw["max_tokens"] == 5


def test_outputs_map_back_with_sampled_token_logprobs():
    def lp(x):
        return SimpleNamespace(logprob=x)

    comp = SimpleNamespace(token_ids=[4, 9], logprobs=[{4: lp(-0.5), 7: lp(-1.0)}, {9: lp(-0.25)}],
                           text="ab", finish_reason="stop")
    out = from_vllm_output(3, SimpleNamespace(prompt_token_ids=[1, 2], outputs=[comp]), weights_version=2)
    assert out.request_id == 3 and out.weights_version == 2 and out.prompt_token_ids == [1, 2]
    assert out.samples[0].token_ids == [4, 9] and out.samples[0].logprobs == [-0.5, -0.25]


def test_missing_vllm_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="relayrl\\[vllm\\]"):
        VLLMEngine("/nonexistent")
