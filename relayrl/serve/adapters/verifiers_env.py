"""A verifiers v1 environment as a relayrl agent: `rollout.agent: verifiers:ENV_ID`.

    rollout:
      agent: verifiers:my-env
      agent_params:                       # verifiers' own [env] block (without taskset.id), plus `sampling`
        agent: {max_turns: 8}             #   the seat's knobs (runtime, harness, max_turns, timeouts, ...)
        taskset: {split: train}           #   optional: else the taskset config of `data.task: verifiers`
        sampling: {max_tokens: 256}       #   the run's sampling as verifiers imposes it on every model call

make_agent(env_id, params) returns an `async def agent(example, base_url, model)` returning {"reward", "finish",
"counters": {"tool_calls"}} (episode_outcome). Each episode is one verifiers
episode, run by verifiers' own code only: the environment loaded by its loader (`resolve_env_config`,
`load_environment`), the example's task rebuilt as verifiers' env server rebuilds a dispatched task
(relayrl.data.verifiers_task.rebuild_task), then `env.serving()` and `env.run_slot` — its harness drives the model
through verifiers' interception server, whose eval client relays each request to the episode's base_url (the
relayrl endpoint records the tokens there). The reward is verifiers' own: the trace's weighted rewards
(Trace.reward, from Task.score); an episode of several traces (a multi-agent env) gets the mean over its trainable
traces. A failed verifiers episode (harness error, setup failure, timeout: `episode.ok` false) raises, so the runner
drops it and counts it.

relayrl's defaults on verifiers' config: a seat whose runtime verifiers leaves at its default (`prime`, a remote
sandbox) and whose harness executes no model-written code (`null`, an in-process chat loop: EXECUTES_CODE false)
runs in `subprocess` (this machine); a harness that executes model-written commands (`bash`, the coding agents) must
have its runtime pinned in agent_params (docker, ..., or subprocess knowingly): untrusted code is never run on the
training machine by default. Episode retries stay at verifiers' default of none (a retried attempt's model calls
would be recorded too). The eval client authenticates with the
value of $RELAYRL_API_KEY (set it when the endpoint has a token; anything works otherwise).

It imports relayrl.data (the task rebuild), relayrl.errors and, when an agent is made, verifiers.
"""

from __future__ import annotations

import json
from typing import Any

from relayrl.data.tasks import Example
from relayrl.data.verifiers_task import INSTALL, check_env_id, one_line, rebuild_task
from relayrl.errors import ConfigError

API_KEY_VAR = "RELAYRL_API_KEY"


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode that did not complete (its errors, as verifiers recorded them)."""


def make_agent(env_id: str, params: dict[str, Any] | None = None):
    """The agent function of verifiers environment `env_id` with `params` (see the module docstring)."""
    spec = VerifiersSpec(env_id, params or {})

    async def agent(example: Example, base_url: str, model: str) -> dict[str, Any]:
        return episode_outcome(await spec.run(example, base_url, model))

    agent.__name__ = agent.__qualname__ = f"verifiers:{env_id}"
    agent.spec = spec  # type: ignore[attr-defined] - for tests and introspection
    return agent


class VerifiersSpec:
    """A verifiers environment's config, checked once; each episode loads a fresh Env from it (cheap: verifiers
    builds an Env from config in well under a millisecond), so concurrent episodes share no state."""

    def __init__(self, env_id: str, params: dict[str, Any]):
        where = f"rollout.agent verifiers:{env_id}"
        check_env_id(env_id, where)
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: agent_params must be a mapping (verifiers' [env] block), got "
                              f"{type(params).__name__}")
        try:
            import verifiers.v1 as vf
            from verifiers.v1.configs.agent import agent_config_fields
            from verifiers.v1.runtimes import PrimeConfig, SubprocessConfig
            from verifiers.v1.utils.loaders import harness_class
        except ImportError as e:
            raise ConfigError(f"{INSTALL} ({type(e).__name__}: {e})") from None
        self.vf, self.env_id, self.where = vf, env_id, where
        raw = json.loads(json.dumps(params))  # a private copy (and JSON-able, as a config must be)
        sampling = raw.pop("sampling", None) or {}
        taskset = raw.pop("taskset", None)
        if taskset is not None and (not isinstance(taskset, dict) or "id" in taskset):
            raise ConfigError(f"{where}: agent_params.taskset is the taskset's config keys (a mapping, without id: "
                              "the id is the environment's)")
        self.raw, self.taskset_params = raw, taskset
        try:
            self.sampling = vf.SamplingConfig.model_validate(sampling)
        except Exception as e:
            raise ConfigError(f"{where}: agent_params.sampling: {one_line(e)}") from None
        self._pinned = {name for name, role in raw.items() if isinstance(role, dict) and "runtime" in role}
        self._agent_fields, self._prime, self._subprocess = agent_config_fields, PrimeConfig, SubprocessConfig
        self._harness_class = harness_class
        self._configs: dict[str, Any] = {}
        self.config(taskset or {})  # a bad key fails here, when the run starts, not in every episode

    def config(self, taskset: dict[str, Any]):
        """verifiers' env config for the taskset config `taskset` (cached)."""
        key = json.dumps(taskset, sort_keys=True)
        if key not in self._configs:
            try:
                config = self.vf.resolve_env_config({**self.raw, "taskset": {**taskset, "id": self.env_id}})
                config.taskset.task  # noqa: B018 - resolved now: a bad task config key fails here
            except Exception as e:
                raise ConfigError(f"{self.where}: verifiers cannot load it: {type(e).__name__}: {one_line(e)}"
                                  ) from None
            harnesses = config.agent_harnesses()
            for name, role in self._agent_fields(config).items():
                if name in self._pinned or not isinstance(role.runtime, self._prime):
                    continue
                if self._harness_class(harnesses[name].id).EXECUTES_CODE:
                    raise ConfigError(
                        f"{self.where}: the seat '{name}' runs harness '{harnesses[name].id}', which executes "
                        "model-written commands, in verifiers' default runtime (prime, a remote sandbox); pin the "
                        f"runtime that isolates them: agent_params: {{{name}: {{runtime: {{type: docker}}}}}} (or "
                        "type: subprocess to run them on this machine)")
                setattr(config, name, role.model_copy(update={"runtime": self._subprocess()}))
            self._configs[key] = config
        return self._configs[key]

    def taskset_of(self, example: Example) -> dict[str, Any]:
        """The taskset config of an episode: agent_params.taskset, else that of the `data.task: verifiers` that
        made the example (for the same environment), else the taskset's defaults."""
        if self.taskset_params is not None:
            return self.taskset_params
        made = example.meta.get("params") if example.meta.get("task") == "verifiers" else None
        if isinstance(made, dict) and made.get("env") == self.env_id:
            return made.get("taskset") or {}
        return {}

    def load(self, example: Example):
        """A fresh verifiers Env for `example`, and the example's task rebuilt in it."""
        env = self.vf.load_environment(self.config(self.taskset_of(example)))
        return env, rebuild_task(env.taskset, example)

    async def run(self, example: Example, base_url: str, model: str):
        """One verifiers episode of `example` against the OpenAI-compatible endpoint at `base_url`: the Episode."""
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        env, task = self.load(example)
        ctx = ModelContext(model=model, client=EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
                           sampling=self.sampling)
        async with env.serving():
            (slot,) = env.slots(task)
            episode = await env.run_slot(slot, ctx)
        if not episode.ok:
            errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
            said = "; ".join(f"{e.type}: {_line(e.message)}" for e in errors[-2:]) or "no error recorded"
            raise VerifiersEpisodeError(f"verifiers environment '{self.env_id}': the episode failed ({said})")
        return episode


# verifiers' stop conditions that cut an episode short, as the agent contract's `finish` (env/truncated)
FINISH = {"max_turns": "max_turns", "max_input_tokens": "max_total_tokens", "max_output_tokens": "max_total_tokens",
          "max_total_tokens": "max_total_tokens"}


def episode_outcome(episode) -> dict[str, Any]:
    """What the agent returns for a verifiers episode: its reward (episode_reward), `finish` max_turns /
    max_total_tokens when a verifiers limit stopped it, and its tool calls counted (tools/calls)."""
    finish = next((FINISH[t.stop_condition] for t in episode.traces if t.stop_condition in FINISH), "done")
    return {"reward": episode_reward(episode), "finish": finish,
            "counters": {"tool_calls": float(sum(len(t.tool_messages) for t in episode.traces))}}


def episode_reward(episode) -> float:
    """verifiers' reward of an episode: its one trace's (Trace.reward), or the mean over its trainable traces."""
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
    if not traces:
        raise VerifiersEpisodeError("the verifiers episode has no trace")
    return sum(float(t.reward) for t in traces) / len(traces)


def _line(text: str) -> str:
    return " ".join(str(text).split())[:300]
