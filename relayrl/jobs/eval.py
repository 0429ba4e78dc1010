"""`relayrl eval`: an EvalJob (relayrl.jobs.eval_config: a run's settings, or the command line's) evaluated — the
held-out set built from its data section, the model loaded into an engine with the run's engine settings, scored by
its reward (or its environment), greedy by default: on a run's final model, the figures of the run's last
evaluation. With a samples file (`relayrl eval --samples FILE`) each example's row (prompt, completion, reward,
answer, correctness: relayrl.rollout.sample_rows) is appended to it, as a run's samples.jsonl holds them.

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

from contextlib import ExitStack, closing
from pathlib import Path

import torch

from relayrl.data import build_datasets
from relayrl.data.config import FILE_TASK
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.base import make_env
from relayrl.jobs.base_model import resolve_model
from relayrl.jobs.build import reward_scorer
from relayrl.jobs.eval_config import EvalJob
from relayrl.models.hf_io import load_config
from relayrl.models.tokenizer import load_tokenizer
from relayrl.observe.samples import SampleLog
from relayrl.parallel.device import resolve_device
from relayrl.rollout.charset import check_representable
from relayrl.rollout.evaluate import episode_agent, evaluate_set
from relayrl.single_controller.process_setup import configure_process


def engine_options(job: EvalJob) -> dict:
    """LLMEngine's settings of the job's rollout section (one process: its tensor-parallel degree aside)."""
    r = job.rollout
    return dict(dtype=getattr(torch, r.engine_dtype), enable_prefix_caching=r.enable_prefix_caching, seed=job.seed,
                max_num_seqs=r.max_num_seqs, block_size=r.block_size, kv_cache_bytes=r.kv_cache_bytes,
                device=resolve_device(job.device))


def run_eval(job: EvalJob, samples: str | Path | None = None) -> dict[str, float]:
    """The eval/* figures of `job` (relayrl.rollout.evaluate.evaluate_set); with `samples`, a file that each
    example's row is appended to (step 0, split eval)."""
    # a bad setting, an empty dataset, an unknown environment or a missing sandbox: one line, before the model loads
    SamplingParams(temperature=job.temperature, max_tokens=job.max_tokens, seed=job.seed)
    _, eval_set = build_datasets(job.data)
    if job.env is not None:
        make_env(job.env)
    model_dir = resolve_model(job.model_dir)  # no tokenizer: one line; a GGUF file: converted once, here
    check_representable(load_tokenizer(model_dir), {"eval": eval_set}, job.data, str(job.model_dir),
                        advice="remove them from the data, or evaluate a model whose tokenizer has them",
                        max_tokens=load_config(model_dir).max_position_embeddings)
    configure_process()  # this process runs the model: its CPU kernels, decided once (relayrl.parallel.cpu_kernels)
    with ExitStack() as stack:
        # an environment rewards its own episodes; otherwise the run's reward (its rule functions in the reward
        # pool, its reward models in this process)
        scorer = None if job.env is not None else stack.enter_context(closing(reward_scorer(job.reward, job.device)))
        engine = stack.enter_context(closing(LLMEngine.from_pretrained(model_dir, **engine_options(job))))
        agent = stack.enter_context(episode_agent(engine, job.env))
        rows: list[dict] | None = [] if samples is not None else None
        res = evaluate_set(engine, eval_set, data=job.data, scorer=scorer, agent=agent, max_tokens=job.max_tokens,
                           temperature=job.temperature, seed=job.seed, stop=job.rollout.stop, rows=rows)
    if samples is not None:
        with SampleLog(samples) as log:
            log.write(0, rows)
    return res


def held_out_line(res: dict[str, float], job: EvalJob) -> str:
    """The figures of `res` named as what they measure: the configured reward (the weighted sum of reward.functions,
    named), beside the share the task's own check calls correct (exact match for a dataset file) or, in an
    environment, the share of episodes it calls a success."""
    if job.env is not None:
        scorer, correct = f"the {job.env.name} environment's reward", "success rate"
    else:
        terms = [(f.name if f.path is None else f"{f.name}:{f.path}") for f in job.reward.functions]
        weights = [f.weight for f in job.reward.functions]
        scorer = " + ".join(t if w == 1 else f"{w:g}*{t}" for t, w in zip(terms, weights, strict=True))
        correct = "exact match" if job.data.task == FILE_TASK else f"accuracy ({job.data.task})"
    # the share the task calls correct: eval/accuracy, or eval/exact_match where a user reward makes that its name
    share = res.get("eval/accuracy", res.get("eval/exact_match", float("nan")))
    return (f"held-out: {int(res.get('eval/n', 0))} prompts  reward {res.get('eval/reward', float('nan')):.4f} "
            f"(mean of {scorer})  {correct} {share:.4f}  response length {res.get('eval/response_length', 0):.2f}")
