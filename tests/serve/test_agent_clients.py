"""The agent runner's episode clients (relayrl.serve.agents): each episode's client has a connection pool of its own,
all built over the runner's one SSL context (a client that builds its own loads the certificate store: 20-150 ms of
CPU per episode). References: the same episodes run by clients each built from scratch; an agent that closes its
client, as `with client:` does, touches no other episode."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from relayrl.data import Example  # noqa: E402
from relayrl.data.agent_tasks import PRINTABLE  # noqa: E402
from relayrl.engine import LLMEngine, SamplingParams  # noqa: E402
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer  # noqa: E402
from relayrl.serve.agents import AgentRunner  # noqa: E402
from tests.helpers import perturbed_model, small_config  # noqa: E402

SEEN: list[tuple[int, int]] = []  # per episode: its http client, its SSL context


def _pool_of(client) -> tuple[int, int]:
    http = client._client
    return id(http), id(http._transport._pool._ssl_context)


def closes_its_client(example, client, model):
    """Two calls inside `with client:` (which closes the client and its connection pool at the end)."""
    with client:
        SEEN.append(_pool_of(client))
        msgs = [{"role": "user", "content": example.prompt}]
        r = client.chat.completions.create(model=model, messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        client.chat.completions.create(model=model, messages=msgs)
    return 1.0


async def closes_its_client_async(example, client, model):
    async with client:
        SEEN.append(_pool_of(client))
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": example.prompt}])
    return float(r.choices[0].message.content is not None)


@pytest.fixture(scope="module")
def model_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(d, PRINTABLE, tool_tokens=True)
    tok = load_tokenizer(d)
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=128, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    return perturbed_model(cfg, seed=5).eval(), tok


def episodes(model_tok, fn, fresh_clients: bool = False):
    model, tok = model_tok
    engine = LLMEngine.from_model(model, tok, kv_cache_bytes=4 << 20, block_size=8)
    runner = AgentRunner(engine, fn, concurrency=3)
    if fresh_clients:  # the reference: every client built from scratch, its own SSL context too
        runner._call_sync = lambda ep: fn(**runner._kwargs(ep, openai.OpenAI(
            base_url=runner._url(ep), api_key="x", max_retries=0)))
    examples = [Example(prompt=f"task {i}", answer="0") for i in range(4)]
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=40 + i) for i in range(4)]
    SEEN.clear()
    try:
        return runner.run(examples, params), list(SEEN), id(runner._ssl)
    finally:
        runner.close()
        engine.close()


@pytest.mark.equivalence
def test_episode_clients_have_their_own_pools_over_one_ssl_context_and_sample_as_fresh_clients(model_tok):
    trajs, seen, ssl = episodes(model_tok, closes_its_client)
    assert len(trajs) == 8 and len(seen) == 8
    assert len({pool for pool, _ in seen}) == 8 and {ctx for _, ctx in seen} == {ssl}
    ref, ref_seen, _ = episodes(model_tok, closes_its_client, fresh_clients=True)
    assert len({ctx for _, ctx in ref_seen}) == 8
    assert [(t.prompt_ids, t.response_ids, t.mask, t.reward) for t in trajs] == [
        (t.prompt_ids, t.response_ids, t.mask, t.reward) for t in ref]


@pytest.mark.faults
def test_agents_closing_their_clients_leave_the_other_episodes_whole(model_tok):
    for fn, calls in ((closes_its_client, 2.0), (closes_its_client_async, 1.0)):
        trajs, seen, ssl = episodes(model_tok, fn)
        assert [t.finish for t in trajs] == ["done"] * 8, [t.error for t in trajs]
        assert all(t.counters["agent/calls"] == calls for t in trajs)
        assert len({pool for pool, _ in seen}) == 8 and {ctx for _, ctx in seen} == {ssl}
