"""This module is an optional rollout backend that drives vLLM (GPU machines) behind LLMEngine's interface:
`generate(prompts, params)`, `load_weights(named tensors)`, `sleep(level)`, `wake()`,
`weights_version`, `tokenizer`, `pad_id`. The driver cannot tell the two apart.

Logprobs: relayrl defines a sampled token's logprob as log_softmax(logits / temperature) over the
full vocabulary (relayrl.engine.sampler). vLLM's default reports the raw (temperature-1)
distribution; this backend asks for `logprobs_mode="processed_logprobs"` where the installed vLLM
has it, which matches relayrl's definition when top-k / top-p are off. Import-guarded: nothing
here is imported unless the backend is chosen.

It imports torch, the engine's outputs and sampling parameters, and vllm (when the backend is built)
only; like the whole engine, it must never import the trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from relayrl.engine.outputs import CompletionSample, RequestOutput
from relayrl.engine.sampling_params import SamplingParams


def vllm_sampling_kwargs(sp: SamplingParams) -> dict:
    """relayrl SamplingParams -> vllm.SamplingParams keyword arguments."""
    return dict(
        n=sp.n, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else -1,
        min_p=sp.min_p, max_tokens=sp.max_tokens, stop=list(sp.stop) or None,
        stop_token_ids=list(sp.stop_token_ids) or None, ignore_eos=sp.ignore_eos, seed=sp.seed,
        logprobs=0,  # the sampled token's logprob (and no others)
    )


def from_vllm_output(request_id: int, out, weights_version: int) -> RequestOutput:
    """A vllm.RequestOutput -> relayrl RequestOutput (each sample's per-token logprobs)."""
    samples = []
    for c in out.outputs:
        tokens = list(c.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(tokens, c.logprobs or [], strict=False)]
        samples.append(CompletionSample(tokens, lps, c.text, finish_reason=c.finish_reason))
    return RequestOutput(request_id, list(out.prompt_token_ids), samples, weights_version)


def _load_into_worker(worker, weights):  # runs inside each vLLM worker (collective_rpc)
    worker.model_runner.model.load_weights(weights=weights)


class VLLMEngine:
    def __init__(self, path: str, dtype: torch.dtype = torch.bfloat16, *, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, enable_prefix_caching: bool = True, seed: int = 0, **_):
        try:
            import vllm
        except ImportError:
            raise ImportError("the vLLM rollout backend needs vllm (a GPU machine): "
                              "pip install 'relayrl[vllm]'") from None
        self._vllm = vllm
        kwargs = dict(model=str(path), dtype=str(dtype).removeprefix("torch."),
                      tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                      enable_prefix_caching=enable_prefix_caching, seed=seed, enable_sleep_mode=True)
        try:
            self.llm = vllm.LLM(**kwargs, logprobs_mode="processed_logprobs")
        except TypeError:  # older vLLM: raw logprobs only (see the module docstring)
            self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.weights_version = 0
        self.asleep = 0

    def generate(self, prompts, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        from vllm.inputs import TokensPrompt

        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        inputs = [TokensPrompt(prompt_token_ids=list(p)) if not isinstance(p, str) else p for p in prompts]
        vparams = [self._vllm.SamplingParams(**vllm_sampling_kwargs(sp)) for sp in params]
        outs = self.llm.generate(inputs, vparams, use_tqdm=False)
        return [from_vllm_output(i, o, self.weights_version) for i, o in enumerate(outs)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        self.llm.collective_rpc(_load_into_worker, args=([(n, t.detach()) for n, t in weights],))
        self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
        self.weights_version += 1
        return self.weights_version

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)
        self.asleep = max(self.asleep, level)

    def wake(self) -> None:
        self.llm.wake_up()
        self.asleep = 0

    def stats(self) -> dict[str, float]:
        return {}  # vLLM reports its own figures in its logs

    def reset_stats(self) -> None:
        pass

    # vLLM's loader takes full tensors (FullWeightSync): there is no planned sync or canary to serve
    def run_on_ranks(self, fn, *args) -> list:
        raise NotImplementedError("the vLLM backend is synced with full tensors; it runs no functions on its ranks")

    def begin_weight_update(self) -> None:
        pass

    def end_weight_update(self) -> int:
        return self.weights_version

    def score(self, rows, temperature: float = 1.0):
        raise NotImplementedError("the vLLM backend scores no given rows (no canary: FullWeightSync)")

    def close(self) -> None:
        pass
