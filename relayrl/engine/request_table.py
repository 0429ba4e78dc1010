"""This module keeps the rollout engine's requests while they run: each one's samples by request id, what a
step's new tokens do to them, and the outputs waiting to be returned.

    add          a checked prompt (relayrl.engine.requests) ──> `params.n` Sequences (relayrl.engine.samples)
                 ──> the scheduler's waiting queue; a resumed sample that had already ended stays ended
    end_tails    with record_routing, samples that ran their final token for its routing only end now
    postprocess  each sampled token appended (with the weights version that sampled it) and its sample's
                 stop checked (relayrl.engine.stops); an ended sample frees its blocks (scheduler.finish)
    outputs      a request whose samples have all ended leaves the table as a RequestOutput, once: when a
                 step completes it, or at the next step when it was complete on arrival (`ready`), or at
                 abort(); `held` keeps those that ended inside another caller's generate() for the next step()

With record_routing (relayrl.engine.routing), a sample's experts are gathered from their KV slots before its
blocks are freed, and a final token that has not run yet runs once more first (Sequence.pending_finish).

The scheduler is the engine's (a fresh one after wake() or a failed step), so it is passed to each call.

It imports the engine's own modules and relayrl.errors; like the whole engine, it must never import the
trainer, sync, the controller or the CLI.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from relayrl.engine.outputs import CompletionSample, RequestOutput
from relayrl.engine.routing import RoutingStore
from relayrl.engine.samples import new_samples
from relayrl.engine.sampling_params import SamplingParams
from relayrl.engine.scheduler import Scheduler
from relayrl.engine.sequence import Sequence, SequenceStatus
from relayrl.engine.stops import StopChecker
from relayrl.errors import KVCacheError


class RequestTable:
    """The requests in flight by id (`samples`), and the outputs waiting to be returned (`ready`, `held`)."""

    def __init__(self, stops: StopChecker, routing: RoutingStore | None, *, seed: int, block_size: int):
        self.stops, self.routing, self.block_size = stops, routing, block_size
        self._rng = random.Random(seed)  # the streams of unseeded requests' samples
        self._seq_ids = itertools.count()
        self._req_ids = itertools.count()
        self.samples: dict[int, list[Sequence]] = {}
        self.ready: list[int] = []  # requests complete on arrival (resumed after they had ended)
        # outputs of requests generate() did not add that ended inside it: the next step() returns them
        self.held: list[RequestOutput] = []

    def has_outputs(self) -> bool:
        """Whether outputs wait to be returned by a step() with no model run of their own."""
        return bool(self.ready) or bool(self.held)

    # ---- in ----
    def add(self, ids: list[int], params: SamplingParams, request_id: int | None, prior: Seq[tuple] | None,
            scheduler: Scheduler, *, step: int, where: str) -> int:
        """Queue `params.n` samples of the checked prompt `ids` (resumed from `prior`: LLMEngine.add_request);
        the request id. Refused with nothing queued."""
        if prior is not None and len(prior) != params.n:
            raise ValueError(f"{where}: prior holds {len(prior)} partial completions for n={params.n} samples")
        rid = next(self._req_ids) if request_id is None else request_id
        if rid in self.samples:
            raise ValueError(f"request id {rid} is already in flight")
        seqs = new_samples(ids, params, rid, prior, seq_ids=self._seq_ids, rng=self._rng, block_size=self.block_size,
                           step=step, where=where)
        self.samples[rid] = seqs
        try:
            for s in seqs:
                # a resumed sample that had already ended (EOS, stop, max tokens) stays ended
                reason = self.stops.finish_reason(s) if s.num_completion_tokens else None
                if reason is None:
                    scheduler.add(s)
                else:
                    s.status, s.finish_reason = SequenceStatus.FINISHED, reason
        except BaseException as e:
            scheduler.abort({s.seq_id for s in seqs})  # nothing of a refused request stays queued
            del self.samples[rid]
            if isinstance(e, KVCacheError):
                raise KVCacheError(f"{where}: {e}") from None
            raise
        if all(s.is_finished for s in seqs):
            self.ready.append(rid)
        return rid

    # ---- a step's new tokens ----
    def end_tails(self, seqs: list[Sequence], logits: torch.Tensor, scheduler: Scheduler, *, step: int,
                  done: set[int]) -> tuple[list[Sequence], torch.Tensor]:
        """Samples that ran their final token for its routing only end now, nothing sampled (their requests
        into `done` when complete); the others and their logits rows, to sample from."""
        tails = [i for i, s in enumerate(seqs) if s.pending_finish is not None]
        if not tails:
            return seqs, logits
        for i in tails:
            self._end(seqs[i], seqs[i].pending_finish, scheduler, step=step, done=done)
        keep = [i for i, s in enumerate(seqs) if s.pending_finish is None]
        return [seqs[i] for i in keep], logits[keep]

    def postprocess(self, seqs: list[Sequence], tokens: list[int], logps: list[float], scheduler: Scheduler, *,
                    version: int, step: int, done: set[int]) -> None:
        """Append each sample's new token (sampled by weights `version`); those that end go, and their requests
        into `done` when complete."""
        for s, t, lp in zip(seqs, tokens, logps, strict=True):
            s.append_token(t, lp, version)
            reason = self.stops.finish_reason(s)
            if reason is not None:
                self._end(s, reason, scheduler, step=step, done=done)

    def _end(self, s: Sequence, reason: str, scheduler: Scheduler, *, step: int, done: set[int]) -> None:
        """s is done for `reason`. With record_routing, a final token that has not run yet runs once more first
        (s.pending_finish; relayrl.engine.routing), and the routing is gathered before the blocks are freed."""
        if self.routing is not None:
            if s.num_routed < s.num_tokens:
                s.pending_finish = reason
                return
            s.routing = self.routing.gather(s)
        s.cost.finished_step = step
        scheduler.finish(s, reason)
        if all(x.is_finished for x in self.samples[s.request_id]):
            done.add(s.request_id)

    # ---- out ----
    def outputs(self, done: set[int], version: int) -> list[RequestOutput]:
        """The requests complete on arrival, then those in `done` (by id); each leaves the table."""
        ready, self.ready = [self._output(rid, version) for rid in self.ready], []
        return ready + [self._output(rid, version) for rid in sorted(done)]

    def take_held(self) -> list[RequestOutput]:
        held, self.held = self.held, []
        return held

    def abort(self, request_ids: Iterable[int], scheduler: Scheduler, version: int) -> list[RequestOutput]:
        """Drop requests (unknown ids are skipped); what they produced so far, by id."""
        ids = set(request_ids)
        seqs = [s for rid in ids if rid in self.samples for s in self.samples[rid]]
        if self.routing is not None:  # before their blocks (and the routing in their slots) are freed
            for s in seqs:
                if not s.is_finished:
                    s.routing = self.routing.gather(s)
        scheduler.abort({s.seq_id for s in seqs})
        for s in seqs:  # a sample that had ended and waited only to run its final token for routing stays ended
            if s.pending_finish is not None:
                s.finish_reason = s.pending_finish
        self.ready = [rid for rid in self.ready if rid not in ids]  # an ended request is returned here, once
        held = [o for o in self.held if o.request_id in ids]
        self.held = [o for o in self.held if o.request_id not in ids]
        return sorted(held + [self._output(rid, version) for rid in ids if rid in self.samples],
                      key=lambda o: o.request_id)

    def _output(self, rid: int, version: int) -> RequestOutput:
        seqs = self.samples.pop(rid)
        samples = [CompletionSample(list(s.completion_token_ids), list(s.logprobs),
                                    s.text if s.text is not None else self.stops.decode(s.completion_token_ids),
                                    finish_reason=s.finish_reason, top_logprobs=list(s.top_logprobs),
                                    versions=list(s.versions), cost=replace(s.cost), routing=self._routing_of(s))
                   for s in seqs]
        return RequestOutput(rid, seqs[0].token_ids[: seqs[0].num_prompt_tokens], samples, version)

    def _routing_of(self, s: Sequence) -> torch.Tensor | None:
        """The sample's routing record (relayrl.engine.routing); None without record_routing."""
        if self.routing is None:
            return None
        return s.routing if s.routing is not None else self.routing.gather(s)
