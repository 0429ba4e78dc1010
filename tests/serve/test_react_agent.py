"""The ReAct calculator demo agent (examples/agents/react_calculator.py): its tool against hand-computed values and
Python's own arithmetic (and refusing what is not arithmetic); one episode against the live endpoint on a tiny model
taught the calculator conversation, whose recorded trajectory must be exactly the ids the responses returned.
"""

from __future__ import annotations

import importlib.util
import json
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

openai = pytest.importorskip("openai")

from relayrl.data.agent_tasks import PRINTABLE  # noqa: E402
from relayrl.engine import LLMEngine  # noqa: E402
from relayrl.envs.calculator import tool_call_text  # noqa: E402
from relayrl.envs.episode import ChatFormat  # noqa: E402
from relayrl.models.tokenizer import build_char_tokenizer, load_tokenizer  # noqa: E402
from relayrl.serve import Endpoint, ServerThread  # noqa: E402
from tests.helpers import perturbed_model, small_config  # noqa: E402

AGENT = Path(__file__).resolve().parents[2] / "examples" / "agents" / "react_calculator.py"


@pytest.fixture(scope="module")
def rc():
    spec = importlib.util.spec_from_file_location("react_calculator", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_agent_imports_no_relayrl():
    import ast

    tree = ast.parse(AGENT.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in names if m.split(".")[0] == "relayrl"}
    assert "openai" in names


# (expression, value worked out by hand)
HAND = [("48*37+95", 1871), ("27+82*18", 1503), ("65-87+10", -12), ("(12 + 7) * 3", 57), ("-(3-10)*2", 14),
        ("100-2*3*4+1", 77), ("12/4+1", 4), ("7/2", Fraction(7, 2)), ("((2))", 2), ("-5--5", 0), ("+8*-2", -16),
        ("99*99*99-1", 970298), ("1-2-3", -4), ("36/6/3", 2)]


@pytest.mark.unit
def test_the_evaluator_equals_hand_computed_values_and_python(rc):
    for expr, want in HAND:
        got = rc.evaluate(expr)
        assert got == want, expr
        python = eval(expr, {"__builtins__": {}})  # our own literals: Python's arithmetic is the reference
        assert got == Fraction(python) if isinstance(python, int) else float(got) == python, expr
    assert [rc.calculator(e) for e in ("7/2", "12/4+1", "1/3", "-10/4")] == ["3.5", "4", "0.333333333333", "-2.5"]


@pytest.mark.unit
def test_the_evaluator_refuses_what_is_not_integer_arithmetic(rc):
    refused = {
        "__import__('os').system('true')": "Call is not allowed",
        "2**10": "Pow is not allowed",
        "7//2": "FloorDiv is not allowed",
        "7%2": "Mod is not allowed",
        "x+1": "Name is not allowed",
        "1.5+1": "the constant 1.5 is not allowed",
        "True+1": "the constant True is not allowed",
        "'a'*3": "the constant 'a' is not allowed",
        "[1, 2]": "List is not allowed",
        "1 < 2": "Compare is not allowed",
        "(1).real": "Attribute is not allowed",
        "lambda: 1": "Lambda is not allowed",
        "1 +": "not an arithmetic expression",
        "": "the expression is empty",
        "1+" * 150 + "1": "too long",
        "9" * 59 + "*" + "9" * 59: "too large",
    }
    for expr, said in refused.items():
        with pytest.raises(ValueError, match=said):
            rc.evaluate(expr)
        assert rc.calculator(expr).startswith("error: "), expr
    with pytest.raises(ZeroDivisionError):
        rc.evaluate("5/(3-3)")
    assert rc.calculator("5/(3-3)") == "error: division by zero"
    with pytest.raises(ValueError, match="must be a string"):
        rc.evaluate(12)


QUESTION, EXPR, VALUE = "What is 48*37+95?", "48*37+95", "1871"
MAX_LEN = 256


@pytest.fixture(scope="module")
def taught(rc):
    """A tiny model taught (Adam on one conversation, its assistant turns only) to call the calculator on QUESTION
    and to repeat the tool's result, in the calculator environment's own format, served by the endpoint."""
    d = Path(__import__("tempfile").mkdtemp())
    build_char_tokenizer(d, PRINTABLE, tool_tokens=True)
    tok = load_tokenizer(d)
    fmt = ChatFormat(tok, [rc.CALCULATOR])
    user = [{"role": "user", "content": QUESTION}]
    prompt = fmt.prompt_ids(user)
    call = fmt.encode(tool_call_text("calculator", {"expression": EXPR}))
    obs = fmt.observation_ids([{"role": "tool", "content": VALUE}], call[-1])
    answer = fmt.encode(VALUE) + [tok.eos_token_id]
    seq = torch.tensor([prompt + call + obs + answer])
    trained = torch.zeros(seq.shape[1], dtype=torch.bool)
    trained[len(prompt):len(prompt) + len(call)] = True
    trained[-len(answer):] = True
    cfg = small_config(vocab_size=len(tok), max_position_embeddings=MAX_LEN, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, hidden_size=64, intermediate_size=128)
    torch.manual_seed(0)
    m = perturbed_model(cfg, seed=7)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    targets = seq[0, 1:][trained[1:]]
    for _ in range(500):
        logits = m(seq[:, :-1])[0][trained[1:]]
        loss = torch.nn.functional.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    engine = LLMEngine.from_model(m.eval(), tok, kv_cache_bytes=4 << 20, block_size=8)
    with ServerThread(Endpoint(engine, "tiny")) as s:
        yield s, fmt


class Spy:
    """An OpenAI client whose chat calls ask for the token ids and keep each response (what the test compares)."""

    def __init__(self, client, **settings):
        self.client, self.responses = client, []
        self.settings = {"temperature": 0, "max_tokens": 64, **settings}
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kw):
        r = self.client.chat.completions.create(**kw, **self.settings, extra_body={"return_token_ids": True})
        self.responses.append(r)
        return r


@pytest.mark.equivalence
def test_one_episode_against_the_endpoint_is_recorded_as_the_ids_it_was_served(rc, taught):
    server, fmt = taught
    spy = Spy(openai.OpenAI(base_url=server.episode_url("react-1"), api_key="x", max_retries=0))
    assert rc.run(SimpleNamespace(prompt=QUESTION, answer=VALUE), spy, "tiny") == 1.0
    r1, r2 = spy.responses  # a tool call, then the answer
    (call,) = r1.choices[0].message.tool_calls
    assert r1.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": EXPR})
    assert r2.choices[0].message.content == VALUE and not r2.choices[0].message.tool_calls
    p1, s1 = r1.model_extra["prompt_token_ids"], r1.choices[0].model_extra["token_ids"]
    s2 = r2.choices[0].model_extra["token_ids"]
    assert p1 == fmt.prompt_ids([{"role": "user", "content": QUESTION}])  # the tool went through the template
    obs = fmt.observation_ids([{"role": "tool", "content": VALUE}], s1[-1])  # the tool's reply, as the env renders it
    assert r2.model_extra["prompt_token_ids"] == p1 + s1 + obs  # the sampled ids reused, not re-rendered
    (line,) = server.endpoint.trajectory("react-1")
    assert line["prompt_ids"] == p1 and line["response_ids"] == s1 + obs + s2
    assert line["mask"] == [1] * len(s1) + [0] * len(obs) + [1] * len(s2)
    assert server.endpoint.recorder.counters("react-1") == {"calls": 2, "retokenize_drift": 0}
    # the same episode scored against another answer: the reward reads the answer, 0.0
    spy = Spy(openai.OpenAI(base_url=server.episode_url("react-2"), api_key="x", max_retries=0))
    assert rc.run(SimpleNamespace(prompt=QUESTION, answer="1870"), spy, "tiny") == 0.0
    assert len(spy.responses) == 2


@pytest.mark.faults
def test_an_episode_left_without_room_ends_unanswered_and_other_refusals_raise(rc, taught):
    server, _ = taught
    ex = SimpleNamespace(prompt=QUESTION, answer=VALUE)
    # 150 tokens fit after the question (256 in all), not after the tool call and its result: the server says
    # context_length_exceeded on the second call; the episode ends there, with no answer
    spy = Spy(openai.OpenAI(base_url=server.episode_url("react-room"), api_key="x", max_retries=0), max_tokens=150)
    assert rc.run(ex, spy, "tiny") == 0.0
    (r1,) = spy.responses
    assert r1.choices[0].message.tool_calls and r1.usage.prompt_tokens + 150 <= MAX_LEN
    assert len(server.endpoint.trajectory("react-room")) == 1
    spy = Spy(openai.OpenAI(base_url=server.episode_url("react-n"), api_key="x", max_retries=0), n=99)
    with pytest.raises(openai.BadRequestError, match="limit of 16"):
        rc.run(ex, spy, "tiny")
