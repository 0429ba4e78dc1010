"""The endpoint's overhead on agent episodes (issue 34, deliverable 7): the calculator environment's episodes run by
relayrl's AgentLoop straight on an engine, against the same episodes through the OpenAI-compatible endpoint, each path
on its own engine with the same weights:

    direct         AgentLoop(engine, env calculator).run(examples, params)         one step: P prompts x G episodes
    runner_env     rollout.agent: env:calculator   the training run's AgentRunner (relayrl.roles.rollout_worker's
                   agent_runner): the environment played through the endpoint, one thread and one openai.OpenAI
                   client (its own connection pool, the runner's SSL context) per episode
    runner_react   rollout.agent: examples/agents/react_calculator.py:run   the ReAct demo agent, the same way
    runner_react_fresh_clients (--fresh-clients)   the same, each episode's client built from scratch (the runner's
                   first version: an SSL context per client)
    async_client   the environment played through a started endpoint (its own engine thread) by one AsyncOpenAI
                   client on one event loop, each call seeded and capped as AgentLoop seeds and caps the turn: the
                   endpoint's cost with the cheapest client

A seeded call samples what the engine samples for the same ids, so every path draws the same episodes as the agent
loop: the benchmark checks it on every episode (prompt ids, response ids, mask, reward) and reports how many matched.
Per shape: the seconds per step of each path (median of --repeats, the paths in rotating order), the ratio to the
agent loop's, and the worst ratio over the repeats (target: an overhead under 10% of the step time). Then the tokens
sampled per second by the ReAct agent through the runner with 1, 8 and 64 agents in flight (--episodes episodes),
with the episodes dropped (errors) and the KV blocks not returned. With --train-steps N: N GRPO steps of the
calculator demo each way (env:, rollout.agent env:calculator, the ReAct agent), seconds per training step and the
endpoint's extra time as a share of it.

The model: --model DIR, else the calculator demo's SFT warm-start (relayrl.jobs.demo's recipe, trained here: ~1
minute on 2 cores), whose episodes call the tool about one time in four.

    python benchmarks/bench_agent_endpoint.py [--model DIR] [--shapes 4x8 16x8 32x8] [--repeats 3]
                                              [--agents 1 8 64] [--episodes 64] [--fresh-clients]
                                              [--train-steps N] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import openai

from relayrl.data import DataConfig, Example, build_datasets
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.envs.base import make_env
from relayrl.envs.config import EnvConfig
from relayrl.envs.episode import ChatFormat
from relayrl.models.hf_io import generation_eos_ids
from relayrl.rollout.agent_loop import AgentLoop, turn_seed
from relayrl.rollout.agent_rewards import DROPPED
from relayrl.rollout.config import RolloutConfig
from relayrl.serve import Endpoint, ServerThread

ENV = {"name": "calculator", "max_turns": 3, "max_total_tokens": 224}  # the calculator demo's
MAX_TOKENS, TEMPERATURE = 96, 1.0
REACT = Path(__file__).resolve().parent.parent / "examples" / "agents" / "react_calculator.py"


def sft_model(out: Path) -> str:
    from relayrl.jobs.demo import recipe
    from relayrl.jobs.sft import SFTJobConfig, run_sft

    sft, _, _ = recipe("calculator", "grpo")
    cfg = SFTJobConfig.from_dict({**sft, "sft": {**sft["sft"], "out_dir": str(out / "sft")}})
    return str(run_sft(cfg, show_progress=False)["model_dir"])


class EnvAgent:
    """Plays relayrl's environment through the endpoint, call for call as AgentLoop plays it on the engine."""

    def __init__(self, cfg: EnvConfig, tokenizer, model: str):
        self.cfg, self.tok, self.model = cfg, tokenizer, model
        env = make_env(cfg)
        self.tools = [t.schema() for t in env.tools]
        self.fmt = ChatFormat(tokenizer, self.tools)

    async def episode(self, client: openai.AsyncOpenAI, ex: Example, seed: int, sample: int) -> dict:
        env = make_env(self.cfg)
        messages = env.reset(ex)
        length = len(self.fmt.prompt_ids(messages))  # the ids the next call's prompt holds
        reward, success, tokens, turns = 0.0, None, 0, 0
        while True:
            r = await client.chat.completions.create(
                model=self.model, messages=messages, tools=self.tools, temperature=TEMPERATURE,
                max_tokens=min(MAX_TOKENS, self.cfg.max_total_tokens - length), seed=turn_seed(seed, sample, turns),
                extra_body={"return_token_ids": True})
            choice = r.choices[0]
            ids = choice.model_extra["token_ids"]
            tokens, turns, length = tokens + len(ids), turns + 1, length + len(ids)
            text = self.tok.decode(ids, skip_special_tokens=True)  # what AgentLoop hands the environment
            messages.append(choice.message.model_dump(exclude_none=True))
            obs, rew, done, info = env.step({"role": "assistant", "content": text})
            reward += rew
            success = info.get("success", success)
            if done or turns >= self.cfg.max_turns:
                break
            # one tool message per environment reply, with the id of the call it answers (a malformed call, which
            # the endpoint leaves in the content, gets the environment's error message under an id of its own)
            calls = choice.message.tool_calls or []
            tool_msgs = [{"role": "tool", "tool_call_id": calls[k].id if k < len(calls) else f"unparsed-{k}",
                          "content": m["content"]} for k, m in enumerate(obs or [])]
            more = self.fmt.observation_ids(tool_msgs, ids[-1] if ids else None)
            if length + len(more) >= self.cfg.max_total_tokens:
                break
            messages += tool_msgs
            length += len(more)
        return {"reward": reward, "success": bool(success if success is not None else reward >= 1), "tokens": tokens}


def free_blocks(engine: LLMEngine) -> int:
    return engine.block_manager.num_free_blocks


def runner(engine: LLMEngine, agent: str, concurrency: int, params: dict | None = None):
    """rollout.agent's runner on `engine`, built as a training run builds it (relayrl.roles.rollout_worker)."""
    from relayrl.roles.rollout_worker import agent_runner

    return agent_runner(engine, RolloutConfig.model_validate({
        "agent": agent, "agent_params": params or {}, "agent_concurrency": concurrency, "max_tokens": MAX_TOKENS,
        "agent_max_total_tokens": ENV["max_total_tokens"]}))


def fresh_clients(r):
    """Diagnostic (--fresh-clients): `r`'s sync agents each get a client built from scratch, its own SSL context too,
    as the runner's first version gave them (building one loads the certificate store: 20-150 ms of CPU)."""
    def call_sync(ep):
        with openai.OpenAI(base_url=r._url(ep), api_key="relayrl", max_retries=0, timeout=r.timeout_s) as client:
            return r.fn(**r._kwargs(ep, client))

    r._call_sync = call_sync
    return r


class AsyncDriver:
    """EnvAgent's episodes through a started endpoint (its own engine thread), from one AsyncOpenAI client on an
    event loop of its own: the endpoint's cost with the cheapest client (no client built per episode)."""

    def __init__(self, engine: LLMEngine, model: str, cfg: EnvConfig):
        self.endpoint = Endpoint(engine, "bench", stop_token_ids=generation_eos_ids(model))
        self.server = ServerThread(self.endpoint).start()
        self.agent = EnvAgent(cfg, engine.tokenizer, "bench")
        self.aloop = asyncio.new_event_loop()
        threading.Thread(target=self.aloop.run_forever, daemon=True).start()
        # idle connections dropped before uvicorn's 5 s keep-alive timeout can close one under a request
        http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024,
                                                                  keepalive_expiry=1.0))
        self.client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key="-", max_retries=0, timeout=600,
                                         http_client=http)
        self.n = 0

    def run(self, examples: list[Example], params: list[SamplingParams]) -> list[SimpleNamespace]:
        self.n += 1
        names, jobs = [], []
        for i, (ex, sp) in enumerate(zip(examples, params, strict=True)):
            for j in range(sp.n):
                names.append(f"r{self.n}-{i}-{j}")
                c = self.client.with_options(base_url=self.server.episode_url(names[-1]))
                jobs.append(self.agent.episode(c, ex, sp.seed, j))

        async def all_of():
            return await asyncio.gather(*jobs)

        results = asyncio.run_coroutine_threadsafe(all_of(), self.aloop).result()
        while self.endpoint.loop.in_flight:
            time.sleep(0.002)
        out = []
        for name, res in zip(names, results, strict=True):
            (line,) = self.endpoint.recorder.pop(name)
            out.append(SimpleNamespace(prompt_ids=line["prompt_ids"], response_ids=line["response_ids"],
                                       mask=line["mask"], reward=res["reward"], finish="done"))
        return out

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.client.close(), self.aloop).result()
        self.aloop.call_soon_threadsafe(self.aloop.stop)
        self.server.close()


def same(a, b) -> bool:
    return (a.prompt_ids, a.response_ids, a.mask, a.reward) == (b.prompt_ids, b.response_ids, b.mask, b.reward)


def overhead(paths: dict, pool: list[Example], shape: tuple[int, int], repeats: int, offset: int) -> dict:
    """Each path runs the same steps (P prompts x G episodes, fresh examples each repeat, the paths in a rotating
    order); seconds per step (median), ratio to the agent loop's, worst ratio, episodes equal to the agent loop's."""
    prompts, group = shape
    names = list(paths)
    times: dict[str, list[float]] = {n: [] for n in names}
    matched = {n: 0 for n in names}
    tokens, success, episodes = [], [], 0
    for rep in range(repeats + 1):  # the first round warms every path up and is not counted
        start = (offset + rep * prompts) % (len(pool) - prompts)
        examples = pool[start:start + prompts]
        params = [SamplingParams(n=group, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=1000 * rep + i)
                  for i in range(prompts)]
        got, secs = {}, {}
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            got[name] = paths[name].run(examples, params)
            secs[name] = time.perf_counter() - t0
        if rep == 0:
            continue
        ref = got["direct"]
        episodes += len(ref)
        tokens.append(sum(t.model_tokens for t in ref))
        success.append(sum(t.success for t in ref) / len(ref))
        for name in names:
            times[name].append(secs[name])
            matched[name] += sum(same(a, b) for a, b in zip(got[name], ref, strict=True))
    direct = statistics.median(times["direct"])
    row = {"shape": f"{prompts}x{group}", "episodes_per_step": prompts * group,
           "model_tokens_per_step": statistics.median(tokens), "success": round(statistics.mean(success), 3),
           "direct_s_per_step": round(direct, 3)}
    for name in names[1:]:
        row[f"{name}_s_per_step"] = round(statistics.median(times[name]), 3)
        row[f"{name}_ratio"] = round(statistics.median(times[name]) / direct, 2)
        row[f"{name}_worst_ratio"] = round(max(e / d for e, d in zip(times[name], times["direct"], strict=True)), 2)
        row[f"{name}_same_episodes"] = f"{matched[name]}/{episodes}"
    return row


def concurrency(engine: LLMEngine, agent: str, pool: list[Example], n: int, episodes: int) -> dict:
    """`episodes` episodes of `agent` by the runner with at most `n` in flight: tokens sampled per second, episodes
    dropped (errors), KV blocks not returned."""
    r = runner(engine, agent, n)
    try:
        prompts = episodes // 8
        params = [SamplingParams(n=8, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=500 + i)
                  for i in range(prompts)]
        r.run(pool[:prompts], params)  # warm-up
        free0 = free_blocks(engine)
        t0 = time.perf_counter()
        trajs = r.run(pool[prompts:2 * prompts], params)
        wall = time.perf_counter() - t0
        tokens = sum(t.model_tokens for t in trajs)
        dropped = [t for t in trajs if t.finish in DROPPED]
        return {"agents": n, "episodes": len(trajs), "errors": len(dropped),
                "leaked_blocks": free0 - free_blocks(engine), "tokens": tokens, "wall_s": round(wall, 2),
                "tokens_per_s": round(tokens / wall, 1), "first_error": dropped[0].error if dropped else None}
    finally:
        r.close()


def train_steps(model: str, steps: int, out: Path) -> list[dict]:
    """The calculator demo's GRPO steps (relayrl.jobs.demo's recipe, 16 prompts x 8) on `model`, with the environment
    run by the agent loop (env:), through the endpoint (rollout.agent: env:calculator) and by the ReAct agent: the
    median seconds per training step and per rollout, and the endpoint's extra time as a share of the agent loop's
    step (the target: under 10%)."""
    from relayrl.controller.config import RunConfig
    from relayrl.jobs.demo import CALC_ENV, recipe
    from relayrl.jobs.train import train

    _, rl, _ = recipe("calculator", "grpo")
    base = {**{k: v for k, v in rl.items() if k != "env"}, "model": {"path": model},
            "data": {**rl["data"], "n_eval": 16}, "eval": {**rl["eval"], "every": 0}}
    runs = {"agent_loop": {"env": CALC_ENV},
            "runner_env": {"rollout": {**rl["rollout"], "agent": "env:calculator",
                                       "agent_params": {k: v for k, v in CALC_ENV.items() if k != "name"},
                                       "agent_concurrency": 128}},
            "runner_react": {"rollout": {**rl["rollout"], "agent": f"{REACT}:run", "agent_concurrency": 128,
                                         "agent_max_total_tokens": CALC_ENV["max_total_tokens"]}}}
    rows = []
    for name, extra in runs.items():
        cfg = RunConfig.from_dict({**base, **extra, "run": {**rl["run"], "steps": steps, "out_dir": str(out / name),
                                                            "loggers": []}})
        train(cfg, show_progress=False)
        metrics = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        metrics = [m for m in metrics if "time/step" in m][1:]  # the first step warms up
        rows.append({"train": name, "steps": len(metrics),
                     "s_per_step": round(statistics.median(m["time/step"] for m in metrics), 3),
                     "rollout_s_per_step": round(statistics.median(m["time/rollout"] for m in metrics), 3),
                     "reward_mean": round(statistics.mean(m["reward/mean"] for m in metrics), 3)})
    loop = rows[0]["s_per_step"]
    for row in rows[1:]:
        row["ratio"] = round(row["s_per_step"] / loop, 2)
        row["overhead_share_of_step"] = round((row["s_per_step"] - loop) / row["s_per_step"], 3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: the calculator demo's SFT model, trained here)")
    ap.add_argument("--shapes", nargs="+", default=["4x8", "16x8", "32x8"], help="PROMPTSxGROUP per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agents", type=int, nargs="*", default=[1, 8, 64], help="concurrent agents (tokens/s)")
    ap.add_argument("--episodes", type=int, default=64, help="episodes per concurrency measurement")
    ap.add_argument("--fresh-clients", action="store_true",
                    help="also run the ReAct agent's runner with clients built from scratch (a diagnostic)")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also train this many GRPO steps of the calculator demo each way (time per training step)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    model = a.model or sft_model(Path(tempfile.mkdtemp(prefix="bench-agent-")))
    cfg = EnvConfig.model_validate(ENV)
    data = DataConfig.model_validate({"task": "calculator", "task_params": {"digits": [2, 2, 2]}, "n_train": 2000,
                                      "n_eval": 1, "seed": 7, "chat_template": "always"})
    pool = build_datasets(data)[0]
    env_params = {k: v for k, v in ENV.items() if k != "name"}
    most = max(int(p) * int(g) for p, g in (s.split("x") for s in a.shapes))
    rows = []
    paths = {"direct": AgentLoop(LLMEngine.from_pretrained(model), cfg),
             "runner_env": runner(LLMEngine.from_pretrained(model), "env:calculator", most, env_params),
             "runner_react": runner(LLMEngine.from_pretrained(model), f"{REACT}:run", most),
             "async_client": AsyncDriver(LLMEngine.from_pretrained(model), model, cfg)}
    if a.fresh_clients:
        paths["runner_react_fresh_clients"] = fresh_clients(runner(LLMEngine.from_pretrained(model), f"{REACT}:run",
                                                                   most))
    try:
        for k, shape in enumerate(a.shapes):
            p, g = (int(x) for x in shape.split("x"))
            row = overhead(paths, pool, (p, g), a.repeats, offset=k * 97)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for path in paths.values():
            path.close()
    engine = LLMEngine.from_pretrained(model)
    for n in a.agents:
        row = concurrency(engine, f"{REACT}:run", pool, n, a.episodes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.train_steps:
        for row in train_steps(model, a.train_steps, Path(tempfile.mkdtemp(prefix="bench-agent-train-"))):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
