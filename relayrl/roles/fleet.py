"""This module runs a rollout fleet: `rollout.replicas` engines, each in a rollout worker process of its own, behind
one router, as ONE RolloutEngine to the rest of relayrl (the sources, the evaluator, the driver).

    driver ── RolloutFleet ──> Router (relayrl.rollout.router): each request (a prompt, its n samples) to a replica
              (a RolloutEngine)    by least outstanding work with prefix affinity
                                ──> RolloutRole x N (relayrl.roles.rollout_worker), each a worker process holding an
                                    LLMEngine (its TP ranks below it); their generate calls run at once, one driver
                                    thread each, and the outputs come back in the prompts' order

What is sampled does not depend on the routing: every request of a run carries its own seed (relayrl.rollout.source
sampling_params), and a seeded request's samples are the same in any batch on any replica
(tests/engine/test_llm_engine.py: test_seeded_sampling_independent_of_batch; tests/fleet: the same run on 1, 2 and 4
replicas). The weight sync reaches each replica by its own handle (relayrl.roles.fleet_sync); the fleet's
weights_version is the oldest any replica holds (all equal after a verified sync).

Like the rest of relayrl.roles, it may import relayrl.rollout and the layers below; never the loop or the jobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from relayrl.engine.sampling_params import SamplingParams
from relayrl.roles.rollout_worker import RolloutRole
from relayrl.rollout.router import Router
from relayrl.single_controller.liveness import GroupOptions

# the engine's figures, fleet-wide: counters add up; a peak is the highest replica's (with its utilisation)
SUMMED = ("engine/preemptions", "engine/reprefills", "engine/prefill_tokens", "engine/forked_samples",
          "engine/prefix_lookup_tokens")
PEAK = "engine/peak_blocks_used"
QUEUE_PEAKS = ("engine/peak_running", "engine/peak_waiting")  # fleet-wide: the busiest replica's


def wait_all(futures: list[Future]) -> list:
    """Every future's result, in order; the first error raised only after all of them ended."""
    out, error = [], None
    for f in futures:
        try:
            out.append(f.result())
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error
    return out


class RolloutFleet:
    """N rollout roles behind a router: a RolloutEngine (relayrl.engine.protocols)."""

    def __init__(self, replicas: list[RolloutRole], router: Router):
        if len(replicas) != router.replicas:
            raise ValueError(f"{len(replicas)} replicas for a router of {router.replicas}")
        self.replicas, self.router = replicas, router
        self.tokenizer, self.pad_id = replicas[0].tokenizer, replicas[0].pad_id
        self.tokens = [0] * len(replicas)  # tokens each generated since the last reset_stats
        self.busy = [0.0] * len(replicas)  # seconds each spent in generate calls since then
        self._pool = ThreadPoolExecutor(max_workers=len(replicas), thread_name_prefix="relayrl-fleet")

    @classmethod
    def own_processes(cls, n: int, model_dir, engine_kwargs: dict, options: GroupOptions, tokenizer,
                      device: str = "cpu", block_size: int = 16, router: dict | None = None) -> RolloutFleet:
        """n replicas, each the engine loaded from `model_dir` in a rollout worker of its own: all started, then
        all waited for (they build at once; on a failure every one is stopped). router: the Router's keyword
        arguments (rollout.router: cache_threshold, balance_abs, balance_rel)."""
        groups = []
        try:
            for r in range(n):
                groups.append(RolloutRole.start_process(model_dir, engine_kwargs, options, device, f"rollout{r}"))
        except BaseException:
            for g in groups:
                g.shutdown(raise_errors=False)
            raise
        started = []
        try:
            for g in groups:
                started.append(RolloutRole.ready(g, tokenizer))
        except BaseException:
            for g in groups:
                g.shutdown(raise_errors=False)
            raise
        return cls(started, Router(n, block_size, **(router or {})))

    # ------------------------------------------------------------------ every replica at once
    def _each(self, fn: Callable[[RolloutRole], object], which: Sequence[int] | None = None) -> list:
        """fn(replica) on each replica (those numbered in `which`), concurrently; results in that order. Every
        call is waited for before the first error is raised, so none is left in flight."""
        which = range(len(self.replicas)) if which is None else which
        return wait_all([self._pool.submit(fn, self.replicas[r]) for r in which])

    @property
    def weights_version(self) -> int:
        """The oldest weights any replica holds (a verified sync leaves them all at the same version)."""
        return min(r.weights_version for r in self.replicas)

    @property
    def versions(self) -> list[int]:
        return [r.weights_version for r in self.replicas]

    @property
    def asleep(self) -> int:
        return max(r.asleep for r in self.replicas)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]):
        """Each prompt routed (relayrl.rollout.router), each replica's share run by it at once; outputs in order."""
        if isinstance(prompts, (str, bytes)) or (not isinstance(params, SamplingParams)
                                                  and len(list(params)) != len(list(prompts))):
            return self.replicas[0].generate(prompts, params)  # the engine's own one-line error, before any routing
        prompts = list(prompts)
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        routed: list[tuple[int, int]] = []  # (replica, work) per prompt
        try:
            for p, sp in zip(prompts, params, strict=True):
                ids = self._ids(p)
                work = len(ids) + sp.n * sp.max_tokens
                routed.append((self.router.route(ids, work), work))
            shares: dict[int, list[int]] = {}
            for i, (r, _) in enumerate(routed):
                shares.setdefault(r, []).append(i)
            which = sorted(shares)
            futures = [self._pool.submit(self._generate_on, r, [prompts[i] for i in shares[r]],
                                         [params[i] for i in shares[r]]) for r in which]
            results = wait_all(futures)
        finally:
            for r, work in routed:
                self.router.done(r, work)
        outputs: list = [None] * len(prompts)
        for r, outs in zip(which, results, strict=True):
            for i, out in zip(shares[r], outs, strict=True):
                outputs[i] = out
                self.tokens[r] += sum(len(s.token_ids) for s in out.samples)
        return outputs

    def _generate_on(self, r: int, prompts: list, params: list[SamplingParams]):
        t0 = time.perf_counter()
        try:
            return self.replicas[r].generate(prompts, params)
        finally:
            self.busy[r] += time.perf_counter() - t0

    def _ids(self, prompt) -> list[int]:
        """The token ids the router keys a prompt by (relayrl's sources send ids; a string is tokenized as is)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return list(self.tokenizer(str(prompt), add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ weights (the sync reaches each replica itself)
    def load_weights(self, weights) -> int:
        weights = [(n, t) for n, t in weights]
        self._each(lambda role: role.load_weights(weights))
        self.router.forget()
        return self.weights_version

    def run_on_ranks(self, fn: Callable, *args) -> list:
        """fn on every rank of every replica: replica 0's ranks first, then replica 1's..."""
        return [x for part in self._each(lambda role: role.run_on_ranks(fn, *args)) for x in part]

    def begin_weight_update(self) -> None:
        self._each(RolloutRole.begin_weight_update)

    def end_weight_update(self) -> int:
        self._each(RolloutRole.end_weight_update)
        self.router.forget()  # the engines' caches of the old weights are no use to the new
        return self.weights_version

    def score(self, rows, temperature: float = 1.0):
        """Replica 0's logprobs (every replica holds the same, verified weights)."""
        return self.replicas[0].score(rows, temperature)

    def reset_prefix_cache(self) -> None:
        self._each(RolloutRole.reset_prefix_cache)
        self.router.forget()

    def sleep(self, level: int = 1) -> None:
        self._each(lambda role: role.sleep(level))
        if level:
            self.router.forget()  # a freed KV cache holds no prefix

    def wake(self) -> None:
        self._each(RolloutRole.wake)

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, float]:
        """The engines' figures fleet-wide (engine/*: counters summed, the peak replica's blocks, the prefix hit
        rate weighted by each replica's prompt tokens) and each replica's (fleet/replica<r>/*: requests, tokens,
        tokens per second of its generate calls, its KV blocks' peak share, the engine's prefix hit rate, the
        router's, requests sent for their cached prefix, weights version, the most sequences it ran and queued at
        once)."""
        per = self._each(RolloutRole.stats)
        out: dict[str, float] = {"fleet/replicas": float(len(self.replicas))}
        for key in SUMMED:
            if any(key in s for s in per):
                out[key] = float(sum(s.get(key, 0.0) for s in per))
        if any(PEAK in s for s in per):
            top = max(per, key=lambda s: s.get(PEAK, 0.0))
            out[PEAK] = top[PEAK]
            out["engine/block_utilisation_at_peak"] = top.get("engine/block_utilisation_at_peak", 0.0)
        # each replica's rate weighed by the tokens its engine looked up (every turn of an episode), else by the
        # prompt tokens routed to it
        prompt_tokens = [s.get("engine/prefix_lookup_tokens", c.prompt_tokens)
                         for s, c in zip(per, self.router.counters, strict=True)]
        if any("engine/prefix_hit_rate" in s for s in per):
            total = sum(prompt_tokens)
            out["engine/prefix_hit_rate"] = (sum(s.get("engine/prefix_hit_rate", 0.0) * w
                                                 for s, w in zip(per, prompt_tokens, strict=True)) / total
                                             if total else 0.0)
        for key in {k for s in per for k in s if k.startswith("engine/expert")}:
            out[key] = max(s.get(key, 0.0) for s in per)
        for key in QUEUE_PEAKS:
            if any(key in s for s in per):
                out[key] = max(s.get(key, 0.0) for s in per)
        for r, (s, c) in enumerate(zip(per, self.router.counters, strict=True)):
            pre = f"fleet/replica{r}/"
            out |= {pre + "requests": float(c.requests), pre + "tokens": float(self.tokens[r]),
                    pre + "tokens_per_s": self.tokens[r] / self.busy[r] if self.busy[r] else 0.0,
                    pre + "kv_peak": s.get(PEAK, 0.0),
                    pre + "prefix_hit_rate": s.get("engine/prefix_hit_rate", 0.0),
                    pre + "router_hit_rate": c.hit_rate, pre + "by_affinity": float(c.by_affinity),
                    pre + "version": float(self.replicas[r].weights_version),
                    pre + "running_peak": s.get("engine/peak_running", 0.0),
                    pre + "queue_peak": s.get("engine/peak_waiting", 0.0)}
        return out

    def reset_stats(self) -> None:
        self._each(RolloutRole.reset_stats)
        self.router.reset_counters()
        self.tokens = [0] * len(self.replicas)
        self.busy = [0.0] * len(self.replicas)

    def close(self) -> None:
        """Close every replica, each on its own (one that fails must not keep the others' processes alive)."""
        first = None
        for role in self.replicas:
            try:
                role.close()
            except Exception as e:
                first = first or e
        self._pool.shutdown(wait=True)
        if first is not None:
            raise first
