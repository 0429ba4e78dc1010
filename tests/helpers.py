"""Helpers several test modules share: the small run configs of the driver tests, the comparison of
two runs' metrics, the tiny model builders, the sync tests' model shapes, a trainer of one rank in this process
around a model made in memory (inline_policy, policy_model), and the deliberately wrong
"assemble the fused weight, then slice it" engine load the sync verifier must catch.

Test modules import from here, never from each other.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from relayrl.controller.config import RunConfig
from relayrl.models import CausalLM, ModelConfig
from relayrl.models.config import ModelShape
from relayrl.observe import read_metrics
from relayrl.rewards import RewardConfig, RewardScorer, build_scorer
from relayrl.sync.layout import engine_param_name

# ---------------------------------------------------------------------------- run configs
SMALL = {
    "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "init_std": 0.2}},
    "data": {"task": "arith", "n_train": 64, "n_eval": 16},
    "rollout": {"prompts_per_step": 4, "group_size": 4, "max_tokens": 6},
    "trainer": {"lr": 1e-3, "micro_batch_size": 8, "mini_batches": 2},
    "eval": {"max_tokens": 4},
    "run": {"steps": 4, "save_every": 2, "loggers": []},
}


def cfg_for(tmp_path, name, **sections) -> RunConfig:
    """SMALL with `sections` merged in, writing to tmp_path/name."""
    d = json.loads(json.dumps(SMALL))
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    d["run"]["out_dir"] = str(tmp_path / name)
    return RunConfig.from_dict(d)


TINY_ENV_MODEL = {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "init_std": 0.2}}


def env_cfg(tmp_path, name, env, task="calculator", **sections) -> RunConfig:
    """A 2-step run of episodes in environment `env` (an `env:` section) on a chat-templated task."""
    return cfg_for(tmp_path, name, model=TINY_ENV_MODEL,
                   data={"task": task, "task_params": {}, "chat_template": "always", "n_train": 32, "n_eval": 4},
                   env=env, rollout={"prompts_per_step": 2, "group_size": 4, "max_tokens": 12},
                   eval={"max_tokens": 12}, run={"steps": 2, "save_every": 0}, **sections)


def group_cfg(tmp_path, name, **parallel) -> RunConfig:
    """A 2-step run with a KL term and a reward with spread, under `parallel.*` settings."""
    # a reward with spread: real advantages, so gradients are signal (with all-zero advantages the
    # gradient is rounding noise, which Adam scales up to full steps — layout-dependent by nature)
    return cfg_for(tmp_path, name, algo={"kl_coef": 0.05}, run={"steps": 2, "save_every": 0},
                   reward={"functions": [{"name": "tests.fixtures.rewards:share_of_sevens"}]}, parallel=parallel)


# ---------------------------------------------------------------------------- comparing runs
EXACT = ("reward/mean", "reward/std", "reward/accuracy", "response_length/mean", "response_length/max",
         "groups/no_signal_frac", "engine/prefix_hit_rate")
CLOSE = ("loss", "grad_norm", "clip_frac", "entropy", "kl", "mismatch/logp_abs_mean", "ratio_max")


def step_metrics(run_dir) -> list[dict]:
    return [m for m in read_metrics(run_dir) if "reward/mean" in m]


def assert_same_metrics(a: list[dict], b: list[dict], skip: tuple[str, ...] = (),
                        abs_tol: dict[str, float] | None = None) -> None:
    """Same samples (the rollouts saw the same weights) and the same update, to rounding (abs_tol: a figure's own
    absolute tolerance where a layout reorders sums that cancel, each use saying why; 1e-6 otherwise)."""
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for k in EXACT:
            if k in skip:
                continue
            assert x[k] == y[k], k
        for k in CLOSE:
            if k in x:
                assert x[k] == pytest.approx(y[k], rel=1e-4, abs=(abs_tol or {}).get(k, 1e-6)), k


# ---------------------------------------------------------------------------- advantages
def advantages_of(name: str, rewards: torch.Tensor, group_size: int, norm_std: bool = True, **inputs) -> torch.Tensor:
    """The registered estimator `name` (one signature for all: relayrl.algorithms.estimate) on sequence rewards;
    `inputs` are AdvantageInputs' optional fields (baseline=...)."""
    from relayrl.algorithms import AdvantageInputs, AlgoConfig, get_advantage

    mask = torch.ones(len(rewards), 1)
    algo = AlgoConfig(advantage=name, norm_std=norm_std)
    return get_advantage(name)(AdvantageInputs(rewards, mask, group_size, **inputs), algo).advantages


# ---------------------------------------------------------------------------- training batches
def random_train_batch(n: int = 8, seed: int = 0, generator: torch.Generator | None = None):
    """n right-padded rows of 2-5 prompt and 1-8 response tokens (ids 3-59) with random advantages, drawn
    from `generator` (a caller may go on drawing from it) or one seeded with `seed`."""
    from relayrl.trainer.batch import TrainBatch, build_rows

    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    resps = [torch.randint(3, 60, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    ids, attn, resp = build_rows(prompts, resps)
    return TrainBatch(ids, attn, resp, advantages=torch.randn(n, generator=g))


# ---------------------------------------------------------------------------- tiny models
def parity_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """3 rows of 12 token ids (3..96) for a parity test against transformers: one left- and one right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    return ids, mask


# the tiny transformers MoE configs of the MoE parity tests (models and engine): shared fields, Qwen-MoE's experts
HF_MOE_COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
HF_QWEN_MOE = dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)


def masked_nll(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, count) -> torch.Tensor:
    """Sum of the masked tokens' next-token NLL (fp32) over a global count: a loss whose shares sum over ranks."""
    logp = logits.float().log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
    return -(logp * mask).sum() / count


def small_config(**kw) -> ModelConfig:
    """A 2-layer, 4-head (2 KV heads) model; `kw` overrides any field."""
    base = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return ModelConfig(**{**base, **kw})


def perturbed_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """cfg's model with std-0.2 weights and non-trivial norms and biases, so a norm or bias left at its
    init (1s, 0s) cannot pass as loaded or as correctly sharded."""
    model = CausalLM(cfg)
    model.reset_parameters(std=0.2, seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


# ---------------------------------------------------------------------------- weight sync
SYNC_CONFIGS = {
    # the seed case: 8 Q heads, 2 KV heads — engine TP 4 replicates each KV head on 2 ranks
    "gqa8x2": dict(model_type="qwen2", vocab_size=30, hidden_size=18, intermediate_size=24, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=4, qkv_bias=True, tie_word_embeddings=True),
    # MHA, all biases, untied; hidden 10 over dp 4: torch.chunk gives 3, 3, 3, 1
    "mha4": dict(model_type="llama", vocab_size=14, hidden_size=10, intermediate_size=12, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=2, qkv_bias=True, o_bias=True,
                 mlp_bias=True),
    # one KV head (replicated on every engine rank), qk-norm; k_proj has 2 rows: dp 4 leaves empty chunks
    "mqa4x1": dict(model_type="qwen3", vocab_size=20, hidden_size=12, intermediate_size=8, num_hidden_layers=1,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=2, qk_norm=True),
}


SYNC_ROWS = [[1, 5, 2, 7, 3, 9, 4, 0, 6, 8], [3, 3, 1, 4, 1, 5, 9, 2, 6, 5]]  # the canary rows of the sync tests


def sync_model(key: str, seed: int = 0) -> CausalLM:
    """SYNC_CONFIGS[key]'s model with every weight N(0, 0.5), norms too: all-ones would hide a misplaced slice."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**SYNC_CONFIGS[key]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def inline_policy(model: torch.nn.Module, engine_dtype: torch.dtype | None = None):
    """A trainer of one rank in this process around `model` (parallel.backend none): GroupPolicy over the inline
    backend, its actor built from the model itself (no copy), default trainer and algorithm settings. engine_dtype:
    with a colocated engine rank (in engine_dtype) beside the actor, its role `roles["engine"]` (colocated_engine)."""
    from relayrl.algorithms import AlgoConfig
    from relayrl.engine.tp_workers import RunnerWorker
    from relayrl.parallel.config import ParallelConfig
    from relayrl.roles.group_policy import GroupPolicy
    from relayrl.single_controller.worker import RoleSpec
    from relayrl.trainer.config import TrainerConfig

    engine = None if engine_dtype is None else RoleSpec(RunnerWorker, (model.config, engine_dtype))
    return GroupPolicy(lambda: model, par=ParallelConfig(), trainer_cfg=TrainerConfig(), algo_cfg=AlgoConfig(),
                       total_steps=1, colocated_engine=engine)


def colocated_engine(policy, dtype: torch.dtype = torch.float32):
    """The LLMEngine over an inline_policy's colocated engine rank (built with engine_dtype=dtype); empty until the
    first sync."""
    from relayrl.engine import LLMEngine
    from relayrl.engine.tp_workers import colocated_ranks

    return LLMEngine(policy_model(policy).config, dtype=dtype, runner_group=colocated_ranks(policy.roles["engine"], 1),
                     kv_cache_bytes=1 << 16)


def _rank_model(rank):
    return rank.model


def policy_model(policy) -> torch.nn.Module:
    """An inline policy's actor model itself (a world of 1 in this process: the object, not a copy)."""
    return policy.run_on_ranks(_rank_model)[0]


def sync_reference_logp(model: CausalLM) -> torch.Tensor:
    """The model's own logprobs of SYNC_ROWS: what an engine holding its weights must score."""
    from relayrl.trainer.logprobs import token_logprobs

    ids = torch.tensor(SYNC_ROWS)
    return token_logprobs(model, ids, torch.ones_like(ids))[0]


def naive_plan(full_sd: dict[str, torch.Tensor], cfg: ModelShape,
               engine_tp: int) -> dict[int, dict[str, torch.Tensor]]:
    """WRONG, kept to show why: assemble each fused weight from the full logical tensors, then cut it
    in engine_tp equal row blocks. Rank r's qkv block straddles the q|k|v boundaries (rank 1 of 2
    gets the last Q heads and the first KV heads' K rows, not its Q heads + their K and V), and with
    tp > Hkv the block is not even the right size. Returns engine rank -> {fused param: tensor}."""
    shape = ModelShape.of(cfg)
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(engine_tp)}
    for i in range(shape.num_hidden_layers):
        for parts in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            group = "self_attn" if parts[0] == "q_proj" else "mlp"
            names = [f"model.layers.{i}.{group}.{p}.weight" for p in parts]
            fused = torch.cat([full_sd[n] for n in names])
            for r, block in enumerate(fused.chunk(engine_tp)):
                out[r][engine_param_name(names[0])] = block.clone()
    return out


# ---------------------------------------------------------------------------- reward functions
@contextlib.contextmanager
def importable(directory: Path, module: str, source: str) -> Iterator[Path]:
    """`source` written as directory/module.py and importable by name (reward workers find it too:
    they are started with this process's sys.path) until the block ends."""
    (directory / f"{module}.py").write_text(source)
    sys.path.insert(0, str(directory))
    try:
        yield directory
    finally:
        sys.path.remove(str(directory))


def scorer(functions: list[dict], **reward) -> RewardScorer:
    """A scorer (with its reward pool) for the `reward.functions` entries and other `reward.*` keys."""
    return build_scorer(RewardConfig.from_dict({"functions": functions, **reward}))


# ---------------------------------------------------------------------------- random batches
def random_rows(seed: int = 3, n: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    """n prompts of 2-5 tokens and n responses of 1-7 tokens (ids 3..59), seeded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 60, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    resps = [torch.randint(3, 60, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
             for _ in range(n)]
    return prompts, resps


def random_multiturn_mask(rng, B: int, T: int, dtype=torch.float32) -> torch.Tensor:
    """[B, T] response masks, right-padded; every odd row has a two-token hole (a multi-turn observation)."""
    mask = torch.zeros(B, T, dtype=dtype)
    for i in range(B):
        start, end = rng.randint(1, 5), rng.randint(8, T)
        mask[i, start:end] = 1.0
        if i % 2:
            hole = rng.randint(start + 1, end - 2)
            mask[i, hole:hole + 2] = 0.0
    return mask


# ---------------------------------------------------------------------------- MoE runs
def tiny_moe_dir(path: Path, task: str = "arith", seed: int = 0, router_std: float = 1.0) -> Path:
    """A Hugging Face directory of a random 2-layer Qwen3-MoE (4 experts, top-2, hidden 32) with the char tokenizer of
    a built-in task, for runs with model.path (the tiny-model builder makes dense models only). Routers std
    `router_std`: far from uniform, so most tokens' top-k is clear of ties."""
    from relayrl.data import DataConfig, build_task
    from relayrl.models.tiny import build_tiny_moe_model

    return build_tiny_moe_model(path, build_task(DataConfig(task=task)).alphabet, router_std=router_std, seed=seed)
