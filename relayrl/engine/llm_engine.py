"""LLMEngine is the rollout engine: continuous batching over a paged KV cache with prefix caching.

    add_request ──> Sequence(s) ──> scheduler.waiting
    step():  schedule (prefill first, under a token budget; the n samples of a prompt: one prefilled,
             n - 1 forked from it with copy-on-write of the shared last block; else decode; preempt
             when out of blocks)
             ──> run (model runner, every TP rank; batch_runner) ──> sample (per-sequence settings and seeds)
             ──> postprocess (append token, check stops, free finished sequences' blocks; request_table)

This module keeps the engine's lifecycle (built, weights loaded and updated, asleep / awake) and its step;
its parts live beside it, all under relayrl.engine: what runs next (scheduler) and where it lives
(block_manager); the ranks that run it and their memory (ranks); one batch's run and sampling (batch_runner);
the requests in flight, what new tokens do to them and their outputs (request_table), a request's samples
and their streams (samples), when a sample ends (stops); what a weight update does to requests in flight
(weight_update) and the figures of stats() (stats). MoE models place their experts and record routing as
__init__ says.

New sequences join as others finish, so a long tail of lengths keeps the batch full. Every output
carries `weights_version`, bumped by each `load_weights`, and every sample the version that sampled each
of its tokens (`CompletionSample.versions`), so the driver knows which policy sampled.

Asynchronous RL updates the weights between two steps with requests in flight; `partial` says what
happens to them at `end_weight_update` (None: refused, "keep_kv", "reprefill"; relayrl.engine.weight_update),
and the prefix cache never serves a request KV that older weights computed.

For RL: `sleep()` frees the KV cache (level 2 also the weights), `wake()` restores it;
`abort()` returns what requests produced so far and `add_request(..., prior=...)` resumes them.

Input is checked at this API, each bad input refused in one line by a `relayrl.errors.UserError`:
weights against the shapes the model config implies (`load_weights`, `from_pretrained`), sampling
settings, empty prompts, token ids outside the vocabulary and prompts that leave no room for a
completion within max_position_embeddings (`add_request`, `generate`), a KV budget too small for one
sequence. A failed `generate` leaves nothing of its own queued.

It imports torch, the engine's own modules, relayrl.models and relayrl.single_controller (the deadlines
of its worker ranks); like the whole engine, it must never import the trainer, sync, the controller or
the CLI.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from relayrl.engine.batch_runner import BatchRunner, sample_next
from relayrl.engine.block_manager import BlockManager
from relayrl.engine.model import check_weights
from relayrl.engine.model_runner import ModelRunner
from relayrl.engine.outputs import RequestOutput
from relayrl.engine.protocols import RunnerGroup
from relayrl.engine.ranks import EngineRanks
from relayrl.engine.request_table import RequestTable
from relayrl.engine.requests import prompt_ids
from relayrl.engine.routing import RoutingStore
from relayrl.engine.sampling_params import SamplingParams
from relayrl.engine.scheduler import Scheduler
from relayrl.engine.sequence import Sequence
from relayrl.engine.stats import EngineStats
from relayrl.engine.stops import StopChecker
from relayrl.engine.weight_update import carry_over, check_in_flight, check_partial
from relayrl.errors import ConfigError, ModelDirError, PromptError, SamplingParamsError, WeightShapeError
from relayrl.models.config import ModelConfig, MoEShape

if TYPE_CHECKING:  # only the TP worker group (relayrl.engine.tp_workers) needs the single-controller layer
    from relayrl.single_controller.liveness import GroupOptions


class LLMEngine:
    def __init__(
        self, config: ModelConfig, tokenizer=None, *, dtype: torch.dtype = torch.float32,
        tensor_parallel_size: int = 1, device: str = "cpu", block_size: int = 16,
        num_blocks: int | None = None, kv_cache_bytes: int | None = None, kv_cache_fraction: float = 0.05,
        enable_prefix_caching: bool = True, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
        seed: int = 0, own_processes: bool = False, runner_group: RunnerGroup | None = None,
        group_options: GroupOptions | None = None, partial: str | None = None, fork_samples: bool = True,
        group_prefill: bool = True, expert_placement: str = "tp", record_routing: bool = False,
    ):
        """Where the ranks run (a RunnerGroup, relayrl.engine.protocols):
        runner_group given      ranks hosted elsewhere (e.g. in the trainer's processes, colocated);
        tensor_parallel_size>1  a worker group of its own (relayrl.engine.tp_workers), also at size 1
        or own_processes        with own_processes (the ranks then live apart from this process: a
                                disaggregated weight sync); group_options sets its deadlines
        otherwise               one ModelRunner in this process (InProcessRunner).
        The KV budget is checked before any process starts. `partial`: what a weight update does to
        requests in flight (None, "keep_kv", "reprefill"; relayrl.engine.weight_update). fork_samples: the n
        samples of a prompt share one prefill (relayrl.engine.block_manager, forks); group_prefill: a
        prefill's attention runs in groups by length (relayrl.engine.attention). Both False: the
        previous engine (every sample prefilled alone, attention padded to the batch's longest).

        MoE models (relayrl.engine.moe): expert_placement "tp" shards every expert's width over the TP ranks,
        "ep" gives each rank whole experts (E / tp of them); the same results either way, and at TP 1.
        record_routing: each sample's output carries the experts every token chose in every MoE layer
        (CompletionSample.routing; see relayrl.engine.routing) for routing replay in the trainer."""
        self.config, self.tokenizer, self.dtype = config, tokenizer, dtype
        self.block_size, self.tp_size, self.expert_placement = block_size, tensor_parallel_size, expert_placement
        self.pad_id = config.pad_token_id or 0
        self.ranks = EngineRanks(config, dtype, tensor_parallel_size=tensor_parallel_size, device=device,
                                 block_size=block_size, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes,
                                 kv_cache_fraction=kv_cache_fraction, max_num_seqs=max_num_seqs,
                                 own_processes=own_processes, runner_group=runner_group,
                                 group_options=group_options, expert_placement=expert_placement)
        self.num_blocks, self.kv_bytes_per_block = self.ranks.num_blocks, self.ranks.kv_bytes_per_block
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enable_prefix_caching, self.partial = enable_prefix_caching, partial
        self.fork_samples, self.group_prefill = fork_samples, group_prefill
        if record_routing and not isinstance(config, MoEShape):
            raise ConfigError(f"record_routing records the experts of an MoE model; {config.model_type} has none")
        self.record_routing = record_routing
        self._routing = (RoutingStore(self.num_blocks * block_size, len(config.moe_layers), config.num_experts_per_tok,
                                      block_size, config.num_experts) if record_routing else None)
        self._stats = EngineStats(config.sliding_window, expert_placement, tensor_parallel_size)
        self._batches = BatchRunner(self._stats, self._routing, block_size=block_size,
                                    sliding_window=config.sliding_window, group_prefill=group_prefill)
        self.weights_version = 0
        self._new_scheduler()
        self.ranks.allocate_kv_cache()
        self.requests = RequestTable(StopChecker(config, tokenizer), self._routing, seed=seed, block_size=block_size)
        self.num_steps = 0  # model runs so far: the clock of each sample's SampleCost

    # ---- construction ----
    @classmethod
    def from_pretrained(cls, path, **kwargs) -> LLMEngine:
        from relayrl.models import load_config, load_state_dict
        from relayrl.models.tokenizer import load_tokenizer

        config, tokenizer = load_config(path), load_tokenizer(path)
        try:  # checked before the engine starts any worker process
            weights = check_weights(config, load_state_dict(path).items())
        except WeightShapeError as e:
            raise ModelDirError(f"{path}: {e}") from None
        return cls._built_with(weights, config, tokenizer, **kwargs)

    @classmethod
    def from_model(cls, model, tokenizer=None, **kwargs) -> LLMEngine:
        kwargs.setdefault("dtype", next(model.parameters()).dtype)
        return cls._built_with(model.state_dict().items(), model.config, tokenizer, **kwargs)

    @classmethod
    def _built_with(cls, weights, *args, **kwargs) -> LLMEngine:
        """An engine holding `weights` as version 0 (nothing in flight, nothing cached yet); closed if they fail."""
        engine = cls(*args, **kwargs)
        try:
            engine.load_weights(weights)
        except BaseException:
            engine.close()
            raise
        engine.weights_version = engine.block_manager.version = 0
        return engine

    @property
    def partial(self) -> str | None:
        return self._partial

    @partial.setter
    def partial(self, value: str | None) -> None:
        self._partial = check_partial(value)

    def _new_block_manager(self) -> BlockManager:
        bm = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        bm.version = self.weights_version  # a fresh pool: its KV is computed by the weights held now
        return bm

    def _new_scheduler(self) -> None:
        self.block_manager = self._new_block_manager()
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, self.max_num_batched_tokens,
                                   max_model_len=self.config.max_position_embeddings,
                                   kv_bytes_per_block=self.kv_bytes_per_block, fork_samples=self.fork_samples,
                                   feed_final_token=self.record_routing)

    @property
    def runner(self) -> ModelRunner | None:
        """The ModelRunner, when the engine's one rank runs in this process (else None)."""
        return self.ranks.runner

    @property
    def asleep(self) -> int:
        """0 awake; 1 the KV cache freed; 2 the weights too (relayrl.engine.ranks)."""
        return self.ranks.asleep

    @property
    def has_weights(self) -> bool:
        return self.ranks.has_weights

    def run_on_ranks(self, fn, *args) -> list:
        """fn(model_runner, *args) on every tensor-parallel rank, wherever it lives; results by rank.
        The weight sync uses it to write each rank's parameters in place."""
        return self.ranks.group.call_all(fn, *args)

    def close(self) -> None:
        ranks = getattr(self, "ranks", None)  # absent when the constructor failed early
        if ranks is not None:
            ranks.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- weights and lifecycle ----
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load (Hugging Face name, full logical tensor) pairs into every rank's shard. Every tensor
        must have exactly the logical shape the config implies and every one must be given (a partial
        sync is an error): a WeightShapeError names the first that is not, before any rank is written."""
        self.ranks.load([(n, t.detach().cpu()) for n, t in check_weights(self.config, weights)])
        return self.end_weight_update()  # weights are back; the KV cache comes back with wake()

    def begin_weight_update(self) -> None:
        """Call before a sync writes into the ranks' parameters: storage released by sleep(2) comes back."""
        self.ranks.restore_weights()

    def end_weight_update(self) -> int:
        """Call after a complete sync: it starts a new weights version and returns its number.

        The prefix cache is emptied: its blocks hold KV the old weights computed, and a later prompt
        sharing their prefix (a system prompt, a tool list, an episode's next turn) must not read it.
        Requests in flight are refused, kept on their KV or re-prefilled, as `partial` says."""
        in_flight = check_in_flight(self.scheduler, self.partial)
        self.ranks.weights_written()
        self.weights_version += 1
        if not self.asleep:  # asleep, nothing is in flight and the cache comes back empty with wake()
            carry_over(self.scheduler, self.block_manager, self.weights_version, in_flight, self.partial)
        return self.weights_version

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix, the weights unchanged (as a weight update does): what an evaluation cached
        must not serve the next step, or that step would differ from the same step of a resumed run."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("reset_prefix_cache() with requests in flight: let them finish first")
        self.block_manager.forget_cached()

    def score(self, rows: list[list[int]], temperature: float = 1.0) -> torch.Tensor:
        """Logprob of every token of `rows` given the ones before it, [B, L] (column 0: 0)."""
        return self.ranks.score(rows, temperature)

    def sleep(self, level: int = 1) -> None:
        """Level 1: free the KV cache (and the prefix cache with it). Level 2: also the weights,
        which must be reloaded with load_weights() before wake()."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("sleep() with requests in flight: abort them first")
        self.ranks.sleep(level)

    def wake(self) -> None:
        self.ranks.check_wakeable()
        if self.asleep:
            self._new_scheduler()  # cached prefixes died with the cache
            self.reset_stats()
            self.ranks.wake()

    # ---- requests ----
    def add_request(self, prompt, params: SamplingParams, request_id: int | None = None,
                    prior: Seq[tuple] | None = None) -> int:
        """Queue `params.n` samples of `prompt` (a string or token ids). `prior` resumes them from partial
        completions, one (token_ids, logprobs[, versions]) per sample as `abort` returns them: their streams
        continue where they stopped, so the result equals an uninterrupted run (relayrl.engine.samples).

        Refused with nothing queued: invalid sampling settings (SamplingParamsError); an empty prompt,
        a token id outside the vocabulary, or a prompt that leaves no room for one completion token
        within the model's maximum length (PromptError; params.truncate_prompt_tokens = k keeps the
        last k tokens instead); a sequence the KV cache could never hold (KVCacheError). A max_tokens
        past the model's maximum length ends the sample there, with finish_reason "length"."""
        ids = prompt_ids(prompt, params, self.config, self.tokenizer, "the prompt")
        return self._add(ids, params, request_id, prior, "the prompt")

    def _add(self, ids: list[int], params: SamplingParams, request_id, prior, where: str) -> int:
        if not self.has_weights:
            raise RuntimeError("the engine holds no weights yet: load_weights() (or a weight sync) first")
        return self.requests.add(ids, params, request_id, prior, self.scheduler, step=self.num_steps, where=where)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.requests.has_outputs()

    def abort(self, request_ids: Iterable[int]) -> list[RequestOutput]:
        """Drop requests; what they produced so far (finish_reason "abort" for samples still running)."""
        return self.requests.abort(request_ids, self.scheduler, self.weights_version)

    # ---- the step ----
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; the requests completed since the last step() (those that ended inside
        a generate() that did not add them come first)."""
        out = self._step()
        return self.requests.take_held() + out

    def _step(self) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError("the engine is asleep: call wake() before generating")
        seqs, is_prefill = self.scheduler.schedule()
        self._stats.observe_queue(self.scheduler)
        try:
            done_requests = self._run_batch(seqs, is_prefill) if seqs else set()
        except BaseException:
            # what this batch wrote into the KV cache is unknown, and a prefill registered its blocks
            # in the prefix cache already: every unfinished sequence keeps its tokens and recomputes
            # its KV on an empty pool, so no later request reads a block that was never written
            self.block_manager = self._new_block_manager()
            self.scheduler.restart(self.block_manager)
            raise
        return self.requests.outputs(done_requests, self.weights_version)

    def _run_batch(self, seqs: list[Sequence], is_prefill: bool) -> set[int]:
        """Run one scheduled batch, sample and postprocess; the ids of the requests it completed."""
        logits = self._batches.run(seqs, is_prefill, self.block_manager, self.ranks.group)  # counted, routing kept
        self.num_steps += 1
        done: set[int] = set()
        seqs, logits = self.requests.end_tails(seqs, logits, self.scheduler, step=self.num_steps, done=done)
        if seqs:
            tokens, logps = sample_next(seqs, logits)
            self.requests.postprocess(seqs, tokens, logps, self.scheduler, version=self.weights_version,
                                      step=self.num_steps, done=done)
        return done

    def generate(self, prompts: Seq, params: SamplingParams | Seq[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; one output per prompt (in order), `params.n` samples each.

        Requests added before (add_request) run alongside; those that end meanwhile are returned by the
        next step(), and this call returns as soon as its own requests are done, whatever else still runs.

        Every prompt is checked (see add_request; errors name the prompt's index) before any is
        queued, and if adding one or a step fails, this call's requests are aborted before the error
        propagates: a failed generate leaves nothing queued, and the engine serves the next call."""
        if isinstance(prompts, (str, bytes)):
            raise PromptError("generate takes a list of prompts; wrap a single prompt in a list")
        prompts = list(prompts)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise SamplingParamsError(f"give one SamplingParams, or one per prompt: got {len(params)} for "
                                      f"{len(prompts)} prompts")
        ids = [prompt_ids(p, sp, self.config, self.tokenizer, f"prompt {i}")
               for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        rids: list[int] = []
        try:
            for i, (toks, sp) in enumerate(zip(ids, params, strict=True)):
                rids.append(self._add(toks, sp, None, None, f"prompt {i}"))
            done: dict[int, RequestOutput] = {}
            own = set(rids)
            while not own <= done.keys():
                if not self.scheduler.has_unfinished() and not self.requests.ready:
                    raise RuntimeError(f"generate: requests {sorted(own - done.keys())} left the engine unreturned")
                for out in self._step():
                    if out.request_id in own:
                        done[out.request_id] = out
                    else:  # another caller's: kept for its next step() (appended now, so a failure loses none)
                        self.requests.held.append(out)
        except BaseException:
            self.abort(rids)
            raise
        return [done[r] for r in rids]

    def reset_stats(self) -> None:
        self._stats.reset(self.block_manager, self.scheduler, self._routing)

    def stats(self) -> dict[str, float]:
        """Since construction or the last wake(): prefix-cache hit rate (tokens), the peak share of
        blocks in use and how full those blocks were then (live KV slots / slots), preemptions, and
        sequences re-prefilled by a weight update (partial="reprefill"); tokens prefills computed, and
        samples forked from a sibling's prefill (fork_samples); with record_routing, the experts' load imbalance."""
        return self._stats.report(self.block_manager, self.scheduler, self._routing)
