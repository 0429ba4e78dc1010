"""What a step computed: the model's matmul weights, the engine's per-sample counts, the FLOPs and MFU
arithmetic, and a real run's flops/* and rollout/straggler_share against its own token counts."""

import statistics

import pytest

from relayrl.controller import driver as driver_mod
from relayrl.controller.run import train
from relayrl.controller.step_cost import StepCost, mfu, straggler_share
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.outputs import CompletionSample, RequestOutput, SampleCost
from relayrl.models import CausalLM, ModelConfig, load_pretrained
from relayrl.models.flops import matmul_params
from relayrl.observe import read_metrics
from relayrl.trainer.batch import TrainBatch, build_rows

from helpers import SYNC_CONFIGS, cfg_for, perturbed_model, small_config


def _matmul_weights(model: CausalLM) -> int:
    """benchmarks/bench_trainer.py's count: every 2-D parameter, an untied embedding left out (a lookup)."""
    n = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    return n - (0 if model.config.tie_word_embeddings else model.model.embed_tokens.weight.numel())


@pytest.mark.parametrize("shape", [small_config(), small_config(tie_word_embeddings=True), *SYNC_CONFIGS.values()])
def test_matmul_params_are_the_models_matmul_weights(shape):
    cfg = shape if isinstance(shape, ModelConfig) else ModelConfig(**shape)
    assert matmul_params(cfg) == _matmul_weights(CausalLM(cfg))


def test_small_config_by_hand():
    # hidden 32, 4 heads / 2 KV heads of 8, MLP 64, 2 layers, vocab 64:
    # per layer q, o 32 x 32 each, k, v 32 x 16 each, gate, up, down 32 x 64 each = 2048 + 1024 + 6144
    assert matmul_params(small_config()) == 2 * (2048 + 1024 + 6144) + 64 * 32


def test_engine_counts_each_samples_tokens_keys_and_steps():
    eng = LLMEngine.from_model(perturbed_model(small_config()), num_blocks=64, block_size=4,
                               enable_prefix_caching=False)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    budgets = [2, 6]
    params = [SamplingParams(n=2, max_tokens=m, ignore_eos=True, seed=i) for i, m in enumerate(budgets)]
    outs = eng.generate(prompts, params)
    for p, m, o in zip(prompts, budgets, outs, strict=True):
        for s in o.samples:
            # prefill P tokens, then one decode per token but the last (it is sampled, never run)
            n = len(p) + m - 1
            assert len(s.token_ids) == m
            assert s.cost == SampleCost(computed_tokens=n, attended=n * (n + 1) // 2, added_step=0, finished_step=m)
    assert eng.num_steps == 6
    # a later call's samples are queued at the engine's step count then
    again = eng.generate([prompts[0]], SamplingParams(max_tokens=3, ignore_eos=True, seed=9))
    assert again[0].samples[0].cost == SampleCost(computed_tokens=5, attended=15, added_step=6, finished_step=9)
    costs = [s.cost for o in outs for s in o.samples]
    # finishes 2, 2, 6, 6: median 4, last 6, first queued 0
    assert straggler_share(costs) == (6 - 4) / 6
    eng.close()


def test_straggler_share_by_hand():
    c = [SampleCost(added_step=10, finished_step=f) for f in (12, 13, 14, 30)]
    assert straggler_share(c) == (30 - 13.5) / (30 - 10)
    assert straggler_share([SampleCost(added_step=0, finished_step=4)] * 3) == 0.0  # all end together
    assert straggler_share([SampleCost()]) is None  # never finished (aborted)


def _batch():
    # prompts of 2 and 3 tokens, responses of 4, 1 and 2: rows of 6, 4 and 4 real tokens padded to T = 6
    ids, attn, resp = build_rows([[3, 4], [5, 6, 7], [3, 4]], [[8, 9, 10, 11], [12], [13, 14]])
    return TrainBatch(ids, attn, resp)


def test_flops_and_mfu_by_hand():
    cfg = cfg_for_model(trainer={"ppo_epochs": 2}, algo={"kl_coef": 0.1})
    shape = small_config()
    N, LHd = 20480, 2 * 4 * 8  # matmul weights (test_small_config_by_hand); layers x heads x head_dim
    cost = StepCost(cfg, shape, peaks={"trainer": (50.0, 2), "engine": (40.0, 1)})
    samples = [CompletionSample([1, 2], [0.0, 0.0], "", finish_reason="length",
                                cost=SampleCost(computed_tokens=4, attended=10, added_step=0, finished_step=2)),
               CompletionSample([1], [0.0], "", finish_reason="stop",
                                cost=SampleCost(computed_tokens=3, attended=6, added_step=0, finished_step=1))]
    cost.add([RequestOutput(0, [7, 7, 7], samples, 0)])
    times = {"time/update": 0.5, "time/rollout": 0.25, "time/step": 1.0}
    m = cost.metrics(_batch(), times, updated=True)
    B, T = 3, 6
    assert m["flops/update"] == 2 * B * T * (6 * N + 12 * LHd * T)
    assert m["flops/old_logp"] == m["flops/ref_logp"] == B * T * (2 * N + 4 * LHd * T)
    assert m["flops/rollout"] == 2 * N * (4 + 3) + 4 * LHd * (10 + 6)
    assert m["rollout/straggler_share"] == (2 - 1.5) / 2
    assert m["throughput/mfu_update"] == pytest.approx(m["flops/update"] / (0.5 * 50e9 * 2), rel=1e-12)
    assert m["throughput/mfu_rollout"] == pytest.approx(m["flops/rollout"] / (0.25 * 40e9 * 1), rel=1e-12)
    assert m["throughput/mfu_update"] == mfu(m["flops/update"], 0.5, 50.0, 2)
    # the samples were consumed: the next step counts its own
    again = cost.metrics(_batch(), times, updated=False)
    assert "flops/rollout" not in again and "flops/update" not in again and "throughput/mfu_update" not in again


def test_padding_free_counts_real_tokens_and_async_uses_the_engines_busy_time():
    cfg = cfg_for_model(trainer={"padding_free": True}, algo={"proximal": "behaviour"},
                        rollout={"mode": "async"}, parallel={"placement": "disaggregated"})
    cost = StepCost(cfg, small_config(), peaks={"trainer": (50.0, 1), "engine": (40.0, 2)})
    cost.add([RequestOutput(0, [1], [CompletionSample([1], [0.0], "", finish_reason="stop",
                                                      cost=SampleCost(computed_tokens=2, attended=3, finished_step=1))],
                            0)])
    m = cost.metrics(_batch(), {"time/update": 1.0, "time/rollout": 0.1, "time/step": 2.0, "time/wait_train": 0.5},
                     updated=True)
    N, LHd = 20480, 64
    assert m["flops/update"] == 14 * (6 * N + 12 * LHd * 6)  # 6 + 4 + 4 real tokens, rows of at most 6
    assert "flops/old_logp" not in m and "flops/ref_logp" not in m  # plain PPO, no KL: neither is computed
    assert m["throughput/mfu_rollout"] == pytest.approx(m["flops/rollout"] / ((2.0 - 0.5) * 40e9 * 2), rel=1e-12)


def test_a_backend_that_does_not_count_logs_no_rollout_flops():
    cost = StepCost(cfg_for_model(), small_config(), peaks={"trainer": (1.0, 1), "engine": (1.0, 1)})
    cost.add([RequestOutput(0, [1], [CompletionSample([1], [0.0], "", finish_reason="stop")], 0)])
    m = cost.metrics(_batch(), {"time/update": 1.0, "time/rollout": 1.0}, updated=True)
    assert "flops/rollout" not in m and "rollout/straggler_share" not in m and "flops/update" in m


def cfg_for_model(**sections):
    from relayrl.controller.config import RunConfig

    return RunConfig.from_dict({"rollout": {"prompts_per_step": 2, "group_size": 2}, **sections})


def test_a_run_logs_flops_and_stragglers_from_its_own_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    seen = []
    real = driver_mod.Driver.learn

    def learn(self, ro, *a, **kw):
        seen.append(ro)
        return real(self, ro, *a, **kw)

    monkeypatch.setattr(driver_mod.Driver, "learn", learn)
    cfg = cfg_for(tmp_path, "run", run={"steps": 2, "save_every": 0},
                  rollout={"enable_prefix_caching": False, "max_tokens": 10, "temperature": 1.5},
                  algo={"kl_coef": 0.05}, trainer={"ppo_epochs": 2})
    res = train(cfg, show_progress=False)
    steps = [m for m in read_metrics(res["run_dir"]) if "reward/mean" in m]
    assert len(steps) == len(seen) == 2
    model = load_pretrained(tmp_path / "run" / "final_model")
    N, c = _matmul_weights(model), model.config
    LHd = c.num_hidden_layers * c.num_attention_heads * c.head_dim
    for m, ro in zip(steps, seen, strict=True):
        P = [len(p) for p in ro.prompt_ids]
        ell = [len(r) for r in ro.response_ids]
        run = [p + r - 1 for p, r in zip(P, ell, strict=True)]  # what the engine ran per sample (no prefix cache)
        assert m["flops/rollout"] == sum(2 * N * n + 4 * LHd * n * (n + 1) // 2 for n in run)
        B, T = len(P), max(p + r for p, r in zip(P, ell, strict=True))
        assert m["flops/update"] == 2 * B * T * (6 * N + 12 * LHd * T)
        assert m["flops/old_logp"] == m["flops/ref_logp"] == B * T * (2 * N + 4 * LHd * T)
        # every sample queued at once and prefilled in one engine step: sample i ends on step len_i
        assert m["rollout/straggler_share"] == (max(ell) - statistics.median(ell)) / max(ell)
        assert m["throughput/mfu_update"] == pytest.approx(
            m["flops/update"] / (m["time/update"] * m["throughput/peak_gflops_trainer"] * 1e9), rel=1e-9)
        assert m["throughput/mfu_rollout"] == pytest.approx(
            m["flops/rollout"] / (m["time/rollout"] * m["throughput/peak_gflops_engine"] * 1e9), rel=1e-9)
    assert len({len(r) for ro in seen for r in ro.response_ids}) > 1  # lengths differ: the tail is measured
