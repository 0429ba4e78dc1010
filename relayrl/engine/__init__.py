"""This package is the rollout engine: continuous batching over a paged KV cache, returning each sampled
token's logprob.

The engine imports relayrl.models, relayrl.single_controller (its tensor-parallel ranks are a worker group)
and relayrl's ground floor; it must never import the trainer, sync, the controller or the CLI. The layers
above act on its ranks through `run_on_ranks(fn)` instead (relayrl.engine.protocols).
"""

from relayrl.engine.llm_engine import LLMEngine
from relayrl.engine.outputs import CompletionSample, RequestOutput
from relayrl.engine.sampling_params import SamplingParams

__all__ = ["CompletionSample", "LLMEngine", "RequestOutput", "SamplingParams"]
