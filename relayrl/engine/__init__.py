"""Rollout engine: continuous batching over a paged KV cache, returning each sampled token's logprob."""

from relayrl.engine.llm_engine import LLMEngine
from relayrl.engine.outputs import CompletionSample, RequestOutput
from relayrl.engine.sampling_params import SamplingParams

__all__ = ["CompletionSample", "LLMEngine", "RequestOutput", "SamplingParams"]
