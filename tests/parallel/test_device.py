"""The device setting (parallel.device / sft.device) and what follows from it, checked on a CPU:

resolution (auto / cpu / cuda, cuda refused in one line without a GPU), the process-group backend torch parses,
the trainer's models built on the resolved device (meta stands in for a GPU), micro-batches moved to the model's
device, autocast by the model's device type, CUDA memory figures, and a run with parallel.device=cpu equal to
the default one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.distributed_c10d import BackendConfig

from relayrl.algorithms import AlgoConfig
from relayrl.errors import ConfigError
from relayrl.jobs import build as build_module
from relayrl.jobs.base_model import base_model_dir
from relayrl.jobs.build import build_policy
from relayrl.jobs.train import train
from relayrl.models.transformer import CausalLM
from relayrl.observe import device_memory
from relayrl.observe.device_memory import GIB, device_memory_metrics
from relayrl.parallel.device import module_device, process_group_backend, resolve_device
from relayrl.roles import group_policy
from relayrl.single_controller.resource_pool import ResourcePool
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.config import TrainerConfig
from relayrl.trainer.sft import SFTTrainer
from tests.helpers import cfg_for, small_config, step_metrics


def _cuda(monkeypatch, available: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


# ---------------------------------------------------------------------------- resolution
@pytest.mark.unit
def test_auto_is_cuda_exactly_when_torch_sees_one(monkeypatch):
    _cuda(monkeypatch, True)
    assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu" and resolve_device("cuda") == "cuda"
    _cuda(monkeypatch, False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"


@pytest.mark.unit
def test_cuda_without_a_gpu_is_refused_in_one_line_naming_the_key(monkeypatch):
    _cuda(monkeypatch, False)
    with pytest.raises(ConfigError, match=r"^parallel\.device=cuda, but torch sees no CUDA device") as e:
        resolve_device("cuda")
    assert "\n" not in str(e.value) and "parallel.device=cpu or auto" in str(e.value)
    with pytest.raises(ConfigError, match=r"^sft\.device=cuda"):
        resolve_device("cuda", "sft.device")
    with pytest.raises(ConfigError, match="expected one of auto, cpu, cuda"):
        resolve_device("gpu")


@pytest.mark.e2e
def test_train_refuses_cuda_before_writing_anything(tmp_path, monkeypatch):
    _cuda(monkeypatch, False)
    cfg = cfg_for(tmp_path, "run", parallel={"device": "cuda"})
    with pytest.raises(ConfigError, match=r"^parallel\.device=cuda"):
        train(cfg, show_progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.unit
def test_process_group_backend_sends_cpu_tensors_over_gloo_and_cuda_ones_over_nccl():
    assert process_group_backend("cpu") == "gloo"
    # the string torch's init_process_group parses into a backend per device type
    assert BackendConfig(process_group_backend("cuda:1")).get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}
    with pytest.raises(ConfigError, match="no collective backend known for device type 'meta'"):
        process_group_backend("meta")


# ---------------------------------------------------------------------------- the trainer on its device
def _tiny() -> CausalLM:
    return CausalLM(small_config(vocab_size=32, num_hidden_layers=1))


def _full_batch(n: int = 4, T: int = 6) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    per_token = {k: torch.randn(n, T, generator=g) for k in ("old_logp", "rollout_logp", "ref_logp", "values",
                                                              "returns")}
    routing = torch.randint(0, 4, (n, T, 2, 2), generator=g).to(torch.int16)  # an MoE batch's [B, T, n_moe, k]
    return TrainBatch(torch.randint(0, 32, (n, T), generator=g), torch.ones(n, T, dtype=torch.long),
                      torch.ones(n, T), advantages=torch.randn(n, generator=g), routing=routing, **per_token)


@pytest.mark.unit
def test_batch_to_moves_every_tensor_field_and_keeps_values():
    b = _full_batch()
    fields = [f.name for f in dataclasses.fields(b)]
    assert all(getattr(b, f) is not None for f in fields)  # every field is exercised
    moved = b.to("meta")
    assert {f: getattr(moved, f).device.type for f in fields} == dict.fromkeys(fields, "meta")
    assert all(getattr(moved, f).shape == getattr(b, f).shape and getattr(moved, f).dtype == getattr(b, f).dtype
               for f in fields)
    same = b.to("cpu")  # already there: the very tensors, no copy
    assert all(getattr(same, f) is getattr(b, f) for f in fields)
    assert TrainBatch(b.input_ids, b.attention_mask, b.response_mask).to("meta").old_logp is None


@pytest.mark.unit
def test_actor_micro_batches_go_to_the_models_device():
    model = _tiny().to("meta")
    actor = Actor(model, TrainerConfig(micro_batch_size=3), AlgoConfig(), total_steps=1)
    assert actor.device == module_device(model) == torch.device("meta")
    batch = _full_batch(n=5)
    mbs = list(actor._micro_batches(batch, batch))
    assert [len(mb) for mb, _ in mbs] == [2, 3] and all(real for _, real in mbs)
    assert {getattr(mb, f.name).device.type for mb, _ in mbs for f in dataclasses.fields(mb)} == {"meta"}
    assert SFTTrainer(_tiny().to("meta"), TrainerConfig(), 1).device == torch.device("meta")


@pytest.mark.unit
def test_autocast_takes_the_device_type_of_the_model():
    actor = Actor(_tiny(), TrainerConfig(bf16=True), AlgoConfig(), total_steps=1)
    ctx = actor._autocast()
    assert isinstance(ctx, torch.autocast) and ctx.device == "cpu" and ctx.fast_dtype == torch.bfloat16
    actor.device = torch.device("cuda", 0)  # where a GPU worker's model is: no "cpu" left hard-coded
    with pytest.warns(UserWarning):  # this torch has no CUDA; the context is still made for the model's type
        assert actor._autocast().device == "cuda"
    assert not isinstance(Actor(_tiny(), TrainerConfig(), AlgoConfig(), total_steps=1)._autocast(), torch.autocast)


@pytest.mark.unit
def test_a_single_process_policy_builds_every_model_on_the_resolved_device(tmp_path, monkeypatch):
    """The actor, the reference and PPO's critic (backend none, inline workers): meta stands in for the GPU
    resolve_device picks (its pool hands rank 0 cuda:0)."""
    monkeypatch.setattr(group_policy, "resolve_device", lambda setting, key="parallel.device": "cuda")
    monkeypatch.setattr(ResourcePool, "device_for", lambda pool, rank: {"cuda": "meta"}[pool.device_type])
    cfg = cfg_for(tmp_path, "run", algo={"kl_coef": 0.1, "advantage": "gae"}, critic={})
    src = base_model_dir(cfg.model.path, cfg.model.tiny, cfg.data, tmp_path / "run")
    policy = build_policy(cfg, src)
    actor, critic = _inline_attr(policy.actor, "actor"), _inline_attr(policy.critic, "critic")
    models = {"actor": actor.model, "reference": _inline_attr(policy.ref, "reference").model, "critic": critic.model}
    assert {k: {p.device.type for p in m.parameters()} for k, m in models.items()} == dict.fromkeys(models, {"meta"})
    assert actor.device.type == critic.device.type == "meta"


def _inline_attr(role, name: str):
    """An attribute of an inline role's one worker: the object itself (nothing crosses a process)."""
    return role.execute_all("__getattribute__", name)[0]


# ---------------------------------------------------------------------------- memory figures
@pytest.mark.unit
def test_memory_figures_only_on_cuda_in_gib_with_the_peak_reset(monkeypatch):
    assert device_memory_metrics("cpu") == {}
    resets = []
    fake = {"memory_allocated": 3 * GIB / 2, "memory_reserved": 2 * GIB, "max_memory_allocated": 5 * GIB / 2}
    for name, value in fake.items():
        monkeypatch.setattr(device_memory.torch.cuda, name, lambda dev, v=value: int(v))
    monkeypatch.setattr(device_memory.torch.cuda, "reset_peak_memory_stats", lambda dev: resets.append(dev))
    assert device_memory_metrics("cuda:1") == {"memory/allocated_gib": 1.5, "memory/reserved_gib": 2.0,
                                               "memory/peak_gib": 2.5}
    assert resets == [torch.device("cuda", 1)]  # the next step's peak is its own


# ---------------------------------------------------------------------------- the same run
@pytest.mark.e2e
def test_a_run_on_parallel_device_cpu_equals_the_default_run(tmp_path, monkeypatch):
    _cuda(monkeypatch, False)  # the default (auto) is the CPU here even where a GPU is present
    a = cfg_for(tmp_path, "auto", run={"steps": 2, "save_every": 0})
    b = cfg_for(tmp_path, "cpu", run={"steps": 2, "save_every": 0}, parallel={"device": "cpu"})
    assert a.parallel.device == "auto" and b.parallel.device == "cpu"
    train(a, show_progress=False)
    train(b, show_progress=False)
    ma, mb = step_metrics(tmp_path / "auto"), step_metrics(tmp_path / "cpu")
    assert len(ma) == len(mb) == 2
    for x, y in zip(ma, mb, strict=True):
        figures = {k for k in x if not k.startswith(("time/", "throughput/", "comm/", "flops/", "rollout/straggler"))}
        assert {k: x[k] for k in figures} == {k: y[k] for k in figures}  # bit for bit: loss, grad_norm, rewards
        assert not any(k.startswith("memory/") for k in x)  # CUDA figures only


@pytest.mark.unit
def test_mfu_peaks_are_those_of_the_device_the_roles_compute_on(tmp_path, monkeypatch):
    from relayrl.controller import step_cost

    asked = []
    monkeypatch.setattr(step_cost, "matmul_peak", lambda device, dtype, threads: asked.append((device, dtype)) or 1.0)
    monkeypatch.setattr(step_cost, "resolve_device", lambda setting: {"auto": "cuda", "cpu": "cpu"}[setting])
    step_cost.role_peaks(cfg_for(tmp_path, "gpu", trainer={"bf16": True}, rollout={"engine_dtype": "bfloat16"}))
    assert asked == [("cuda", "bfloat16"), ("cuda", "bfloat16")]  # not the host's peak under a GPU's FLOPs
    asked.clear()
    step_cost.role_peaks(cfg_for(tmp_path, "host", parallel={"device": "cpu"}))
    assert asked == [("cpu", "float32"), ("cpu", "float32")]


@pytest.mark.e2e
def test_sft_refuses_cuda_before_writing_anything(tmp_path, monkeypatch):
    from relayrl.jobs.sft import SFTJobConfig, run_sft

    _cuda(monkeypatch, False)
    cfg = SFTJobConfig.from_dict({"data": {"task": "arith", "n_train": 16, "n_eval": 4},
                                  "sft": {"steps": 1, "out_dir": str(tmp_path / "sft"), "device": "cuda"}})
    with pytest.raises(ConfigError, match=r"^sft\.device=cuda, but torch sees no CUDA device"):
        run_sft(cfg, show_progress=False)
    assert not (tmp_path / "sft").exists()


@pytest.mark.unit
def test_reward_models_are_built_on_the_resolved_device(tmp_path, monkeypatch):
    """In the driver (backend none) and in their worker group (local): the device the trainer computes on."""
    built = []

    class Recorder:
        def __init__(self, entries, options=None, device: str = "cpu"):
            built.append((options.backend if options is not None else None, device))

        def close(self):
            pass

    monkeypatch.setattr(build_module, "resolve_device", lambda setting, key="parallel.device": "cuda")
    monkeypatch.setattr(build_module, "model_entries", lambda reward_cfg: ["an entry"])
    monkeypatch.setattr(build_module, "ModelScorer", Recorder)
    for backend in ("none", "local"):
        build_module.build_scorer_for(cfg_for(tmp_path, backend, parallel={"backend": backend})).close()
    assert built == [(None, "cuda"), ("local", "cuda")]  # inline (no options) in the driver, else its own process
