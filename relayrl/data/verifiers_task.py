"""This module defines the `verifiers` task: the tasks of a verifiers v1 environment's taskset as relayrl examples,
scored by the environment's own rewards.

    data:
      task: verifiers
      task_params:
        env: my-env                 # the environment's id, as verifiers loads it (its taskset package)
        taskset: {split: train}     # the taskset's own config keys (its TasksetConfig, without id); optional
        limit: 1000                 # use the first `limit` tasks only (required for an infinite taskset)

    prompt  the task's chat messages: its system_prompt (when set) as a system message, then its prompt (a string
            as one user message; verifiers Messages as role + text)
    answer  the task data's `answer` field when it has a string one, else ""
    meta    {"task", "params", "vf_task": the task's data, dumped as verifiers' env server ships it
            (TaskData.model_dump(mode="json")), "vf_type": the Task class name}
    score   verifiers' own scoring (Task.score: the task's @vf.reward functions and judges, weighted) of a trace
            holding the prompt and the completion as one assistant turn; signals that need a runtime are
            skipped (verifiers' offline scoring, as `vf replay` does)

A rollout through verifiers' own harness (`rollout.agent: verifiers:ENV_ID`, relayrl.serve.adapters.verifiers_env)
rebuilds the task from meta["vf_task"] exactly as verifiers' env server does (`rebuild_task`): the row validated
into the taskset's TaskData type, wrapped in its Task type with the taskset config's task subtree.

`generate(n, seed)` draws from the taskset (its first `limit` tasks, in load() order): a permutation of them under
`seed`, repeated (each further pass permuted afresh) until n examples are drawn. relayrl's split (relayrl.data.split)
takes eval and train from different seeds, disjoint by prompt: the held-out tasks are never trained on.

Loading a config checks the parameters' names and types and that verifiers is installed, without importing it
(it takes seconds); the environment is imported when the task is built, the first thing a run does.

It imports the standard library, the task registry and relayrl.errors only (verifiers when the task is built);
it must never import another relayrl layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import threading
from typing import Any

from relayrl.data.tasks import Example, register_task
from relayrl.errors import ConfigError, DataError

NAME = "verifiers"
INSTALL = "data.task verifiers needs the verifiers package (0.4 or later): pip install verifiers (or relayrl[agents])"
PARAMS = ("env", "taskset", "limit")


def installed() -> bool:
    try:
        return importlib.util.find_spec("verifiers") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it (an import that is blocked)
        return False


def check_env_id(env: Any, where: str) -> None:
    if not isinstance(env, str) or not env.strip():
        raise ConfigError(f"{where} must name a verifiers environment (its taskset id, e.g. 'gsm8k' or "
                          f"'owner/name'), got {env!r}")


def load_taskset(env: str, taskset: dict[str, Any], where: str):
    """verifiers' own loader: the taskset config validated into the taskset's config type, the taskset built."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f"{INSTALL} ({type(e).__name__}: {e})") from None
    try:
        config = vf.taskset_config_type(env).model_validate({**taskset, "id": env})
        return vf.load_taskset(config)
    except Exception as e:  # not installed, no Taskset exported, a config key the taskset refuses, its __init__
        raise ConfigError(f"{where}: verifiers cannot load environment '{env}': {type(e).__name__}: "
                          f"{one_line(e)}") from None


def rebuild_task(taskset, example: Example):
    """The verifiers Task of `example`, as verifiers' env server rebuilds a dispatched task: the row validated into
    the taskset's TaskData type and wrapped in its Task type with the taskset config's task subtree. An example not
    made by this task (no meta['vf_task']) becomes a row {prompt, answer (when the TaskData has that field)}."""
    task_cls = type(taskset).task_type()
    data_cls = task_cls.data_type()
    row = example.meta.get("vf_task")
    if row is None:
        row = {"prompt": example.prompt}
        if "answer" in data_cls.model_fields:
            row["answer"] = example.answer
    try:
        data = data_cls.model_validate(row)
    except Exception as e:
        raise DataError(f"the example cannot be a {data_cls.__name__} of verifiers environment "
                        f"'{taskset.config.id}': {one_line(e)}") from None
    return task_cls(data, taskset.config.task)


def trace_reward(trace) -> float:
    """A verifiers trace's reward: its weighted rewards summed (Trace.reward)."""
    return float(trace.reward)


@register_task(NAME)
class VerifiersTask:
    name = NAME
    tool_tokens = False
    alphabet = None  # the tiny model's tokenizer is built over the generated examples' characters

    @staticmethod
    def check_params(**params: Any) -> None:
        """The config-time check (no import of verifiers)."""
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise ConfigError(f"task 'verifiers': unknown task_params {unknown}; it takes {', '.join(PARAMS)} "
                              "(the taskset's own config keys go under taskset)")
        check_env_id(params.get("env"), "task 'verifiers': task_params.env")
        if not isinstance(params.get("taskset", {}), dict):
            raise ConfigError("task 'verifiers': task_params.taskset must be a mapping of the taskset's config keys "
                              f"(got {type(params['taskset']).__name__})")
        if "id" in params.get("taskset", {}):
            raise ConfigError("task 'verifiers': the taskset's id is task_params.env; remove taskset.id")
        limit = params.get("limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"task 'verifiers': task_params.limit must be a positive integer (got {limit!r})")
        if not installed():
            raise ConfigError(INSTALL)

    def __init__(self, env: str | None = None, taskset: dict[str, Any] | None = None, limit: int | None = None):
        taskset = {} if taskset is None else dict(taskset)
        self.check_params(env=env, taskset=taskset, limit=limit)
        self.params: dict[str, Any] = {"env": env, "taskset": dict(taskset), "limit": limit}
        self.env = env
        self.taskset = load_taskset(env, taskset, "task 'verifiers'")
        self.limit = limit
        self._tasks: list | None = None

    def tasks(self) -> list:
        """The taskset's tasks (its first `limit`), loaded once."""
        if self._tasks is None:
            view = self.taskset
            if self.limit is not None:
                view = view.take(self.limit)
            elif not view.bounded:
                raise DataError(f"task 'verifiers': environment '{self.env}' has an infinite taskset; bound it with "
                                "task_params.limit")
            try:
                self._tasks = list(view)
            except Exception as e:  # the taskset's load(): a user's code
                raise DataError(f"task 'verifiers': environment '{self.env}' failed to load its tasks: "
                                f"{type(e).__name__}: {one_line(e)}") from None
            if not self._tasks:
                raise DataError(f"task 'verifiers': environment '{self.env}' has no tasks")
        return self._tasks

    def generate(self, n: int, seed: int) -> list[Example]:
        tasks = self.tasks()
        out: list[Example] = []
        rounds = 0
        while len(out) < n:
            order = list(range(len(tasks)))
            random.Random(f"{seed}/{rounds}").shuffle(order)
            out += [self._example(tasks[i]) for i in order[: n - len(out)]]
            rounds += 1
        return out

    def _example(self, task) -> Example:
        data = task.data
        answer = getattr(data, "answer", None)
        return Example(prompt=prompt_messages(task), answer=answer if isinstance(answer, str) else "",
                       meta={"task": self.name, "params": dict(self.params),
                             "vf_task": data.model_dump(mode="json"), "vf_type": type(task).__name__})

    def score(self, completion: str, example: Example) -> float:
        """verifiers' Task.score of a trace holding the example's prompt and `completion` as one assistant turn."""
        return trace_reward(run_coroutine(score_completion(rebuild_task(self.taskset, example), completion)))


def prompt_messages(task) -> list[dict[str, str]]:
    """The task's opening conversation as chat messages (role, text)."""
    from verifiers.v1.types import content_text

    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [{"role": m.role, "content": content_text(m.content) or ""} for m in data.prompt]
    else:  # the user opens the conversation (a user-simulator environment): the task's name stands for it
        messages.append({"role": "user", "content": data.description or data.name or f"task {task.key}"})
    return messages


async def score_completion(task, completion: str):
    """A verifiers Trace of `task` whose one turn is `completion`, scored by verifiers' Task.score (no runtime)."""
    import verifiers.v1 as vf
    from verifiers.v1 import graph

    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    prompt = [vf.SystemMessage(content=task.data.system_prompt)] if task.data.system_prompt else []
    if isinstance(task.data.prompt, str):
        prompt.append(vf.UserMessage(content=task.data.prompt))
    else:
        prompt += list(task.data.prompt or [])
    graph.prepare_turn(trace, prompt).commit(vf.Response(
        id="relayrl-score", created=0, model="", message=vf.AssistantMessage(content=completion),
        finish_reason="stop"))
    await task.score(trace)
    return trace


def run_coroutine(coro):
    """Run `coro` to its end from synchronous code (in a thread of its own when an event loop runs here)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: dict[str, Any] = {}

    def target():
        try:
            result["value"] = asyncio.run(coro)
        except BaseException as e:  # handed to the caller
            result["error"] = e

    t = threading.Thread(target=target, name="relayrl-verifiers-score")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:500] if text else "(no message)"
