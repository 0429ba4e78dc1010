"""What a step computed: the model's matmul weights, the engine's per-sample counts (prefix-cache hits not
counted, one logit position per model run), the FLOPs and MFU arithmetic (LoRA's too), the straggler share,
and a real run's flops/* and rollout/straggler_share against a hand count from its own token lengths."""

import pytest

from relayrl.controller import driver as driver_mod
from relayrl.controller.step_cost import StepCost, mfu, straggler_share
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.engine.outputs import CompletionSample, RequestOutput, SampleCost
from relayrl.jobs.train import train
from relayrl.models import CausalLM, ModelConfig, load_pretrained
from relayrl.models.flops import adapter_params, lora_train_flops, matmul_params
from relayrl.observe import read_metrics
from relayrl.rollout.sample import samples_of_outputs
from relayrl.trainer.batch import TrainBatch, build_rows

from helpers import SYNC_CONFIGS, cfg_for, perturbed_model, small_config


def _matmul_weights(model: CausalLM) -> int:
    """benchmarks/bench_trainer.py's count: every 2-D parameter, an untied embedding left out (a lookup)."""
    n = sum(p.numel() for p in model.parameters() if p.ndim == 2)
    return n - (0 if model.config.tie_word_embeddings else model.model.embed_tokens.weight.numel())


@pytest.mark.unit
@pytest.mark.parametrize("shape", [small_config(), small_config(tie_word_embeddings=True), *SYNC_CONFIGS.values()])
def test_matmul_params_are_the_models_matmul_weights(shape):
    cfg = shape if isinstance(shape, ModelConfig) else ModelConfig(**shape)
    assert matmul_params(cfg) == _matmul_weights(CausalLM(cfg))


@pytest.mark.unit
def test_small_config_by_hand():
    # hidden 32, 4 heads / 2 KV heads of 8, MLP 64, 2 layers, vocab 64:
    # per layer q, o 32 x 32 each, k, v 32 x 16 each, gate, up, down 32 x 64 each = 2048 + 1024 + 6144
    assert matmul_params(small_config()) == 2 * (2048 + 1024 + 6144) + 64 * 32


@pytest.mark.unit
def test_engine_counts_each_samples_tokens_keys_and_steps():
    eng = LLMEngine.from_model(perturbed_model(small_config()), num_blocks=64, block_size=4,
                               enable_prefix_caching=False, fork_samples=False)  # forks: engine/test_forked_samples.py
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    budgets = [2, 6]
    params = [SamplingParams(n=2, max_tokens=m, ignore_eos=True, seed=i) for i, m in enumerate(budgets)]
    outs = eng.generate(prompts, params)
    for p, m, o in zip(prompts, budgets, outs, strict=True):
        for s in o.samples:
            # prefill P tokens, then one decode per token but the last (it is sampled, never run); logits at
            # one position per model run: the prefill's last token and each decode's
            n = len(p) + m - 1
            assert len(s.token_ids) == m
            assert s.cost == SampleCost(computed_tokens=n, attended=n * (n + 1) // 2, logit_positions=m,
                                        added_step=0, finished_step=m)
    assert eng.num_steps == 6
    # a later call's samples are queued at the engine's step count then
    again = eng.generate([prompts[0]], SamplingParams(max_tokens=3, ignore_eos=True, seed=9))
    assert again[0].samples[0].cost == SampleCost(computed_tokens=5, attended=15, logit_positions=3, added_step=6,
                                                  finished_step=9)
    costs = [s.cost for o in outs for s in o.samples]
    # finishes 2, 2, 6, 6 (4 samples: the tail is 1 sample): steps 3-6 run both of the second prompt's
    # samples, steps 1-2 all four: no step with a single sample left
    assert straggler_share(costs) == 0.0
    eng.close()


@pytest.mark.unit
def test_prefix_cache_hits_are_not_counted():
    # block size 4, a prompt of 9 tokens, two samples: the first computes all 9, the second finds the first's
    # two full blocks (8 tokens) cached and computes the 9th only (the last token's block is never a hit)
    eng = LLMEngine.from_model(perturbed_model(small_config()), num_blocks=64, block_size=4,
                               enable_prefix_caching=True, fork_samples=False)  # forks: engine/test_forked_samples.py
    out = eng.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=1))
    a, b = (s.cost for s in out[0].samples)
    # 9 prompt tokens + 2 decodes = 11 tokens at positions 0..10: keys 1 + ... + 11 = 66
    assert a == SampleCost(computed_tokens=11, attended=66, logit_positions=3, added_step=0, finished_step=3)
    # positions 8, 9, 10 only: keys 9 + 10 + 11 = 30
    assert b == SampleCost(computed_tokens=3, attended=30, logit_positions=3, added_step=0, finished_step=3)
    eng.close()


@pytest.mark.unit
def test_straggler_share_by_hand():
    # 4 samples queued before step 11, finishing on steps 12, 13, 14, 30: 20 steps with one running or more
    # (11-30); at most max(1, 0.4) = 1 running on steps 15-30: 16 of them
    c = [SampleCost(added_step=10, finished_step=f) for f in (12, 13, 14, 30)]
    assert straggler_share(c) == 16 / 20
    assert straggler_share([SampleCost(added_step=0, finished_step=4)] * 3) == 0.0  # all end together
    assert straggler_share([SampleCost()]) is None  # never finished (aborted)
    # 20 samples: the tail is max(1, 2) = 2 samples. Queued at 0, 18 end on step 5, two on steps 8 and 10:
    # steps 6-10 have at most 2 running, of 10 steps
    c = [SampleCost(finished_step=5)] * 18 + [SampleCost(finished_step=8), SampleCost(finished_step=10)]
    assert straggler_share(c) == 5 / 10
    # the gap between two admissions is not the rollout's: one sample on steps 1-2, the next queued after
    # step 6 runs on steps 7-9; 5 steps with one running, all of them the tail (a batch of 2: k = 1)
    assert straggler_share([SampleCost(finished_step=2), SampleCost(added_step=6, finished_step=9)]) == 1.0


def _batch():
    # prompts of 2 and 3 tokens, responses of 4, 1 and 2: rows of 6, 4 and 4 real tokens padded to T = 6
    ids, attn, resp = build_rows([[3, 4], [5, 6, 7], [3, 4]], [[8, 9, 10, 11], [12], [13, 14]])
    return TrainBatch(ids, attn, resp)


@pytest.mark.unit
def test_flops_and_mfu_by_hand():
    cfg = cfg_for_model(trainer={"ppo_epochs": 2, "padding_free": False}, algo={"kl_coef": 0.1})
    shape = small_config()
    N, LHd = 20480, 2 * 4 * 8  # matmul weights (test_small_config_by_hand); layers x heads x head_dim
    Vh = 64 * 32  # the lm_head: the engine runs it at 2 + 1 logit positions, not at every computed token
    cost = StepCost(cfg, shape, peaks={"trainer": (50.0, 2), "engine": (40.0, 1)})
    samples = [CompletionSample([1, 2], [0.0, 0.0], "", finish_reason="length",
                                cost=SampleCost(computed_tokens=4, attended=10, logit_positions=2, added_step=0,
                                                finished_step=2)),
               CompletionSample([1], [0.0], "", finish_reason="stop",
                                cost=SampleCost(computed_tokens=3, attended=6, logit_positions=1, added_step=0,
                                                finished_step=1))]
    cost.add(samples_of_outputs([None], [RequestOutput(0, [7, 7, 7], samples, 0)]))
    times = {"time/update": 0.5, "time/rollout": 0.25, "time/step": 1.0}
    m = cost.metrics(_batch(), times, updated=True)
    B, T = 3, 6
    assert m["flops/update"] == 2 * B * T * (6 * N + 12 * LHd * T)
    assert m["flops/old_logp"] == m["flops/ref_logp"] == B * T * (2 * N + 4 * LHd * T)
    assert m["flops/rollout"] == 2 * (N - Vh) * (4 + 3) + 2 * Vh * (2 + 1) + 4 * LHd * (10 + 6)
    assert m["flops/rollout"] == 2 * 18432 * 7 + 2 * 2048 * 3 + 256 * 16
    assert m["rollout/straggler_share"] == 1 / 2  # steps 1-2; on step 2 one sample is left
    assert m["throughput/mfu_update"] == pytest.approx(m["flops/update"] / (0.5 * 50e9 * 2), rel=1e-12)
    assert m["throughput/mfu_rollout"] == pytest.approx(m["flops/rollout"] / (0.25 * 40e9 * 1), rel=1e-12)
    assert m["throughput/mfu_update"] == mfu(m["flops/update"], 0.5, 50.0, 2)
    # the samples were consumed: the next step counts its own
    again = cost.metrics(_batch(), times, updated=False)
    assert "flops/rollout" not in again and "flops/update" not in again and "throughput/mfu_update" not in again


@pytest.mark.unit
def test_lora_update_flops_by_hand():
    # rank 2 on q_proj (32 -> 32) and v_proj (32 -> 16), 2 layers: A [2, in] + B [out, 2] each
    shape = small_config()
    N_adapters = 2 * (2 * (32 + 32) + 2 * (32 + 16))
    assert adapter_params(shape, 2, ["q_proj", "v_proj"]) == N_adapters == 448
    # the frozen base: forward 2N and the input gradient 2N, no weight gradient; the adapters all three
    assert lora_train_flops(shape, 10, 6, rank=2, targets=["q_proj", "v_proj"]) == 10 * (4 * 20480 + 6 * 448
                                                                                          + 12 * 64 * 6)
    cfg = cfg_for_model(trainer={"ppo_epochs": 2, "padding_free": False,
                                 "lora": {"rank": 2, "target_modules": ["q_proj", "v_proj"]}},
                        algo={"proximal": "behaviour"})
    cost = StepCost(cfg, shape, peaks={"trainer": (1.0, 1), "engine": (1.0, 1)})
    m = cost.metrics(_batch(), {"time/update": 1.0}, updated=True)
    assert m["flops/update"] == 2 * 3 * 6 * (4 * 20480 + 6 * 448 + 12 * 64 * 6)  # epochs x rows x T
    # all seven linears: 2 x 2 x (64 + 48 + 48 + 64 + 96 + 96 + 96) = 2048
    assert adapter_params(shape, 2) == 2048


@pytest.mark.unit
def test_padding_free_counts_real_tokens_and_async_uses_the_engines_busy_time():
    cfg = cfg_for_model(trainer={"shared_prefix": False}, algo={"proximal": "behaviour"},
                        rollout={"mode": "async"}, parallel={"placement": "disaggregated"})
    cost = StepCost(cfg, small_config(), peaks={"trainer": (50.0, 1), "engine": (40.0, 2)})
    one = RequestOutput(0, [1], [CompletionSample([1], [0.0], "", finish_reason="stop",
                                                  cost=SampleCost(computed_tokens=2, attended=3, finished_step=1))], 0)
    cost.add(samples_of_outputs([None], [one]))
    m = cost.metrics(_batch(), {"time/update": 1.0, "time/rollout": 0.1, "time/step": 2.0, "time/wait_train": 0.5},
                     updated=True)
    N, LHd = 20480, 64
    assert m["flops/update"] == 14 * (6 * N + 12 * LHd * 6)  # 6 + 4 + 4 real tokens, rows of at most 6
    assert m["batch/trained_tokens"] == m["batch/real_tokens"] == 14
    shared = StepCost(cfg_for_model(algo={"proximal": "behaviour"}), small_config(), peaks=cost.peaks)
    s = shared.metrics(_batch(), {"time/update": 1.0}, updated=True)  # rows 0 and 2 share their prompt [3, 4]
    assert s["batch/trained_tokens"] == 12 and s["flops/update"] == 12 * (6 * N + 12 * LHd * 6)
    assert "flops/old_logp" not in m and "flops/ref_logp" not in m  # plain PPO, no KL: neither is computed
    assert "rollout/straggler_share" not in m  # asynchronous: the tail's slots go to the next groups
    assert m["throughput/mfu_rollout"] == pytest.approx(m["flops/rollout"] / ((2.0 - 0.5) * 40e9 * 2), rel=1e-12)


@pytest.mark.unit
def test_a_backend_that_does_not_count_logs_no_rollout_flops():
    cost = StepCost(cfg_for_model(), small_config(), peaks={"trainer": (1.0, 1), "engine": (1.0, 1)})
    one = RequestOutput(0, [1], [CompletionSample([1], [0.0], "", finish_reason="stop")], 0)
    cost.add(samples_of_outputs([None], [one]))
    m = cost.metrics(_batch(), {"time/update": 1.0, "time/rollout": 1.0}, updated=True)
    assert "flops/rollout" not in m and "rollout/straggler_share" not in m and "flops/update" in m


def cfg_for_model(**sections):
    from relayrl.controller.config import RunConfig

    return RunConfig.from_dict({"rollout": {"prompts_per_step": 2, "group_size": 2}, **sections})


def _hand_cached(prompts: list[list[int]], n: int, bs: int) -> list[int]:
    """Prefix caching by hand: samples allocate in order (prompt by prompt, n each); a sample reuses the
    longest run of leading full blocks an earlier sample of the step wrote, never the last token's block."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in prompts:
        for _ in range(n):
            hit = 0
            while hit < (len(p) - 1) // bs and tuple(p[: (hit + 1) * bs]) in seen:
                hit += 1
            out.append(hit * bs)
            seen.update(tuple(p[: (i + 1) * bs]) for i in range(len(p) // bs))
    return out


@pytest.mark.e2e
def test_a_run_logs_flops_and_stragglers_from_its_own_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path / "cache"))
    seen = []
    real = driver_mod.Driver.learn

    def learn(self, ro, *a, **kw):
        seen.append(ro)
        return real(self, ro, *a, **kw)

    monkeypatch.setattr(driver_mod.Driver, "learn", learn)
    # block size 4: the group's later samples find its first sample's full prompt blocks cached
    cfg = cfg_for(tmp_path, "run", run={"steps": 2, "save_every": 0},
                  rollout={"block_size": 4, "max_tokens": 10, "temperature": 1.5},
                  algo={"kl_coef": 0.05}, trainer={"ppo_epochs": 2})
    res = train(cfg, show_progress=False)
    steps = [m for m in read_metrics(res["run_dir"]) if "reward/mean" in m]
    assert len(steps) == len(seen) == 2
    c = load_pretrained(tmp_path / "run" / "final_model").config
    # the tiny model (tests/helpers.py SMALL): hidden 32, MLP 64, 2 layers, 4 heads / 2 KV heads of 8, the
    # arith task's 30 characters as its vocabulary, embedding tied to the lm_head
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (30, 32, 64, 2, 4, 2, 8, True)
    # per layer q, o 32 x 32, k, v 32 x 16, gate, up, down 32 x 64: 2048 + 1024 + 6144; the lm_head 30 x 32
    N_body, Vh = 2 * (2048 + 1024 + 6144), 30 * 32
    N, LHd = N_body + Vh, 2 * 4 * 8
    assert (N_body, Vh, N) == (18432, 960, 19392)
    shared = 0
    for m, ro in zip(steps, seen, strict=True):
        P = [len(s.prompt_ids) for s in ro.samples]
        ell = [len(s.response_ids) for s in ro.samples]
        # group size 4: a group's first sample looks its prompt up (earlier groups' full blocks are hits), the
        # other 3 are forked from its prefill (the engine's default), computing from position p on
        cached = _hand_cached([s.prompt_ids for s in ro.samples[::4]], 1, 4)
        flops = 0
        for i, (p, r) in enumerate(zip(P, ell, strict=True)):
            forked = i % 4 > 0
            shared += p if forked else 0
            k = p if forked else cached[i // 4]
            ran = p + r - 1 - k  # positions k .. p + r - 2: the last sampled token is never run
            keys = (p + r - 1) * (p + r) // 2 - k * (k + 1) // 2  # position q attends to q + 1 keys
            logits = r - 1 if forked else r  # 1 prefill (the first sample's) + r - 1 decodes
            flops += 2 * N_body * ran + 2 * Vh * logits + 4 * LHd * keys
        assert m["flops/rollout"] == flops
        # the trainer (padding-free, prefixes shared: the defaults) computes each group's prompt once, then its 4
        # samples' responses; attention counted over the longest sequence T
        T = max(p + r for p, r in zip(P, ell, strict=True))
        tokens = sum(P[g] + sum(ell[g:g + 4]) for g in range(0, len(P), 4))
        assert m["batch/trained_tokens"] == tokens < m["batch/real_tokens"] == sum(P) + sum(ell)
        assert m["flops/update"] == 2 * tokens * (6 * N + 12 * LHd * T)
        assert m["flops/old_logp"] == m["flops/ref_logp"] == tokens * (2 * N + 4 * LHd * T)
        # every sample queued at once and prefilled in one engine step: sample i ends on step len_i; 16 samples,
        # so the tail is 1 sample: the steps after the second longest ended, of the longest's
        first, second = sorted(ell)[-1], sorted(ell)[-2]
        assert m["rollout/straggler_share"] == (first - second) / first
        assert m["throughput/mfu_update"] == pytest.approx(
            m["flops/update"] / (m["time/update"] * m["throughput/peak_gflops_trainer"] * 1e9), rel=1e-9)
        assert m["throughput/mfu_rollout"] == pytest.approx(
            m["flops/rollout"] / (m["time/rollout"] * m["throughput/peak_gflops_engine"] * 1e9), rel=1e-9)
    assert shared > 0  # forks shared their group's prefill: those tokens were not counted
    assert len({len(s.response_ids) for ro in seen for s in ro.samples}) > 1  # lengths differ: the tail is measured
