"""Rollout engine: batched sampling that returns the logprob of every sampled token."""

from relayrl.engine.llm_engine import CompletionSample, LLMEngine, RequestOutput
from relayrl.engine.sampling_params import SamplingParams

__all__ = ["CompletionSample", "LLMEngine", "RequestOutput", "SamplingParams"]
