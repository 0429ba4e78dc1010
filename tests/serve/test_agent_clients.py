"""The agent runner's episode clients share one connection pool (relayrl.serve.agents._shared_http): an agent that
closes its client, as `with client:` does, leaves the other episodes' calls working, and each episode still gets the
tokens a runner with a pool per client gave it (the reference: the same episodes, one fresh pool per client)."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from relayrl.data import Example  # noqa: E402
from relayrl.data.agent_tasks import PRINTABLE  # noqa: E402
from relayrl.engine import LLMEngine, SamplingParams  # noqa: E402
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer  # noqa: E402
from relayrl.serve.agents import AgentRunner  # noqa: E402
from tests.helpers import perturbed_model, small_config  # noqa: E402

POOLS: list[int] = []


def closes_its_client(example, client, model):
    """Two calls inside `with client:` (which closes the client, and its http pool with it, at the end)."""
    with client:
        POOLS.append(id(client._client))
        msgs = [{"role": "user", "content": example.prompt}]
        r = client.chat.completions.create(model=model, messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        client.chat.completions.create(model=model, messages=msgs)
    return 1.0


async def closes_its_client_async(example, client, model):
    async with client:
        POOLS.append(id(client._client))
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": example.prompt}])
    return float(bool(r.choices[0].message.content is not None))


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(d, PRINTABLE, tool_tokens=True)
    tok = load_tokenizer(d)
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=128, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    return perturbed_model(cfg, seed=5).eval(), tok


def episodes(model_tok, fn, own_pools: bool):
    model, tok = model_tok
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=4 << 20, block_size=8)
    runner = AgentRunner(engine, fn, concurrency=3)
    if own_pools:  # the reference: every client with a pool of its own, closed by the client
        runner._call_sync = lambda ep: fn(**runner._kwargs(ep, openai.OpenAI(
            base_url=runner._url(ep), api_key="x", max_retries=0)))
    examples = [Example(prompt=f"task {i}", answer="0") for i in range(4)]
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=40 + i) for i in range(4)]
    POOLS.clear()
    try:
        return runner.run(examples, params), list(POOLS)
    finally:
        runner.close()
        engine.close()


@pytest.mark.equivalence
def test_agents_closing_their_clients_leave_the_shared_pool_to_the_others(model_tok):
    trajs, pools = episodes(model_tok, closes_its_client, own_pools=False)
    assert len(trajs) == 8 and len(pools) == 8
    assert len(set(pools)) == 1  # one pool for every episode
    assert [t.finish for t in trajs] == ["done"] * 8 and all(t.reward == 1.0 for t in trajs)
    assert all(t.counters["agent/calls"] == 2.0 for t in trajs)  # every episode made both calls
    ref, ref_pools = episodes(model_tok, closes_its_client, own_pools=True)
    assert len(set(ref_pools)) == 8
    assert [(t.prompt_ids, t.response_ids, t.mask) for t in trajs] == [
        (t.prompt_ids, t.response_ids, t.mask) for t in ref]


@pytest.mark.faults
def test_async_agents_share_one_pool_too(model_tok):
    trajs, pools = episodes(model_tok, closes_its_client_async, own_pools=False)
    assert len(set(pools)) == 1 and len(pools) == 8
    assert [t.finish for t in trajs] == ["done"] * 8
