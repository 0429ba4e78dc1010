"""The device path on a real GPU (skipped without CUDA; benchmarks/gpu_check.py runs the whole loop): what the CPU
tests can only check with meta tensors, checked against the CPU's numbers.

    the actor on cuda takes host batches, returns host logprobs equal to the CPU's, keeps its optimiser state
    on the device, and takes the CPU's update to rounding (fp32; bf16 autocast runs by the device's type)
    a run with parallel.device=cuda: trainer and engine agree to rounding on the GPU, memory/* logged
"""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.algorithms import AlgoConfig
from relayrl.jobs.train import train
from relayrl.models.transformer import CausalLM
from relayrl.trainer.actor import Actor
from relayrl.trainer.config import TrainerConfig
from tests.helpers import cfg_for, random_train_batch, small_config, step_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _actors(**trainer) -> tuple[Actor, Actor]:
    torch.manual_seed(0)
    cpu = CausalLM(small_config())
    gpu = copy.deepcopy(cpu).to("cuda")
    cfg = TrainerConfig(micro_batch_size=3, **trainer)
    return (Actor(cpu, cfg, AlgoConfig(), total_steps=1, seed=0), Actor(gpu, cfg, AlgoConfig(), total_steps=1, seed=0))


@pytest.mark.equivalence
def test_actor_on_cuda_matches_the_cpu_and_hands_back_host_tensors():
    a_cpu, a_gpu = _actors()
    batch = random_train_batch(8)
    lp_cpu, lp_gpu = a_cpu.compute_logprobs(batch), a_gpu.compute_logprobs(batch)
    assert lp_gpu.device.type == "cpu"
    torch.testing.assert_close(lp_gpu, lp_cpu, atol=1e-4, rtol=1e-4)
    batch.old_logp = lp_cpu
    s_cpu, s_gpu = a_cpu.update(batch), a_gpu.update(batch)
    for k in ("loss", "grad_norm", "clip_frac"):
        assert s_gpu[k] == pytest.approx(s_cpu[k], rel=1e-3, abs=1e-5), k
    state = next(iter(a_gpu.optimizer.state.values()))
    assert state["exp_avg"].is_cuda
    for p, q in zip(a_cpu.model.parameters(), a_gpu.model.parameters(), strict=True):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), atol=1e-4, rtol=1e-3)


@pytest.mark.equivalence
def test_bf16_autocast_on_cuda_runs_the_forward_in_bf16():
    _, a_gpu = _actors(bf16=True)
    seen = []
    a_gpu.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    a_gpu.compute_logprobs(random_train_batch(4))
    assert seen and set(seen) == {torch.bfloat16}


@pytest.mark.e2e
def test_a_cuda_run_keeps_trainer_and_engine_in_agreement_and_logs_memory(tmp_path):
    """fp32 on both sides, both on the GPU: the canary and the update's mismatch stay at rounding."""
    train(cfg_for(tmp_path, "gpu", run={"steps": 2, "save_every": 0}, parallel={"device": "cuda"}),
          show_progress=False)
    for m in step_metrics(tmp_path / "gpu"):
        assert m["sync/canary_gap"] < 1e-3 and m["mismatch/logp_abs_max"] < 1e-3
        assert 0 < m["memory/allocated_gib"] <= m["memory/reserved_gib"] and m["memory/peak_gib"] > 0
