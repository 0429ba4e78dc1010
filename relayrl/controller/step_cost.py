"""What a step computed, and how much of the machine that was: model FLOPs, MFU and the rollout's tail.

    flops/update       ppo_epochs x tokens x (6N + 12 L H d T)   the actor's update (relayrl.models.flops):
                       tokens = rows x T padded (the trainer runs every micro-batch at the batch's width T),
                       or the real tokens with trainer.padding_free (T: the longest sequence, the packed rows'
                       capacity), each shared prompt once with trainer.shared_prefix (batch/trained_tokens;
                       batch/real_tokens: every row's own tokens, what the unshared form computes); with
                       trainer.lora, 4N + 6 N_adapters in place of 6N (the frozen base needs no weight gradient;
                       attention's 12 L H d T is the same)
    flops/old_logp     tokens x (2N + 4 L H d T)                 the proximal logprobs' recompute (decoupled PPO,
                                                                 when RunConfig.old_logp_source is recompute)
    flops/ref_logp     the same, on the reference model          (algo.kl_coef > 0)
    flops/rollout      sum over the step's samples of 2 (N - V h) x computed tokens + 2 V h x logit positions
                       + 4 L H d x keys attended, as the engine counted them (relayrl.engine.outputs.SampleCost:
                       the engine runs the lm_head at each sequence's last position of a model run only;
                       prefix-cache hits are not computed, preemptions' recomputes are; every generate() of
                       the step, resampled groups included); absent when the backend does not count (vLLM) or
                       for environment episodes

    throughput/mfu_update   flops/update  / (time/update x peak_trainer x trainer ranks)
    throughput/mfu_rollout  flops/rollout / (engine seconds x peak_engine x engine ranks); engine seconds are
                            time/rollout, or in an asynchronous run the step less the engine's idle wait
                            (time/step - time/wait_train): it generates beside the step
    throughput/peak_gflops_trainer, throughput/peak_gflops_engine: each rank's matmul peak
                            (relayrl.observe.peak, at the rank's threads and dtype)

    rollout/straggler_share  the tail's share of the rollout: of the engine steps during which any of the step's
                            samples was still unfinished (queued or decoding), the fraction during which at most
                            max(1, 10% of them) were. With a batch of fewer than 20 samples that is the longest
                            sample's share of the rollout it ran alone: (longest - second longest) / longest when
                            all are queued at once. Logged in rollout.mode=sync only (see straggler_share).

MFU and the peaks are timing-dependent and sit under throughput/, beside the other rates; the FLOPs and the
straggler share are functions of the samples and reproduce exactly.

Like the rest of the loop's package, it reaches the layers below through their protocols; it never
imports the roles, the jobs or relayrl.cli.
"""

from __future__ import annotations

import bisect

import torch

from relayrl.controller.config import RunConfig
from relayrl.engine.outputs import SampleCost
from relayrl.models.config import ModelShape, MoEShape
from relayrl.models.flops import forward_flops, generate_flops, lora_train_flops, train_flops
from relayrl.observe.peak import matmul_peak
from relayrl.parallel.device import resolve_device
from relayrl.rollout.sample import Sample
from relayrl.single_controller.liveness import GroupOptions
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.logprobs import computed_tokens, prompt_lens

TAIL = 0.10  # the tail: at most this share of the batch's samples still unfinished (and at least one)


def straggler_share(costs: list[SampleCost]) -> float | None:
    """The share of the engine steps with any of these samples unfinished during which at most
    max(1, 10% of them) were; None without finished samples.

    Why this form of "the longest sample's share of rollout time": a sample's own generation steps are no
    measure (under continuous batching every sample of a batch that fits decodes at every step, so the
    longest one's steps / the rollout's are ~1 always), while the steps in which only the longest samples are
    left are the rollout's tail, where a synchronous batch's slots sit idle: at share s, a fraction of at least
    (1 - k / n) s of the rollout's n x steps batch slots is empty (k = max(1, n / 10)). Sample i is unfinished
    at engine step t when added_step < t <= finished_step (steps count model runs; a sample queued after k
    steps can run in step k + 1)."""
    done = [c for c in costs if c.finished_step >= 0]
    if not done:
        return None
    k = max(1, int(TAIL * len(done)))
    added, finished = sorted(c.added_step for c in done), sorted(c.finished_step for c in done)
    busy = tail = 0
    for t in range(added[0] + 1, finished[-1] + 1):
        running = bisect.bisect_left(added, t) - bisect.bisect_left(finished, t)
        if running > 0:
            busy += 1
            tail += running <= k
    return tail / busy if busy else 0.0


def role_peaks(cfg: RunConfig) -> dict[str, tuple[float, int]]:
    """{"trainer" | "engine": (one rank's matmul peak in GFLOP/s, ranks)}. A role in the driver's own process
    runs torch's threads there; a worker rank runs GroupOptions' threads (the worker groups' setting). Both
    of relayrl's roles compute on parallel.device (a GPU's peak on CUDA, where the threads do not matter)."""
    par, r = cfg.parallel, cfg.rollout
    here, worker = torch.get_num_threads(), GroupOptions().threads
    device = resolve_device(par.device)
    out = {"trainer": (matmul_peak(device, "bfloat16" if cfg.trainer.bf16 else "float32",
                                   here if par.backend == "none" else worker),
                       1 if par.backend == "none" else par.world_size)}
    if r.backend == "vllm":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        out["engine"] = (matmul_peak(device, r.engine_dtype, here), 1)
    else:
        in_driver = par.backend == "none" and par.placement == "colocated" and not par.rollout_worker
        out["engine"] = (matmul_peak(device, r.engine_dtype, here if in_driver else worker), r.tp)
    return out


class StepCost:
    """Collects the step's samples (add) and turns them and the trained batch into the step's metrics."""

    def __init__(self, cfg: RunConfig, shape: ModelShape, peaks: dict[str, tuple[float, int]] | None = None):
        # an MoE model's FLOPs per token are those of its active shape (k experts' width, the router aside)
        self.cfg, self.shape = cfg, shape.active_shape() if isinstance(shape, MoEShape) else ModelShape.of(shape)
        self.peaks = role_peaks(cfg) if peaks is None else peaks
        self.samples: list[SampleCost] = []
        self.counted = True  # every sample so far came with its cost

    def add(self, samples: list[Sample]) -> None:
        for s in samples:
            if s.cost is None:
                self.counted = False
            else:
                self.samples.append(s.cost)

    def trained_tokens(self, batch: TrainBatch) -> tuple[int, int]:
        """(tokens one pass over the batch computes, keys each attends to)."""
        tc = self.cfg.trainer
        if tc.padding_free:
            lengths = batch.attention_mask.sum(-1)
            prefix = prompt_lens(batch.response_mask, batch.attention_mask) if tc.shares_prefix else None
            return (computed_tokens(batch.input_ids, batch.attention_mask, prefix),
                    int(lengths.max()))
        B, T = batch.input_ids.shape
        return B * T, T

    def metrics(self, batch: TrainBatch, times: dict[str, float], *, updated: bool) -> dict[str, float]:
        """flops/*, rollout/straggler_share and throughput/mfu_* of the step; `times` holds its time/* keys."""
        cfg, shape = self.cfg, self.shape
        tokens, keys = self.trained_tokens(batch)
        out: dict[str, float] = {"batch/trained_tokens": float(tokens),
                                 "batch/real_tokens": float(batch.attention_mask.sum())}
        if updated:
            lora = cfg.trainer.lora
            per_pass = (train_flops(shape, tokens, keys) if lora is None else
                        lora_train_flops(shape, tokens, keys, rank=lora.rank, targets=lora.target_modules))
            out["flops/update"] = float(cfg.trainer.ppo_epochs * per_pass)
        if cfg.old_logp_source() == "recompute":  # the update's own forward or the engine's logprobs cost nothing
            out["flops/old_logp"] = float(forward_flops(shape, tokens, keys))
        if cfg.algo.kl_coef > 0:
            out["flops/ref_logp"] = float(forward_flops(shape, tokens, keys))
        samples, counted = self.samples, self.counted
        self.samples, self.counted = [], True
        if samples and counted:
            out["flops/rollout"] = float(sum(generate_flops(shape, c.computed_tokens, c.attended, c.logit_positions)
                                             for c in samples))
        # sync only: an asynchronous engine fills the tail's free slots with the next groups (no idle slots to
        # report), and when each group is admitted between engine steps depends on timing, so the figure would
        # differ between two runs of the same seed (tests/e2e/test_async_run.py compares them key by key)
        share = straggler_share(samples) if cfg.rollout.mode == "sync" else None
        if share is not None:
            out["rollout/straggler_share"] = share
        peak_t, ranks_t = self.peaks["trainer"]
        peak_e, ranks_e = self.peaks["engine"]
        out["throughput/peak_gflops_trainer"], out["throughput/peak_gflops_engine"] = peak_t, peak_e
        if "flops/update" in out and times.get("time/update", 0.0) > 0:
            out["throughput/mfu_update"] = mfu(out["flops/update"], times["time/update"], peak_t, ranks_t)
        engine_s = times.get("time/rollout", 0.0)
        if cfg.rollout.mode != "sync":
            engine_s = times.get("time/step", 0.0) - times.get("time/wait_train", 0.0)
        if "flops/rollout" in out and engine_s > 0:
            out["throughput/mfu_rollout"] = mfu(out["flops/rollout"], engine_s, peak_e, ranks_e)
        return out


def mfu(flops: float, seconds: float, peak_gflops: float, ranks: int) -> float:
    """Model FLOPs utilisation: flops / (seconds x peak x ranks)."""
    return flops / (seconds * peak_gflops * 1e9 * ranks)
