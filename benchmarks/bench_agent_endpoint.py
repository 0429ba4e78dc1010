"""The endpoint's overhead on agent episodes (issue 34, deliverable 7): the calculator environment's episodes run by
relayrl's AgentLoop straight on an engine, against the same episodes driven through the OpenAI-compatible endpoint
(AsyncOpenAI agents, one per episode, all in flight at once), on a second engine with the same weights.

    direct     AgentLoop(engine_a, env calculator).run(examples, params)          one step: P prompts x G episodes
    endpoint   Endpoint(engine_b) + ServerThread; per episode an agent that plays the environment over
               /episodes/ID/v1/chat/completions with tools=[the env's tool schemas]: the reply's sampled ids decoded
               as AgentLoop decodes them are the environment's input, its tool messages go back as "tool" messages
               with the call ids, each call seeded and capped as AgentLoop seeds and caps the turn (turn_seed, room)

Both paths draw the same tokens (a seeded call samples what the engine samples for the same ids), so the episodes
are the same: the benchmark checks it on every episode (the recorded trajectory's ids and mask against AgentLoop's,
and the reward) and reports how many matched. Per shape it reports the seconds per step of each path (median of
--repeats, the two paths alternating), their ratio and the worst ratio over the repeats; the target is an overhead
under 10% of the step time. Then the tokens sampled per second with 1, 8 and 64 concurrent agents (each runs
--episodes-per-agent episodes one after the other), with errors and leaked KV blocks.

The model: --model DIR, else the calculator demo's SFT warm-start (relayrl.jobs.demo's recipe, trained here: ~1
minute on 2 cores), whose episodes call the tool about one time in four.

    python benchmarks/bench_agent_endpoint.py [--model DIR] [--shapes 4x8 16x8 32x8] [--repeats 3]
                                              [--agents 1 8 64] [--episodes-per-agent 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
from relayrl.serve import Endpoint, ServerThread

ENV = {"name": "calculator", "max_turns": 3, "max_total_tokens": 224}  # the calculator demo's
MAX_TOKENS, TEMPERATURE = 96, 1.0


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


def free_blocks(endpoint: Endpoint) -> int:
    return endpoint.loop.call(lambda e: e.block_manager.num_free_blocks).result(timeout=30)


def settle(endpoint: Endpoint) -> None:
    while endpoint.loop.in_flight:
        time.sleep(0.005)


def client_of(server: ServerThread) -> openai.AsyncOpenAI:
    """One client for the whole run, its connections kept alive: httpx's default keeps 100, so a step of more
    concurrent episodes would reconnect on every call (the agents' cost, not the endpoint's)."""
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=600, http_client=http)


async def endpoint_step(c: openai.AsyncOpenAI, server: ServerThread, agent: EnvAgent, examples: list[Example], params,
                        tag: str):
    jobs, names = [], []
    for i, (ex, sp) in enumerate(zip(examples, params, strict=True)):
        for j in range(sp.n):
            names.append(f"{tag}-{i}-{j}")
            jobs.append(agent.episode(c.with_options(base_url=server.episode_url(names[-1])), ex, sp.seed, j))
    return names, await asyncio.gather(*jobs)


def same_episodes(endpoint: Endpoint, names: list[str], results: list[dict], trajs) -> int:
    same = 0
    for name, res, t in zip(names, results, trajs, strict=True):
        lines = endpoint.recorder.pop(name)
        same += (len(lines) == 1 and lines[0]["prompt_ids"] == t.prompt_ids
                 and lines[0]["response_ids"] == t.response_ids and lines[0]["mask"] == t.mask
                 and res["reward"] == t.reward)
    return same


async def overhead(c: openai.AsyncOpenAI, direct: LLMEngine, server: ServerThread, agent: EnvAgent, cfg: EnvConfig,
                   pool: list[Example], shape: tuple[int, int], repeats: int, offset: int) -> dict:
    prompts, group = shape
    loop = AgentLoop(direct, cfg)
    rows = []
    try:
        for rep in range(repeats + 1):  # the first round warms both paths up and is not counted
            start = (offset + rep * prompts) % (len(pool) - prompts)
            examples = pool[start:start + prompts]
            params = [SamplingParams(n=group, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=1000 * rep + i)
                      for i in range(prompts)]
            times = {}
            for path in (("direct", "endpoint") if rep % 2 == 0 else ("endpoint", "direct")):
                t0 = time.perf_counter()
                if path == "direct":
                    trajs = loop.run(examples, params)
                else:
                    names, results = await endpoint_step(c, server, agent, examples, params, f"s{offset}-{rep}")
                times[path] = time.perf_counter() - t0
            settle(server.endpoint)
            if rep:
                rows.append({**times, "same": same_episodes(server.endpoint, names, results, trajs),
                             "episodes": len(trajs), "tokens": sum(t.model_tokens for t in trajs),
                             "success": sum(t.success for t in trajs) / len(trajs)})
            else:
                same_episodes(server.endpoint, names, results, trajs)  # forget the warm-up's episodes
    finally:
        loop.close()
    d, e = [r["direct"] for r in rows], [r["endpoint"] for r in rows]
    ratios = [r["endpoint"] / r["direct"] for r in rows]
    return {"shape": f"{prompts}x{group}", "episodes_per_step": prompts * group,
            "model_tokens_per_step": statistics.median(r["tokens"] for r in rows),
            "success": round(statistics.mean(r["success"] for r in rows), 3),
            "direct_s_per_step": round(statistics.median(d), 3), "endpoint_s_per_step": round(statistics.median(e), 3),
            "ratio": round(statistics.median(e) / statistics.median(d), 3), "worst_ratio": round(max(ratios), 3),
            "same_episodes": f"{sum(r['same'] for r in rows)}/{sum(r['episodes'] for r in rows)}"}


async def concurrent(c: openai.AsyncOpenAI, server: ServerThread, agent: EnvAgent, pool: list[Example], agents: int,
                     per_agent: int, tag: str) -> dict:
    async def one(a: int) -> int:
        tokens = 0
        for k in range(per_agent):
            ex = pool[(a * per_agent + k) % len(pool)]
            res = await agent.episode(c.with_options(base_url=server.episode_url(f"{tag}-{a}-{k}")), ex,
                                      a * 100 + k, 0)
            tokens += res["tokens"]
        return tokens

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(a) for a in range(agents)), return_exceptions=True)
    wall = time.perf_counter() - t0
    errors = [g for g in got if isinstance(g, BaseException)]
    return {"wall_s": wall, "tokens": sum(g for g in got if not isinstance(g, BaseException)), "errors": len(errors),
            "first_error": repr(errors[0]) if errors else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory (default: the calculator demo's SFT model, trained here)")
    ap.add_argument("--shapes", nargs="+", default=["4x8", "16x8", "32x8"], help="PROMPTSxGROUP per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agents", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--episodes-per-agent", type=int, default=4)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    model = a.model or sft_model(Path(tempfile.mkdtemp(prefix="bench-agent-")))
    cfg = EnvConfig.model_validate(ENV)
    direct = LLMEngine.from_pretrained(model)
    endpoint = Endpoint(LLMEngine.from_pretrained(model), "bench", stop_token_ids=generation_eos_ids(model))
    agent = EnvAgent(cfg, direct.tokenizer, "bench")
    data = DataConfig.model_validate({"task": "calculator", "task_params": {"digits": [2, 2, 2]}, "n_train": 2000,
                                      "n_eval": 1, "seed": 7, "chat_template": "always"})
    pool = build_datasets(data)[0]
    with ServerThread(endpoint) as server:
        rows = asyncio.run(measure(a, server, direct, agent, cfg, pool))
    direct.close()
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


async def measure(a, server: ServerThread, direct: LLMEngine, agent: EnvAgent, cfg: EnvConfig,
                  pool: list[Example]) -> list[dict]:
    endpoint, rows = server.endpoint, []
    async with client_of(server) as c:
        for k, shape in enumerate(a.shapes):
            p, g = (int(x) for x in shape.split("x"))
            row = await overhead(c, direct, server, agent, cfg, pool, (p, g), a.repeats, offset=k * 97)
            rows.append(row)
            print(json.dumps(row), flush=True)
        for n in a.agents:
            settle(endpoint)
            free0, steps0 = free_blocks(endpoint), endpoint.loop.steps
            res = await concurrent(c, server, agent, pool, n, a.episodes_per_agent, f"c{n}")
            settle(endpoint)
            row = {"agents": n, "episodes": n * a.episodes_per_agent, "errors": res["errors"],
                   "leaked_blocks": free0 - free_blocks(endpoint), "tokens": res["tokens"],
                   "wall_s": round(res["wall_s"], 2), "tokens_per_s": round(res["tokens"] / res["wall_s"], 1),
                   "engine_steps": endpoint.loop.steps - steps0, "first_error": res["first_error"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
