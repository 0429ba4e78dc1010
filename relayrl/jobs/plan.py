"""`relayrl plan` and `relayrl sync-plan`: what a layout costs, printed. The CLI parses the flags; the work is here.

Like the rest of relayrl.jobs, this module must never import relayrl.cli.
"""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.errors import ConfigError


def sync_plan(a) -> int:
    import torch

    from relayrl.models import load_config
    from relayrl.sync.layout import EngineLayout, TrainerLayout
    from relayrl.sync.plan import plan_sync
    from relayrl.sync.presets import preset

    if (a.model is None) == (a.preset is None):
        raise ConfigError("relayrl sync-plan needs exactly one of --model DIR or --preset NAME")
    dtype = getattr(torch, a.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"--dtype {a.dtype!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
    shape = load_config(a.model) if a.model else preset(a.preset)
    trainer = TrainerLayout(tp=a.trainer_tp, dp_shard=a.trainer_dp, dp_replicate=a.trainer_dp_replicate)
    engine = EngineLayout(tp=a.engine_tp)
    if a.lora_rank is None:
        print(plan_sync(shape, trainer, engine).describe(dtype, layers=a.layers))
        return 0
    from relayrl.sync.adapters import AdapterShape

    lora = AdapterShape(a.lora_rank)
    print(plan_sync(shape, trainer, engine, lora, base=False).describe(dtype, layers=a.layers))
    full = max(plan_sync(shape, trainer, engine).bytes_per_dst_rank(dtype).values())
    adapters = max(plan_sync(shape, trainer, engine, lora, base=False).bytes_per_dst_rank(dtype).values())
    print(f"\nbytes per engine rank per sync (the largest rank): full weights {full / 2**20:.2f} MiB, "
          f"adapters only {adapters / 2**20:.2f} MiB: full / adapters = {full / adapters:.1f}x")
    return 0


def plan_model_shape(model_dir: str):
    """The shape `relayrl plan --model DIR` plans: an MoE config (num_experts / num_local_experts) as
    relayrl.planner.moe reads it, any other as relayrl loads it. Only config.json is read."""
    from relayrl.config import parse_json
    from relayrl.models import load_config
    from relayrl.models.config import ModelShape

    try:
        raw = parse_json((Path(model_dir) / "config.json").read_text())  # bounded: a 100k-deep file is malformed
    except (OSError, ValueError):
        raw = None  # load_config says what is wrong with the directory, in one line
    if isinstance(raw, dict) and ("num_experts" in raw or "num_local_experts" in raw):
        from relayrl.planner.moe import moe_shape_from_hf

        try:
            return moe_shape_from_hf(raw)
        except (KeyError, TypeError) as e:
            raise ConfigError(f"{model_dir}/config.json: missing or malformed field {e}") from None
    return ModelShape.of(load_config(model_dir))


def plan(a) -> int:
    from relayrl.planner import Workload, make_plan
    from relayrl.planner.table import render

    if a.texts:
        from relayrl.planner import texts

        print(json.dumps([vars(f) for f in texts.figures()], indent=1) if a.json else texts.render())
        return 0
    if (a.model is None) == (a.preset is None):
        raise ConfigError("relayrl plan needs exactly one of --model DIR or --preset NAME (or --texts)")
    for flag in ("gpus", "gpu_mem", "seq", "micro_batch"):
        if getattr(a, flag) is None:
            raise ConfigError(f"relayrl plan needs --{flag.replace('_', '-')}")
    if a.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {a.gpus}")
    if not 0 < a.efficiency <= 1:
        raise ConfigError(f"--efficiency must be in (0, 1], got {a.efficiency}")
    if a.lora_sync is not None and not a.lora_rank:
        raise ConfigError("--lora-sync needs --lora-rank (it says how the engine holds LoRA adapters)")
    from relayrl.planner.search import preset_shape

    shape = plan_model_shape(a.model) if a.model else preset_shape(a.preset)
    w = Workload(seq=a.seq, micro_batch=a.micro_batch, dtype=a.dtype, mixed_precision=a.dtype != "float32",
                 recompute=a.recompute, lora_rank=a.lora_rank, num_micro_batches=a.micro_batches)
    plan = make_plan(shape, a.model or a.preset, w, gpus=a.gpus, gpu_mem_gib=a.gpu_mem, nodes=a.nodes,
                     intra_bw=a.intra_bw, inter_bw=a.inter_bw, peak_tflops=a.peak_tflops,
                     lora_sync=a.lora_sync or "separate", hbm_gbs=a.hbm_bw, efficiency=a.efficiency,
                     replicas=a.replicas, engine_tp=a.engine_tp)
    print(json.dumps(plan.to_dict(), indent=1) if a.json else render(plan, top=a.top))
    return 0
