"""The OpenAI-compatible endpoint, driven by the official `openai` client (sync and async) against a tiny model
served in-process by uvicorn on 127.0.0.1 (an ephemeral port, a thread).

References: a second engine on the same weights called directly (LLMEngine.generate) for every sampled id and
logprob; the chat template through ChatFormat for every prompt; the non-streaming response for the stream.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from relayrl.engine import LLMEngine, SamplingParams  # noqa: E402
from relayrl.envs.episode import ChatFormat  # noqa: E402
from relayrl.errors import ConfigError  # noqa: E402
from relayrl.serve import Endpoint, ServerThread, check_bind  # noqa: E402
from tests.helpers import perturbed_model, small_config  # noqa: E402

MAX_LEN = 192
LP_TOL = dict(atol=1e-5, rtol=0)  # the served engine batches differently than the reference: float rounding only


def engine_of(model, tok):
    return LLMEngine.from_model(model, tok, kv_cache_bytes=4 << 20, block_size=8)


@pytest.fixture(scope="module")
def server(model, tok):
    with ServerThread(Endpoint(engine_of(model, tok), "tiny", max_n=8)) as s:
        yield s


@pytest.fixture(scope="module")
def ref(model, tok):
    e = engine_of(model, tok)
    yield e
    e.close()


def free_blocks(server) -> int:
    return server.endpoint.loop.call(lambda e: e.block_manager.num_free_blocks).result(timeout=10)


def settle(server, timeout_s=10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.endpoint.loop.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.endpoint.loop.in_flight == 0


def client(server, **kw):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, **kw)


USER = [{"role": "user", "content": "what is 2+3?"}]


@pytest.mark.equivalence
def test_models_and_completions_equal_the_engine(server, ref, tok):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="12+7=", n=2, temperature=1.0, top_p=0.9, max_tokens=8, seed=5,
                             logprobs=2, extra_body={"return_token_ids": True})
    ids = [tok.bos_token_id] + tok("12+7=", add_special_tokens=False)["input_ids"]
    (want,) = ref.generate([ids], SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=8, seed=5, logprobs=2))
    assert r.model_extra["prompt_token_ids"] == ids
    assert len(r.choices) == 2
    for ch, s in zip(r.choices, want.samples, strict=True):
        assert ch.model_extra["token_ids"] == s.token_ids
        torch.testing.assert_close(torch.tensor(ch.logprobs.token_logprobs), torch.tensor(s.logprobs), **LP_TOL)
        assert ch.text == s.text and ch.finish_reason == s.finish_reason
        assert [set(d) for d in ch.logprobs.top_logprobs] == [{tok.decode([k]) for k in d} for d in s.top_logprobs]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in want.samples)


@pytest.mark.equivalence
def test_chat_async_equals_the_engine_on_the_templates_ids(server, ref, tok):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
            return await c.chat.completions.create(model="tiny", messages=USER, n=3, seed=11, max_tokens=10,
                                                   logprobs=True, top_logprobs=3, stop=["zz"],
                                                   extra_body={"return_token_ids": True})

    r = asyncio.run(go())
    fmt = ChatFormat(tok)
    ids = fmt.prompt_ids(USER)
    _, stop_ids = fmt.turn_stops(False)
    (want,) = ref.generate([ids], SamplingParams(n=3, seed=11, max_tokens=10, logprobs=3, stop=["zz"],
                                                 stop_token_ids=stop_ids))
    assert r.model_extra["prompt_token_ids"] == ids
    for ch, s in zip(r.choices, want.samples, strict=True):
        assert ch.model_extra["token_ids"] == s.token_ids
        assert ch.message.content == s.text and ch.message.role == "assistant"
        got = [t.logprob for t in ch.logprobs.content]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(s.logprobs), **LP_TOL)
        assert all(len(t.top_logprobs) == 3 for t in ch.logprobs.content)
    assert r.system_fingerprint == "relayrl-v0"


def _stream_chat(c, **kw):
    text, ids, lps, finish = "", [], [], None
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            ids += (ch.model_extra or {}).get("token_ids", [])
            lps += [t.logprob for t in (ch.logprobs.content if ch.logprobs else None) or []]
            finish = ch.finish_reason or finish
    return text, ids, lps, finish


@pytest.mark.equivalence
def test_streaming_equals_non_streaming(server):
    c = client(server)
    kw = dict(model="tiny", messages=USER, seed=3, max_tokens=24, logprobs=True, extra_body={"return_token_ids": True})
    r = c.chat.completions.create(**kw)
    text, ids, lps, finish = _stream_chat(c, **kw)
    ch = r.choices[0]
    assert (text, ids, finish) == (ch.message.content, ch.model_extra["token_ids"], ch.finish_reason)
    assert lps == [t.logprob for t in ch.logprobs.content]
    *_, last = c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    assert last.choices == [] and last.usage == r.usage
    # completions, with a stop string: nothing past the cut is ever streamed
    kw = dict(model="tiny", prompt="ab", seed=4, max_tokens=30, stop=[" "], extra_body={"return_token_ids": True})
    r = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, **kw))
    assert "".join(ch.text for k in chunks for ch in k.choices) == r.choices[0].text
    assert [t for k in chunks for ch in k.choices for t in ch.model_extra["token_ids"]] == r.choices[0].model_extra[
        "token_ids"]
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


@pytest.mark.equivalence
def test_episode_extension_reuses_the_sampled_ids_and_capture_equals_what_was_sampled(server, tok):
    c = openai.OpenAI(base_url=server.episode_url("ep-ext"), api_key="x", max_retries=0)
    fmt = ChatFormat(tok)
    r1 = c.chat.completions.create(model="tiny", messages=USER, seed=1, max_tokens=12, logprobs=True,
                                   extra_body={"return_token_ids": True})
    a1 = r1.choices[0]
    msgs = USER + [a1.message.model_dump(exclude_none=True), {"role": "user", "content": "and 4+4?"}]
    r2 = c.chat.completions.create(model="tiny", messages=msgs, seed=2, max_tokens=12, logprobs=True,
                                   extra_body={"return_token_ids": True})
    p1, s1 = r1.model_extra["prompt_token_ids"], a1.model_extra["token_ids"]
    obs = fmt.observation_ids([{"role": "user", "content": "and 4+4?"}], s1[-1])
    assert r2.model_extra["prompt_token_ids"] == p1 + s1 + obs  # token in, token out
    (line,) = server.endpoint.trajectory("ep-ext")
    s2 = r2.choices[0].model_extra["token_ids"]
    assert line["prompt_ids"] == p1 and line["response_ids"] == s1 + obs + s2
    assert line["mask"] == [1] * len(s1) + [0] * len(obs) + [1] * len(s2)
    want_lps = [t.logprob for t in a1.logprobs.content] + [0.0] * len(obs) + [
        t.logprob for t in r2.choices[0].logprobs.content]
    assert line["logprobs"] == want_lps
    assert line["versions"] == [0] * len(s1) + [-1] * len(obs) + [0] * len(s2)
    calls = server.endpoint.recorder.calls("ep-ext")
    assert [(cl.prompt_ids, cl.samples[0][0], cl.extended) for cl in calls] == [
        (p1, s1, False), (p1 + s1 + obs, s2, True)]
    assert server.endpoint.recorder.counters("ep-ext") == {"calls": 2, "retokenize_drift": 0}


@pytest.mark.equivalence
def test_a_changed_earlier_text_splits_the_episode_and_counts_drift(server, tok):
    c = client(server, default_headers={"X-Episode-Id": "ep-drift"})
    r1 = c.chat.completions.create(model="tiny", messages=USER, seed=1, max_tokens=8,
                                   extra_body={"return_token_ids": True})
    edited = {"role": "assistant", "content": r1.choices[0].message.content + "!"}
    msgs = USER + [edited, {"role": "user", "content": "go on"}]
    r2 = c.chat.completions.create(model="tiny", messages=msgs, seed=2, max_tokens=8,
                                   extra_body={"return_token_ids": True})
    assert r2.model_extra["prompt_token_ids"] == ChatFormat(tok).prompt_ids(msgs)  # rendered afresh, not mixed
    assert server.endpoint.recorder.counters("ep-drift") == {"calls": 2, "retokenize_drift": 1}
    lines = server.endpoint.trajectory("ep-drift")
    assert [ln["prompt_ids"] for ln in lines] == [r.model_extra["prompt_token_ids"] for r in (r1, r2)]


def _post(server, path, body, raw=False, headers=None):
    content = body if raw else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json",
                                                                     **(headers or {})}, timeout=30)


@pytest.mark.faults
def test_bad_requests_get_openai_4xx_bodies_and_the_server_goes_on(server):
    cases = [
        (b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
        ({"model": "tiny", "messages": USER, "frobnicate": 1}, 400, "frobnicate", "unknown field"),
        ({"model": "tiny", "messages": USER, "n": 9}, 400, "n", "limit of 8"),
        ({"model": "tiny", "messages": USER, "max_tokens": MAX_LEN}, 400, "max_tokens", "maximum context"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * MAX_LEN}]}, 400, "messages", "no room"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role must be"),
        ({"model": "tiny", "messages": USER, "temperature": -1}, 400, "temperature", "greater than or equal"),
        ({"model": "other", "messages": USER}, 404, "model", "does not exist"),
        ({"model": "tiny", "prompt": [10**6]}, 400, "prompt", "outside the vocabulary"),
    ]
    for body, status, param, said in cases:
        path = "/v1/completions" if "prompt" in (body if isinstance(body, dict) else {}) else "/v1/chat/completions"
        r = _post(server, path, body, raw=isinstance(body, bytes))
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert said in err["message"] and err["param"] == param and err["type"] == "invalid_request_error", err
    r = httpx.get(server.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="maximum context"):
        client(server).completions.create(model="tiny", prompt="a", max_tokens=MAX_LEN)
    assert client(server).completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text is not None


@pytest.mark.faults
def test_closed_by_default(model, tok):
    with pytest.raises(ConfigError, match="--token"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "s3cret")
    check_bind("::1", None)
    with ServerThread(Endpoint(engine_of(model, tok), "tiny", token="s3cret")) as s:
        r = httpx.get(s.url + "/v1/models", timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=s.base_url, api_key="s3cret").models.list().data[0].id == "tiny"


def _wait(cond, timeout_s=10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.faults
def test_a_client_that_disconnects_has_its_request_aborted_and_blocks_freed(server):
    settle(server)
    start = free_blocks(server)
    loop = server.endpoint.loop
    body = json.dumps({"model": "tiny", "prompt": "abc", "n": 4, "max_tokens": 180, "ignore_eos": True}).encode()
    # a non-streaming request, its client gone while the engine runs it (a plain socket: closed when we say)
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    steps = loop.steps
    _wait(lambda: loop.in_flight == 1 and loop.steps >= steps + 3)
    assert free_blocks(server) < start  # its KV is held
    sock.close()
    settle(server)
    assert free_blocks(server) == start
    assert loop.steps - steps < 180  # aborted, not run to its end
    # a streaming one: the first chunk read, then the client goes away
    steps = loop.steps
    with httpx.stream("POST", server.url + "/v1/completions", content=body[:-1] + b', "stream": true}',
                      headers={"content-type": "application/json"}, timeout=30) as r:
        next(r.iter_lines())
        assert loop.in_flight == 1
    settle(server)
    assert free_blocks(server) == start
    assert loop.steps - steps < 180


@pytest.mark.e2e
def test_16_concurrent_clients_are_batched_with_no_errors_and_no_leaked_blocks(server):
    settle(server)
    start, steps = free_blocks(server), server.endpoint.loop.steps

    async def one(c, i):
        r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"task {i}"}],
                                            seed=i, max_tokens=16, extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)), return_exceptions=True)

    got = asyncio.run(go())
    assert not [g for g in got if isinstance(g, BaseException)]
    settle(server)
    assert free_blocks(server) == start
    used = server.endpoint.loop.steps - steps
    assert used < sum(len(g) for g in got) / 2  # batched: far fewer engine steps than tokens
    c = client(server)
    for i in (0, 7, 15):  # alone, each request samples what it sampled in the crowd
        assert asyncio.run(_alone(server, i)) == got[i]
    assert c is not None


async def _alone(server, i):
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as c:
        r = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"task {i}"}],
                                            seed=i, max_tokens=16, extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluates arithmetic",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tool_server(tok):
    """A tiny model taught (a few hundred Adam steps on one sequence) to answer USER with CALL, greedily."""
    fmt = ChatFormat(tok, TOOLS)
    prompt = fmt.prompt_ids(USER)
    seq = torch.tensor([prompt + fmt.encode(CALL)])
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=MAX_LEN, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, hidden_size=64, intermediate_size=128)
    torch.manual_seed(0)
    m = perturbed_model(cfg, seed=7)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(400):
        logits = m(seq[:, :-1])[0, len(prompt) - 1:]
        loss = torch.nn.functional.cross_entropy(logits, seq[0, len(prompt):])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    with ServerThread(Endpoint(engine_of(m.eval(), tok), "tiny")) as s:
        yield s


@pytest.mark.equivalence
def test_tool_calls_round_trip(tool_server, tok):
    fmt = ChatFormat(tok, TOOLS)
    c = openai.OpenAI(base_url=tool_server.episode_url("ep-tools"), api_key="x", max_retries=0)
    kw = dict(model="tiny", tools=TOOLS, temperature=0, max_tokens=80, extra_body={"return_token_ids": True})
    r = c.chat.completions.create(messages=USER, **kw)
    ch = r.choices[0]
    assert r.model_extra["prompt_token_ids"] == fmt.prompt_ids(USER)  # the tools went through the template
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "calculator", {"expression": "2+3"})
    assert tok.decode(ch.model_extra["token_ids"]) == CALL  # stopped right after the closed call
    # streamed: the same call, in one delta at the end, and no call text leaked into the content
    chunks = list(c.chat.completions.create(messages=USER, stream=True, **kw))
    streamed = [tc for k in chunks for x in k.choices for tc in (x.delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        ("calculator", {"expression": "2+3"})]
    assert "".join(x.delta.content or "" for k in chunks for x in k.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # sent back with the tool's result: the episode reuses the sampled ids; a fresh render gives the same ids here
    tool_msg = {"role": "tool", "tool_call_id": call.id, "content": "5"}
    msgs = USER + [ch.message.model_dump(exclude_none=True), tool_msg]
    r2 = c.chat.completions.create(messages=msgs, **{**kw, "max_tokens": 4})
    want = r.model_extra["prompt_token_ids"] + ch.model_extra["token_ids"] + fmt.observation_ids(
        [tool_msg], ch.model_extra["token_ids"][-1])
    assert r2.model_extra["prompt_token_ids"] == want
    fresh = openai.OpenAI(base_url=tool_server.base_url, api_key="x", max_retries=0)
    r3 = fresh.chat.completions.create(messages=msgs, **{**kw, "max_tokens": 4})
    assert tok.decode(r3.model_extra["prompt_token_ids"]) == (
        "tools: calculator(expression)\nuser: what is 2+3?\nassistant: " + CALL + "<eos>\ntool: <tool_response>5"
        "</tool_response>\nassistant: ")
    assert tool_server.endpoint.recorder.counters("ep-tools")["retokenize_drift"] == 0


@pytest.mark.unit
def test_relayrl_serve_off_loopback_without_a_token_is_one_line_before_loading(capsys, tmp_path):
    from relayrl.cli.main import main

    assert main(["serve", "--model", str(tmp_path / "nothing"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--token" in err and "0.0.0.0" in err


@pytest.mark.equivalence
def test_n_choices_fork_the_episode_and_the_one_continued_keeps_its_ids(server, tok):
    c = openai.OpenAI(base_url=server.episode_url("ep-fork"), api_key="x", max_retries=0)
    r1 = c.chat.completions.create(model="tiny", messages=USER, n=2, seed=9, max_tokens=6, logprobs=True,
                                   extra_body={"return_token_ids": True})
    picked = r1.choices[1]
    msgs = USER + [picked.message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
    r2 = c.chat.completions.create(model="tiny", messages=msgs, seed=3, max_tokens=6,
                                   extra_body={"return_token_ids": True})
    p1 = r1.model_extra["prompt_token_ids"]
    s0, s1 = (ch.model_extra["token_ids"] for ch in r1.choices)
    obs = ChatFormat(tok).observation_ids([{"role": "user", "content": "ok"}], s1[-1])
    s2 = r2.choices[0].model_extra["token_ids"]
    lines = server.endpoint.trajectory("ep-fork")
    assert [(ln["prompt_ids"], ln["response_ids"]) for ln in lines] == [(p1, s0), (p1, s1 + obs + s2)]
    assert lines[1]["mask"] == [1] * len(s1) + [0] * len(obs) + [1] * len(s2)
    assert lines[0]["logprobs"] == [t.logprob for t in r1.choices[0].logprobs.content]


@pytest.mark.e2e
def test_a_model_directory_served_as_relayrl_serve_serves_it(model, tok, tmp_path):
    from relayrl.jobs.serve import build_endpoint
    from relayrl.models import save_pretrained

    tok.save_pretrained(str(tmp_path / "tok"))
    d = save_pretrained(model, tmp_path / "m", tokenizer_dir=tmp_path / "tok")
    with ServerThread(build_endpoint(str(d), max_n=2)) as s:
        c = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["m"]
        r = c.completions.create(model="m", prompt="ab", seed=2, max_tokens=6, extra_body={"return_token_ids": True})
        ids = [tok.bos_token_id] + tok("ab", add_special_tokens=False)["input_ids"]
        e = LLMEngine.from_pretrained(d)
        (want,) = e.generate([ids], SamplingParams(seed=2, max_tokens=6))
        e.close()
        assert r.choices[0].model_extra["token_ids"] == want.samples[0].token_ids
        with pytest.raises(openai.BadRequestError, match="limit of 2"):
            c.completions.create(model="m", prompt="ab", n=3)


@pytest.mark.equivalence
def test_weights_loaded_between_steps_are_the_version_responses_and_capture_carry(model, tok):
    with ServerThread(Endpoint(engine_of(model, tok), "tiny")) as s:
        c = openai.OpenAI(base_url=s.episode_url("ep-v"), api_key="x", max_retries=0)
        r1 = c.chat.completions.create(model="tiny", messages=USER, seed=1, max_tokens=4)
        v = s.endpoint.loop.call(lambda e: e.load_weights(model.state_dict().items())).result(timeout=30)
        msgs = USER + [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "k"}]
        r2 = c.chat.completions.create(model="tiny", messages=msgs, seed=1, max_tokens=4)
        assert (v, r1.system_fingerprint, r2.system_fingerprint) == (1, "relayrl-v0", "relayrl-v1")
        (line,) = s.endpoint.trajectory("ep-v")
        n1, n2 = r1.usage.completion_tokens, r2.usage.completion_tokens
        assert [x for x in line["versions"] if x != -1] == [0] * n1 + [1] * n2
        assert [cl.weights_version for cl in s.endpoint.recorder.calls("ep-v")] == [0, 1]
