"""The endpoint under load: C concurrent agents (the official AsyncOpenAI client), each running multi-turn
episodes against its own per-episode base URL, for C = 1, 8, 64. Reports, per C: requests, errors, the KV blocks
leaked (free blocks after the load against before: must be 0), tokens sampled per second over the wall time, and
engine steps per request (how much concurrent requests shared steps). The long form of the tests' 16-client check
(tests/serve/test_endpoint.py); issue 34, deliverable 6.

Each episode: a user message, then `turns - 1` more user messages after the model's reply, the reply sent back as
returned (so every later call reuses the sampled ids: recorder counters must show 0 retokenize_drift). Model: the
tests' tiny model (a 2-layer char model) unless --model DIR.

    python benchmarks/bench_serve_load.py [--clients 1 8 64] [--episodes-per-client 2] [--turns 3]
                                          [--max-tokens 24] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai

from relayrl.data.agent_tasks import PRINTABLE
from relayrl.engine import LLMEngine
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer
from relayrl.serve import Endpoint, ServerThread


def tiny_engine() -> LLMEngine:
    from tests.helpers import perturbed_model, small_config

    d = Path(tempfile.mkdtemp())
    build_char_tokenizer(d, PRINTABLE, tool_tokens=True)
    tok = load_tokenizer(d)
    return LLMEngine.from_model(perturbed_model(small_config(vocab_size=len(tok), max_position_embeddings=1024,
                                                             eos_token_id=tok.eos_token_id,
                                                             pad_token_id=tok.pad_token_id), seed=3).eval(),
                                tok, kv_cache_bytes=64 << 20, block_size=16)


async def episode(c: openai.AsyncOpenAI, server: ServerThread, name: str, turns: int, max_tokens: int,
                  seed: int) -> int:
    client = c.with_options(base_url=server.episode_url(name))
    messages = [{"role": "user", "content": f"episode {name}: what is {seed} + 7?"}]
    tokens = 0
    for t in range(turns):
        r = await client.chat.completions.create(model="bench", messages=messages, max_tokens=max_tokens,
                                                 seed=seed * 100 + t)
        tokens += r.usage.completion_tokens
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    return tokens


async def load(server: ServerThread, clients: int, per_client: int, turns: int, max_tokens: int) -> dict:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=600) as c:
        async def agent(i):
            return sum([await episode(c, server, f"c{clients}-a{i}-e{e}", turns, max_tokens, i * 10 + e)
                        for e in range(per_client)])

        t0 = time.perf_counter()
        got = await asyncio.gather(*(agent(i) for i in range(clients)), return_exceptions=True)
        wall = time.perf_counter() - t0
    errors = [g for g in got if isinstance(g, BaseException)]
    tokens = sum(g for g in got if not isinstance(g, BaseException))
    return {"wall_s": wall, "tokens": tokens, "errors": len(errors),
            "first_error": repr(errors[0]) if errors else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--episodes-per-client", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--model", help="a model directory (default: the tests' tiny model)")
    a = ap.parse_args()
    if a.model:
        from relayrl.jobs.serve import build_endpoint

        endpoint = build_endpoint(a.model, name="bench", max_n=1)
    else:
        endpoint = Endpoint(tiny_engine(), "bench", max_n=1)
    with ServerThread(endpoint) as server:
        loop = endpoint.loop
        rows = []
        for clients in a.clients:
            free0 = loop.call(lambda e: e.block_manager.num_free_blocks).result()
            steps0 = loop.steps
            res = asyncio.run(load(server, clients, a.episodes_per_client, a.turns, a.max_tokens))
            while loop.in_flight:
                time.sleep(0.01)
            leaked = free0 - loop.call(lambda e: e.block_manager.num_free_blocks).result()
            requests = clients * a.episodes_per_client * a.turns
            drift = sum(endpoint.recorder.counters(f"c{clients}-a{i}-e{e}")["retokenize_drift"]
                        for i in range(clients) for e in range(a.episodes_per_client))
            row = {"clients": clients, "requests": requests, "errors": res["errors"], "leaked_blocks": leaked,
                   "retokenize_drift": drift, "tokens": res["tokens"], "wall_s": round(res["wall_s"], 2),
                   "tokens_per_s": round(res["tokens"] / res["wall_s"], 1),
                   "engine_steps_per_request": round((loop.steps - steps0) / requests, 2),
                   "first_error": res["first_error"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    bad = [r for r in rows if r["errors"] or r["leaked_blocks"] or r["retokenize_drift"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
