"""relayrl's own environments as agent functions (rollout.agent: env:NAME): the environment's episode driven through
the OpenAI endpoint, so it runs through the same capture path as any user's agent.

    reset(example) -> messages ──> chat.completions.create(messages, tools) ──> reply (token ids returned)
                                   env.step({"role": "assistant", "content": decoded ids}) -> observation ...

The environment reads what relayrl's agent loop gives it (the sampled ids decoded, special tokens skipped), the
reply goes back to the endpoint as it came, and the observation follows it; with rollout.agent_max_total_tokens equal
to env.max_total_tokens, the endpoint's per-episode budget ends an episode where the agent loop would. So an episode
samples exactly the tokens relayrl's agent loop samples for the same seed (a test says so); what differs is only the
path: HTTP, JSON and the openai client.

rollout.agent_params are the `env:` section's settings (params, max_turns, tools, tool_timeout_s, ...).

It imports envs and the ground floor; the openai client's errors are read by their status code.
"""

from __future__ import annotations

from collections.abc import Callable

from relayrl.data import Example
from relayrl.envs.base import as_step_result, make_env
from relayrl.envs.config import EnvConfig
from relayrl.errors import ConfigError


def make_agent(name: str, params: dict, tokenizer) -> Callable:
    """The agent function of environment `name` (rollout.agent: env:NAME); `params`: EnvConfig's fields."""
    try:
        cfg = EnvConfig(name=name, **params)
    except ValueError as e:
        raise ConfigError(f"rollout.agent 'env:{name}': rollout.agent_params are the env section's settings: "
                          f"{str(e).splitlines()[0]}") from None
    make_env(cfg)  # an unknown environment or bad params: refused now, not in every episode

    def run(example: Example, client, model: str) -> dict:
        env = make_env(cfg)
        messages = list(env.reset(example))
        tools = [t.schema() for t in getattr(env, "tools", [])]
        reward, success, turns, finish, counters = 0.0, None, 0, "done", {}
        while True:
            kw = {"model": model, "messages": messages, "extra_body": {"return_token_ids": True}}
            if tools:
                kw["tools"] = tools
            try:
                reply = client.chat.completions.create(**kw)
            except Exception as e:  # the episode's token budget is spent: it ends as the agent loop's would
                if getattr(e, "status_code", None) == 400 and "context_length_exceeded" in str(e):
                    finish = "max_total_tokens"
                    break
                raise
            choice = reply.choices[0]
            ids = (choice.model_extra or {}).get("token_ids") or []
            text = tokenizer.decode(ids, skip_special_tokens=True)
            messages.append(choice.message.model_dump(exclude_none=True))
            turns += 1
            obs, r, done, info = as_step_result(env.step({"role": "assistant", "content": text}), name)
            reward += r
            for k in ("tool_calls", "tool_errors", "tool_timeouts"):
                counters[k] = counters.get(k, 0.0) + float(info.get(k, 0))
            if "success" in info:
                success = bool(info["success"])
            if done:
                break
            if turns >= cfg.max_turns:
                finish = "max_turns"
                break
            messages += list(obs or [])
        return {"reward": reward, "success": success if success is not None else reward >= 1.0,
                "counters": counters, "finish": finish}

    run.max_total_tokens = cfg.max_total_tokens  # the episode budget the runner gives the endpoint by default
    return run
