"""This module defines the `reasoning_gym` task: any dataset of the reasoning-gym library, scored by its own
`score_answer`.

    data:
      task: reasoning_gym
      task_params:
        dataset: leg_counting          # a name reasoning_gym.create_dataset knows
        config: {max_animals: 5}       # that dataset's config keys (optional)
        system_prompt: default         # a key of reasoning_gym.utils.SYSTEM_PROMPTS, or null for none

    prompt  [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}, {"role": "user", "content": question}]
            (chat messages: the model's chat template renders them; the system prompts are reasoning-gym's own,
            which ask for the answer between <answer> and </answer> tags)
    answer  entry["answer"]
    meta    {"task", "params", "entry": the whole reasoning-gym entry} (its metadata may hold tuples and other
            non-JSON values: examples travel between relayrl's own processes pickled)
    score   dataset.score_answer(reasoning_gym.utils.extract_answer(completion), entry): the library's own
            function on the text of the last <answer>...</answer> (None without one, which scores 0)

`generate(n, seed)` is the first n entries of create_dataset(dataset, size=n, seed=seed, **config); train and
eval come from different seeds (relayrl.data.split derives them from data.seed, one per chunk of 256), and no
eval prompt is ever trained on. The dataset's own `size` and `seed` are therefore not task_params: the counts
are data.n_train / data.n_eval and the seed data.seed.

Loading a config checks the parameters' names and types and that reasoning-gym is installed, without importing
it (it takes a second and imports numpy and sympy); the dataset name and its config keys are checked when the
task is built, the first thing a run does (before any model is loaded).

It imports the standard library, the task registry and relayrl.errors only (reasoning_gym when the task is
built); it must never import another relayrl layer: data is a leaf, which rewards and the controller import.
"""

from __future__ import annotations

import difflib
import importlib.util
from typing import Any

from relayrl.data.tasks import Example, register_task
from relayrl.errors import ConfigError

NAME = "reasoning_gym"
INSTALL = "data.task reasoning_gym needs the reasoning-gym package: pip install reasoning-gym (or relayrl[tasks])"
PARAMS = ("dataset", "config", "system_prompt")
# reasoning-gym's own seeds: some datasets seed numpy with seed + index, which must stay below 2**32
SEED_MOD = 2**31


def installed() -> bool:
    try:
        return importlib.util.find_spec("reasoning_gym") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules holds None for it (an import that is blocked)
        return False


@register_task(NAME)
class ReasoningGymTask:
    name = NAME
    tool_tokens = False
    alphabet = None  # the tiny model's tokenizer is built over the generated examples' characters

    @staticmethod
    def check_params(**params: Any) -> None:
        """The config-time check (no import of reasoning_gym)."""
        for key in ("size", "seed"):
            if key in params or key in (params.get("config") or {}):
                raise ConfigError(f"task 'reasoning_gym': {key} is not a task parameter here; the number of examples "
                                  "is data.n_train / data.n_eval and the seed data.seed (train and eval are drawn "
                                  "from create_dataset with different seeds)")
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise ConfigError(f"task 'reasoning_gym': unknown task_params {unknown}; it takes {', '.join(PARAMS)} "
                              "(the dataset's own config keys go under config)")
        if not isinstance(params.get("dataset"), str) or not params["dataset"]:
            raise ConfigError("task 'reasoning_gym': task_params.dataset must name a reasoning-gym dataset, "
                              "e.g. {dataset: leg_counting}")
        if not isinstance(params.get("config", {}), dict):
            raise ConfigError("task 'reasoning_gym': task_params.config must be a mapping of the dataset's config "
                              f"keys (got {type(params['config']).__name__})")
        sp = params.get("system_prompt", "default")
        if sp is not None and not isinstance(sp, str):
            raise ConfigError("task 'reasoning_gym': task_params.system_prompt must name one of reasoning-gym's "
                              "SYSTEM_PROMPTS (e.g. default, direct) or be null")
        if not installed():
            raise ConfigError(INSTALL)

    def __init__(self, dataset: str | None = None, config: dict[str, Any] | None = None,
                 system_prompt: str | None = "default"):
        config = {} if config is None else config
        self.check_params(dataset=dataset, config=config, system_prompt=system_prompt)
        try:
            import reasoning_gym
            from reasoning_gym.factory import DATASETS
            from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer
        except ImportError as e:
            raise ConfigError(f"{INSTALL} ({type(e).__name__}: {e})") from None
        if dataset not in DATASETS:
            close = difflib.get_close_matches(dataset, list(DATASETS), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"it has {len(DATASETS)}, e.g. " + \
                ", ".join(sorted(DATASETS)[:5])
            raise ConfigError(f"task 'reasoning_gym': no dataset '{dataset}' in reasoning-gym; {hint}")
        if system_prompt is not None and system_prompt not in SYSTEM_PROMPTS:
            raise ConfigError(f"task 'reasoning_gym': system_prompt '{system_prompt}' is not one of reasoning-gym's "
                              f"SYSTEM_PROMPTS ({', '.join(SYSTEM_PROMPTS)}); or null for none")
        self.dataset = dataset
        self.config = dict(config)
        self.system_prompt = system_prompt
        self.params: dict[str, Any] = {"dataset": dataset, "config": dict(config), "system_prompt": system_prompt}
        self._system = None if system_prompt is None else SYSTEM_PROMPTS[system_prompt]
        self._create = reasoning_gym.create_dataset
        self._extract = extract_answer
        # The scorer: the dataset with the same config (score_answer may read it), reasoning-gym's defaults otherwise.
        self._scorer = self._build(size=1, seed=0)

    def _build(self, size: int, seed: int):
        try:
            return self._create(self.dataset, size=size, seed=seed, **self.config)
        except Exception as e:  # a config key the dataset lacks (TypeError), a value its validate() refuses, ...
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"task 'reasoning_gym': dataset '{self.dataset}' refuses config {self.config}: "
                              f"{type(e).__name__}: {msg}") from None

    def generate(self, n: int, seed: int) -> list[Example]:
        ds = self._build(size=n, seed=seed % SEED_MOD)
        out = []
        for i in range(n):
            entry = ds[i]
            messages = [{"role": "user", "content": entry["question"]}]
            if self._system is not None:
                messages.insert(0, {"role": "system", "content": self._system})
            answer = entry.get("answer")
            out.append(Example(prompt=messages, answer="" if answer is None else str(answer),
                               meta={"task": self.name, "params": dict(self.params), "entry": entry}))
        return out

    def score(self, completion: str, example: Example) -> float:
        return float(self._scorer.score_answer(self._extract(completion), example.meta["entry"]))
