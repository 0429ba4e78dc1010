"""The weight sync with LoRA: the plan moves each engine rank exactly its adapter shard (stacked A, B rows of
its own heads, KV heads replicated as the engine replicates them); the engine, adapters kept apart or
merged, computes what the trainer's LoRA model computes; every sync after the first sends the adapters
only; a misplaced adapter piece is caught and named."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.lora import enable_lora, merge_lora, sync_params
from relayrl.engine.model import EngineModel
from relayrl.engine.parallel_state import TPInfo
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.models.lora import apply_lora, lora_modules, merged_state
from relayrl.roles.group_policy import GroupPolicy
from relayrl.roles.weight_sync import PlannedWeightSync, SyncVerificationError
from relayrl.sync.adapters import AdapterShape
from relayrl.sync.apply import execute_plan, shard_state_dict
from relayrl.sync.config import SyncConfig
from relayrl.sync.layout import EngineLayout, TrainerLayout, logical_tensors
from relayrl.sync.plan import plan_sync
from relayrl.sync.presets import PRESETS

from helpers import SYNC_CONFIGS, colocated_engine, inline_policy, policy_model

CONFIGS = {**SYNC_CONFIGS,
           "tiny-gqa": dict(model_type="qwen2", **dataclasses.asdict(PRESETS["tiny-gqa"]))}
R, ALPHA = 3, 6.0  # rank 3: FSDP's dim-0 chunks of A come out uneven (2 + 1) or empty (dp 4)
TRAINER = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4)]
ENGINE_TP = (1, 2, 4)


def _cfg(key: str) -> ModelConfig:
    return ModelConfig(**CONFIGS[key])


def _lora_model(cfg: ModelConfig, seed: int = 0, targets=None) -> CausalLM:
    """A LoRA model with random base and random non-zero adapters (B = 0 would hide every misplaced A)."""
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    apply_lora(model, R, ALPHA, **({"targets": targets} if targets else {}))
    _new_adapters(model, seed + 1)
    return model


@torch.no_grad()
def _new_adapters(model, seed: int) -> None:
    """What an update does: new adapter values, the base untouched."""
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(model).values():
        m.lora_A.copy_(torch.randn(m.lora_A.shape, generator=g) * 0.5)
        m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.5)


def _cases():
    for key, (tp, dp), etp in itertools.product(CONFIGS, TRAINER, ENGINE_TP):
        cfg = CONFIGS[key]
        if cfg["num_key_value_heads"] % tp or cfg["num_attention_heads"] % etp:
            continue
        if not (cfg["num_key_value_heads"] % etp == 0 or etp % cfg["num_key_value_heads"] == 0):
            continue
        yield pytest.param(key, tp, dp, etp, id=f"{key}-t{tp}x{dp}-e{etp}")


# ---------------------------------------------------------------------------- the plan
@pytest.mark.unit
@pytest.mark.parametrize("key,tp,dp,etp", list(_cases()))
def test_adapter_plan_fills_each_engine_rank_with_its_shard_and_merges_to_the_loaders_weights(key, tp, dp, etp):
    """Per engine rank: the adapters-only plan delivers exactly the engine's adapter slots (bytes = their
    size, every element written), and base + s * B @ A per rank equals the engine's own loader given the
    merged full weights: every A row block and B row (KV heads replicated) sits where it belongs."""
    cfg = _cfg(key)
    model = _lora_model(cfg)
    lora = AdapterShape(R)
    full = {k: v.detach() for k, v in model.state_dict().items()}
    tl, el = TrainerLayout(tp=tp, dp_shard=dp), EngineLayout(etp)
    sources = {r: shard_state_dict(full, cfg, tl, r, lora) for r in range(tl.world_size)}
    base_plan, adapter_plan = plan_sync(cfg, tl, el), plan_sync(cfg, tl, el, lora, base=False)
    assert {t.name for t in adapter_plan.transfers} == set(logical_tensors(cfg, lora, base=False))
    merged = merged_state(model)
    for r in range(etp):
        eng = EngineModel(cfg, TPInfo(r, etp))
        enable_lora(eng, R, ALPHA / R, lora.targets, "merge")
        slots = {n: p for n, p in eng.named_parameters() if n.endswith((".lora_A", ".lora_B"))}
        assert dict(adapter_plan.param_shapes[r]) == {n: tuple(p.shape) for n, p in slots.items()}
        slot_bytes = sum(p.numel() for p in slots.values()) * 2
        assert adapter_plan.bytes_per_dst_rank(torch.bfloat16)[r] == slot_bytes  # its adapter shard, nothing more
        params = sync_params(eng, {n: p.data for n, p in eng.named_parameters()})
        for t in params.values():
            t.fill_(float("nan"))  # anything the plans miss shows
        execute_plan(base_plan, sources, {r: params})
        execute_plan(adapter_plan, sources, {r: params})
        merge_lora(eng)
        ref = EngineModel(cfg, TPInfo(r, etp))
        ref.load_weights(merged.items())
        for name, want in ref.named_parameters():
            got = dict(eng.named_parameters())[name]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"engine rank {r} {name}")


@pytest.mark.unit
def test_first_sync_sends_base_and_adapters_every_later_one_adapters_only():
    """Bytes per engine rank: the full plan = base shard + adapter shard; the later syncs only the latter."""
    cfg, lora = _cfg("tiny-gqa"), AdapterShape(16)
    tl, el = TrainerLayout(tp=2, dp_shard=2), EngineLayout(4)
    base = plan_sync(cfg, tl, el).bytes_per_dst_rank(torch.bfloat16)
    full = plan_sync(cfg, tl, el, lora).bytes_per_dst_rank(torch.bfloat16)
    adapters = plan_sync(cfg, tl, el, lora, base=False).bytes_per_dst_rank(torch.bfloat16)
    assert all(full[r] == base[r] + adapters[r] and 0 < adapters[r] for r in range(4))


@pytest.mark.e2e
def test_sync_plan_cli_prints_full_and_adapter_bytes_and_their_ratio(capsys):
    from relayrl.cli.main import main

    assert main(["sync-plan", "--preset", "qwen2.5-7b", "--engine-tp", "2", "--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    shape, tl, el = PRESETS["qwen2.5-7b"], TrainerLayout(), EngineLayout(2)
    full = max(plan_sync(shape, tl, el).bytes_per_dst_rank(torch.bfloat16).values())
    adapters = max(plan_sync(shape, tl, el, AdapterShape(16), base=False).bytes_per_dst_rank(torch.bfloat16).values())
    assert f"full weights {full / 2**20:.2f} MiB" in out
    assert f"adapters only {adapters / 2**20:.2f} MiB" in out
    assert f"full / adapters = {full / adapters:.1f}x" in out


# ---------------------------------------------------------------------------- one process, through the driver's sync
def _policy(key: str = "gqa8x2", **lora_kw) -> GroupPolicy:
    model = _lora_model(_cfg(key), **lora_kw)
    return inline_policy(model, torch.float32)  # with the colocated engine's rank


def _sync(policy, mode: str, dtype=torch.float32, **cfg) -> tuple[PlannedWeightSync, LLMEngine]:
    model = policy_model(policy)
    config = model.config
    engine = colocated_engine(policy, dtype)
    targets = tuple(sorted({n.rsplit(".", 1)[-1] for n in lora_modules(model)}))
    ws = PlannedWeightSync(policy, engine, shape=ModelShape.of(config), trainer_layout=TrainerLayout(), engine_tp=1,
                           colocated=True, engine_dtype=dtype, trainer_dtype=torch.float32, temperature=1.0,
                           cfg=SyncConfig(lora=mode, **cfg), lora=AdapterShape(R, targets), lora_scaling=ALPHA / R)
    return ws, engine


def _trainer_vs_engine(ws: PlannedWeightSync) -> float:
    from relayrl.trainer.batch import TrainBatch

    ids = torch.tensor(ws.rows)
    trainer = ws.policy.compute_logprobs(TrainBatch(ids, torch.ones_like(ids), torch.ones(ids.shape)))
    return float((trainer[:, 1:] - ws.engine.score(ws.rows)[:, 1:]).abs().max())


@pytest.mark.equivalence
@pytest.mark.parametrize("mode", ["separate", "merge"])
def test_engine_equals_trainer_after_every_sync_and_later_syncs_send_adapters_only(mode):
    policy = _policy()
    ws, _ = _sync(policy, mode)
    m = ws.sync("first")
    assert m["sync/adapters_only"] == 0 and m["sync/canary_gap"] < 1e-6
    assert _trainer_vs_engine(ws) < 1e-5
    full_bytes = m["sync/bytes_per_engine_rank"]
    for step in range(2):
        _new_adapters(policy_model(policy), 100 + step)  # an update moved the adapters
        assert _trainer_vs_engine(ws) > 0.1  # the engine is stale until the sync
        m = ws.sync(f"step {step}")
        assert m["sync/adapters_only"] == 1 and m["sync/canary_gap"] < 1e-6
        assert _trainer_vs_engine(ws) < 1e-5
        adapters = ws.adapters_spec.plan.bytes_per_dst_rank(torch.float32)[0]
        assert m["sync/bytes_per_engine_rank"] == m["sync/bytes_copied_in_place"] == adapters < full_bytes / 2


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["separate", "merge"])
def test_some_targets_only(mode):
    """q and v only, no MLP: qkv_proj's adapters hold two parts (A rows 0:r, r:2r; B: q rows then v rows)."""
    policy = _policy(targets=("q_proj", "v_proj", "o_proj"))
    ws, _ = _sync(policy, mode)
    assert ws.sync()["sync/canary_gap"] < 1e-6
    _new_adapters(policy_model(policy), 7)
    assert ws.sync()["sync/canary_gap"] < 1e-6
    assert _trainer_vs_engine(ws) < 1e-5


def _swap_kv_rows(runner, mode: str) -> None:
    """Misplace one adapter piece: layer 0's K rows of qkv_proj.lora_B swapped with its V rows."""
    b = runner.model.layers[0].self_attn.qkv_proj.lora_B.data
    nq, nkv = 8 * 4, 2 * 4
    k, v = b[nq:nq + nkv].clone(), b[nq + nkv:nq + 2 * nkv].clone()
    b[nq:nq + nkv], b[nq + nkv:nq + 2 * nkv] = v, k
    if mode == "merge":
        runner.merge_lora()


@pytest.mark.faults
@pytest.mark.parametrize("mode", ["separate", "merge"])
def test_a_misplaced_adapter_piece_is_caught_and_named(mode):
    policy = _policy()
    ws, engine = _sync(policy, mode)
    ws.sync()
    _new_adapters(policy_model(policy), 3)
    ws.sync()
    engine.run_on_ranks(_swap_kv_rows, mode)
    with pytest.raises(SyncVerificationError,
                       match=r"engine rank 0 layers\.0\.self_attn\.qkv_proj\.lora_B \[32:40, 0:3\] "
                             r"\(= model\.layers\.0\.self_attn\.k_proj\.lora_B"):
        ws.verify("a swapped adapter")


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["separate", "merge"])
def test_deep_sleep_resends_the_base(mode):
    policy = _policy()
    ws, engine = _sync(policy, mode)
    ws.sync()
    engine.sleep(2)  # the weights (and merge's base copies) are released
    _new_adapters(policy_model(policy), 5)
    m = ws.sync()
    assert m["sync/adapters_only"] == 0 and m["sync/canary_gap"] < 1e-6
    assert _trainer_vs_engine(ws) < 1e-5


@pytest.mark.unit
def test_merged_engine_generates_as_a_plain_engine_with_the_merged_weights():
    """Greedy output (and its logprobs) of the merge-mode engine equal a plain engine loaded with
    W + s * B @ A; the separate-mode engine's too."""
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for mode in ("merge", "separate"):
        policy = _policy()
        ws, engine = _sync(policy, mode)
        ws.sync()
        _new_adapters(policy_model(policy), 11)
        ws.sync()
        outs[mode] = engine.generate(prompts, sp)
    model = policy_model(policy)
    plain = LLMEngine(model.config, dtype=torch.float32, kv_cache_bytes=1 << 16)
    plain.load_weights(merged_state(model).items())
    want = plain.generate(prompts, sp)
    for mode, got in outs.items():
        for a, b in zip(got, want, strict=True):
            assert a.samples[0].token_ids == b.samples[0].token_ids, mode
            assert a.samples[0].logprobs == pytest.approx(b.samples[0].logprobs, abs=1e-5), mode
    assert len({tuple(o.samples[0].token_ids) for o in want}) > 1  # not a degenerate model


# ---------------------------------------------------------------------------- through the driver
@pytest.mark.e2e
def test_a_lora_run_syncs_adapters_only_and_both_engine_modes_give_the_same_run(tmp_path):
    """trainer.lora set: every step's sync sends the adapters only (the base went with the first evaluation's sync,
    which step 1 then skips), verified; the engine keeping them apart or merging them samples the same rollouts."""
    from relayrl.controller.config import RunConfig
    from relayrl.jobs.train import train

    from helpers import EXACT, group_cfg, step_metrics

    runs = {}
    for mode in ("separate", "merge"):
        d = group_cfg(tmp_path, mode).to_dict()
        d["run"]["steps"] = 3
        d["trainer"].update(lora={"rank": 4, "alpha": 8.0}, lr=1e-2)
        d["sync"]["lora"] = mode
        runs[mode] = step_metrics(train(RunConfig.from_dict(d), show_progress=False)["run_dir"])
    # the adapters of SMALL's model: hidden 32, MLP 64, 4 Q / 2 KV heads of 8, 2 layers; r (in + out) each, fp32
    h, i, q, kv = 32, 64, 32, 16
    adapter_bytes = 2 * 4 * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)) * 4
    for a, b in zip(runs["separate"], runs["merge"], strict=True):
        for k in EXACT:
            assert a[k] == b[k], k
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        for m in (a, b):
            assert m["sync/canary_gap"] < 1e-5
            if m["sync/skipped"]:  # step 1: the first evaluation's sync (base and adapters) is the step's
                assert m["step"] == 1 and m["sync/adapters_only"] == 0
                continue
            assert m["sync/adapters_only"] == 1
            assert m["sync/bytes_per_engine_rank"] == m["sync/bytes_copied_in_place"] == adapter_bytes
    assert len(runs["separate"]) == 3
    assert [m["sync/skipped"] for m in runs["separate"]] == [1.0, 0.0, 0.0]
