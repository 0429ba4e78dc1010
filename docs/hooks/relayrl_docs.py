"""mkdocs hook: the pages that are generated from the code at build time.

A page asks for generated text with a marker comment on a line of its own:

    <!-- relayrl:config -->                 every key of `relayrl train`'s and `relayrl sft`'s configs
    <!-- relayrl:cli -->                    every command and option of the `relayrl` parser
    <!-- relayrl:include PATH -->           a file of the repository, e.g. benchmarks/RESULTS.md

The configuration reference walks the pydantic models (RunConfig and each section it composes): key, type,
default, bounds and meaning. The meaning is the field's `description` when it has one, else a line kept in MEANINGS
below (for fields whose code has no comment, or one that says why rather than what), else the comment written
beside (or just above) the field in its source file; a field that a block comment above an earlier field names
sends the reader to that field. The CLI reference walks `build_parser()`; options without help text take theirs
from CLI_MEANINGS.
"""

from __future__ import annotations

import argparse
import ast
import enum
import inspect
import io
import json
import os
import re
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- relayrl:(config|cli|include)(?: (\S+))? -->$", re.M)

# What each top-level section is for (the sections' classes say more in their own docstrings where they have one).
SECTIONS = {
    "model": "Where the policy comes from: a Hugging Face directory or a GGUF file (converted once into a cache), or "
             "a tiny model built for a built-in task or over a dataset file's characters.",
    "data": "The prompts: a built-in task (generated, seeded) or a dataset file, and how they are split and "
            "rendered.",
    "reward": "What scores a sample: a weighted sum of reward functions and reward models, and the limits of the "
              "worker processes that run them.",
    "algo": "The algorithm: advantage estimator, policy loss and its aggregation, clipping, KL, entropy, the "
            "corrections for stale or mismatched samples, PPO's GAE settings, MoE routing.",
    "trainer": "The actor's update: optimiser, schedule, PPO epochs and batching, precision, packed rows, LoRA.",
    "rollout": "Sampling and the rollout engine: batch shape, sampling parameters, engine settings, and the "
               "rollout mode (sync, one-step-off, async).",
    "eval": "Held-out evaluation during a run.",
    "run": "The run itself: steps, seed, output directory, checkpoints, loggers, traces and profiling.",
    "parallel": "Where each role runs and in what layout: processes, data / tensor / context / pipeline / expert "
                "parallelism, placement of the engine, and the liveness deadlines.",
    "sync": "How weights move from the trainer to the engine after each update, and how each sync is verified.",
    "env": "Optional: multi-turn episodes in an environment (agents with tools). Absent: single-turn samples.",
    "critic": "Optional: PPO's value model (`algo.advantage: gae`). Every `trainer.*` key, plus where the critic "
              "starts and how long it trains alone.",
    "sft": "The supervised job's own settings.",
}

# Meanings of the fields that carry no comment in their source, by dotted key ([] marks a list's entries); `critic.*`
# falls back on `trainer.*`.
MEANINGS = {
    "model.tiny": "The tiny model's shape, used when `model.path` is null: its tokenizer covers a built-in task's "
                  "alphabet, or every character of a dataset file's prompts (as rendered) and answers.",
    "model.tiny.model_type": "Which family's layout the tiny model takes.",
    "model.tiny.hidden_size": "Width of the residual stream.",
    "model.tiny.intermediate_size": "Width of the MLP.",
    "model.tiny.num_hidden_layers": "Decoder layers.",
    "model.tiny.num_attention_heads": "Query heads.",
    "model.tiny.num_key_value_heads": "Key/value heads (grouped-query attention when fewer than the query heads).",
    "model.tiny.tie_word_embeddings": "The lm_head shares the embedding's weights.",
    "model.tiny.init_std": "Standard deviation of the random initialisation.",
    "model.tiny.seed": "Seed of the random initialisation.",
    "data.task": "A built-in task (`arith`, `sort`, `calculator`, `guess`, `python`), `reasoning_gym` (a dataset of "
                 "the reasoning-gym library), `verifiers` (the tasks of a verifiers v1 environment), your own task "
                 "factory as `pkg.module:factory` or `path/file.py:factory`, or `file` for a dataset file.",
    "data.task_params": "Keyword parameters of the task (e.g. `digits`, `ops`, `num_operands` for arith; `dataset`, "
                        "`config`, `system_prompt` for reasoning_gym; `env`, `taskset`, `limit` for verifiers; what "
                        "your factory takes); checked when the config loads (a factory's only for its name's form: it "
                        "is imported when the run starts).",
    "data.path": "The dataset file (`.jsonl` or `.parquet`) when `task: file`.",
    "data.eval_path": "A separate held-out file; without it the last `n_eval` rows of a seeded shuffle of `path` "
                      "are held out.",
    "data.prompt_field": "The column holding the prompt (a string or chat messages).",
    "data.answer_field": "The column holding the reference answer (null: none).",
    "data.format": "The file's layout: `plain`, `trl` (prompt plus any columns), `verl` (`reward_model.ground_truth`"
                   " is the answer), or `auto` (verl when rows have `reward_model` and message prompts, else plain).",
    "data.n_train": "Training examples generated for a task (a file trains on all its remaining rows); at most "
                    "1,000,000, since they are held in memory.",
    "data.n_eval": "Held-out examples (at most 1,000,000).",
    "data.seed": "Seed of the task's generator and of the file's train/eval split.",
    "data.chat_template": "String prompts through the tokenizer's chat template: `always`, `never` (raw text), or "
                          "`auto`: where the tokenizer has a template meant for them (not relayrl's tiny tokenizers, "
                          "whose template is for conversations). Message prompts always go through it.",
    "data.system_prompt": "A system message put before each prompt (needs the chat template: refused with "
                          "`chat_template: never`).",
    "reward.functions": "The reward is the weighted sum of these entries: built-in names, `module:function`, "
                        "`path/file.py:function`, or `model` for a reward model.",
    "reward.functions[].name": "A built-in reward (`task`, `exact_match`, `math`, `format`, `code_tests`), a "
                               "`module:function` or `path/file.py:function`, or `model` for a reward model.",
    "reward.functions[].weight": "Its weight in the sum.",
    "reward.functions[].params": "Keyword arguments passed to the function (for `model`: `batch_size`, `dtype`).",
    "reward.functions[].batch": "null: the form is told by the parameter names (a parameter named `completions` is "
                                "TRL's batch form); true / false say whether it is.",
    "reward.functions[].args": "`name` is a factory: called once at load as `factory(**args)`, it returns the "
                               "reward function.",
    "reward.timeout_s": "One call longer than this is killed and scores `on_failure` (counted in "
                        "`reward/timeouts`); a batch function's call covers one prompt's group.",
    "reward.workers": "Reward worker processes; 0 runs the functions in the driver (no isolation, no timeout). Two "
                      "by default: scoring runs between rollout and update, when the trainer's cores are idle.",
    "reward.memory_mb": "Address space of each reward worker (RLIMIT_AS); null: no limit.",
    "reward.cpu_s": "CPU seconds one call may use (RLIMIT_CPU); null: `timeout_s` rounded up.",
    "reward.on_failure": "The score of a call that raises, times out, crashes or returns something that is not a "
                         "finite real number.",
    "trainer.lr": "Peak learning rate (AdamW).",
    "trainer.weight_decay": "AdamW's decoupled weight decay.",
    "trainer.adam_beta1": "AdamW's beta1.",
    "trainer.adam_beta2": "AdamW's beta2.",
    "trainer.adam_eps": "AdamW's epsilon.",
    "trainer.lora.rank": "Rank r of each adapter.",
    "trainer.lora.alpha": "Scale numerator: the adapter's output is multiplied by alpha / rank.",
    "trainer.lora.dropout": "Dropout on the adapter's input (0: none; must be 0 with `parallel.tp` > 1).",
    "trainer.lora.target_modules": "Which linears get adapters, by their Hugging Face names.",
    "trainer.warmup_steps": "Steps of linear warm-up from 0 to `lr`.",
    "critic.warmup_updates": "RL steps in which the critic trains alone before the actor's first update.",
    "critic.lora": "Refused: the critic trains in full (its fresh value head must learn).",
    "algo.kl_kind": "The KL estimator: `k1`, `k2` or `k3`.",
    "algo.mis_low": "Lower edge of the MIS band (set with `mis_high`; both null: no MIS).",
    "algo.mis_high": "Upper edge of the MIS band (set with `mis_low`).",
    "algo.moe_z_loss_coef": "Weight of the router z-loss (ST-MoE); see `algo.moe_aux_loss_coef`.",
    "algo.max_resample_rounds": "How many times `filter_groups` resamples before training on what it has.",
    "rollout.prompts_per_step": "Prompts per RL step; each gets `group_size` samples.",
    "rollout.temperature": "Sampling temperature.",
    "rollout.top_p": "Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: off).",
    "rollout.top_k": "Keep the k most likely tokens (0: off).",
    "rollout.max_tokens": "Generation budget per sample (per turn in episodes); a dataset's `max_tokens` column may "
                          "lower it per prompt.",
    "rollout.stop": "Strings that end a sample.",
    "rollout.max_num_seqs": "Sequences the engine runs at once.",
    "rollout.block_size": "Tokens per KV-cache block.",
    "rollout.enable_prefix_caching": "Share the KV blocks of common prompt prefixes between requests.",
    "eval.max_tokens": "Generation budget per held-out prompt (per turn in episodes).",
    "parallel.dp_replicate": "Data-parallel replicas (DDP with `dp_mode: ddp`, HSDP's replicas with `dp_shard` > 1).",
    "parallel.dp_shard": "Data-parallel ranks that shard parameters, gradients and optimiser state (FSDP2).",
    "parallel.tp": "The trainer's tensor-parallel degree (must divide the heads).",
    "parallel.dp_mode": "How the data-parallel ranks hold the model: `fsdp` shards it (FSDP2; HSDP with "
                        "`dp_replicate` > 1), `ddp` replicates it.",
    "parallel.pp_schedule": "The pipeline schedule: `gpipe`, `1f1b`, `interleaved_1f1b`, `interleaved_zb`, `zbv` or "
                            "`dualpipev`.",
    "parallel.activation_checkpointing": "Recompute each layer's activations in backward to save memory.",
    "sync.canary_len": "Tokens per canary row; see `sync.canary_rows`.",
    "run.steps": "RL steps (one rollout batch and its update each).",
    "run.seed": "Seed of sampling, shuffling and initialisation.",
    "run.out_dir": "The run directory (config, metrics, checkpoints, final model).",
    "run.keep_last": "Complete checkpoints kept on disk (null: all).",
    "run.wandb_project": "W&B project (offline runs into RUN/wandb).",
    "run.wandb_name": "W&B run name; null: the name of `run.out_dir`.",
    "run.mlflow_experiment": "MLflow experiment name.",
    "env.name": "A built-in environment (`calculator`, `guess`, `python`) or your own `module:Class`.",
    "env.params": "Keyword arguments of the environment's constructor.",
    "env.max_turns": "Assistant turns per episode.",
    "env.max_total_tokens": "Prompt, every turn and every observation together, in tokens.",
    "env.tools": "Extra tools for tool-using environments, each `module:function`.",
    "env.tool_timeout_s": "A tool call longer than this comes back to the model as an error message.",
    "env.step_timeout_s": "An environment step longer than this ends its episode (`env/timeouts`).",
    "env.workers": "Threads that run environment steps beside the engine.",
    "sft.steps": "Optimiser steps.",
    "sft.batch_size": "Examples per step.",
    "sft.seed": "Seed of sampling and initialisation.",
    "sft.out_dir": "The run directory; the model is written to `OUT_DIR/model`.",
    "sft.tensorboard": "Write TensorBoard events beside `metrics.jsonl`.",
}

# Sections that exist in a class but are refused where they appear (a row, no table).
REFUSED = {"critic.lora"}

# Help for the parser's arguments that have none, by (command, dest); "" is the top-level parser.
CLI_MEANINGS = {
    ("train", "config"): "The run's YAML config (omit with --resume).",
    ("sft", "config"): "The SFT job's YAML config (optional: overrides alone use the defaults).",
    ("sft", "overrides"): "Dotted overrides, e.g. sft.steps=100.",
    ("generate", "model"): "A Hugging Face model directory.",
    ("generate", "prompts"): "Prompts to complete.",
    ("generate", "n"): "Samples per prompt.",
    ("generate", "max_tokens"): "Generation budget per sample.",
    ("generate", "temperature"): "0: greedy.",
    ("generate", "top_p"): "Nucleus sampling (1: off).",
    ("generate", "seed"): "Sampling seed.",
    ("report", "run_dir"): "A run directory.",
    ("sync-plan", "trainer_tp"): "The trainer's tensor-parallel degree.",
    ("sync-plan", "engine_tp"): "The engine's tensor-parallel degree.",
    ("plan", "gpus"): "GPUs in all.",
    ("plan", "nodes"): "Nodes the GPUs are spread over.",
    ("plan", "lora_rank"): "Plan a LoRA run of this rank (0: full fine-tuning).",
    ("plan", "json"): "Print the plan as JSON.",
    ("demo", "out"): "The demo's output directory.",
}

# ---------------------------------------------------------------------------------------------------- mkdocs hooks

def on_config(config):
    """Headings get GitHub's anchors (each space a hyphen, none merged), so that a link into a repository file
    (`HISTORY.md#...`) reaches the same heading on GitHub and on the included page."""
    from pymdownx.slugs import slugify

    config.mdx_configs.setdefault("toc", {})["slugify"] = slugify(case="lower")
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: _expand(m.group(1), m.group(2)), markdown)


def _expand(kind: str, arg: str | None) -> str:
    if kind == "config":
        return config_reference()
    if kind == "cli":
        return cli_reference()
    return include(arg)


# ---------------------------------------------------------------------------------------------------- includes

def include(rel: str) -> str:
    """A repository file's text; its links to its sibling markdown files point at the pages that include them."""
    text = (ROOT / rel).read_text()
    text = re.sub(r"^# .*\n", "", text, count=1)  # the page has its own title
    text = re.sub(r"\]\((RESULTS|HISTORY)\.md", lambda m: f"]({m.group(1).lower()}.md".replace("results", "index"),
                  text)
    # a `<word` in running text (e.g. /proc/<host pid>/root) is not an HTML tag: escape it outside code
    return "\n".join(line if line.startswith("    ") else _escape_tags(line) for line in text.split("\n"))


def _escape_tags(line: str) -> str:
    parts = re.split(r"(`[^`]*`)", line)
    parts[::2] = [re.sub(r"<(?=[A-Za-z/])", "&lt;", p) for p in parts[::2]]
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------- config

def config_reference() -> str:
    from relayrl.controller.config import RunConfig
    from relayrl.jobs.sft_config import SFTJobConfig  # config modules only: no torch

    out = ["## `relayrl train`", "",
           "`relayrl train CONFIG.yaml key=value ...` reads a `RunConfig`: the sections below, each optional in "
           "the file (a missing section takes its defaults).", ""]
    out += _model_tables(RunConfig, prefix="", level=3)
    out += ["## `relayrl sft`", "",
            "`relayrl sft [CONFIG.yaml] key=value ...` reads its own config. Its sections share the classes of "
            "`relayrl train`'s, with the defaults listed here where they differ.", ""]
    out += _sft_tables(SFTJobConfig, RunConfig)
    return "\n".join(out)


def _sft_tables(sft, run) -> list[str]:
    """A row per section that `relayrl sft` shares with `relayrl train` (with its defaults where they differ), then
    a table for each section of its own."""
    out = ["| section | keys | defaults that differ here |", "|---|---|---|"]
    own = []
    for name, field in sft.model_fields.items():
        sub, twin = _section_class(field.annotation), run.model_fields.get(name)
        if sub is None:
            raise RuntimeError(f"docs hook: {sft.__name__}.{name} is not a section; teach _sft_tables to list it")
        if twin is None or _section_class(twin.annotation) is not sub:
            own.append((name, sub))
            continue
        optional = " (optional)" if _optional(field.annotation) else ""
        out.append(f"| `{name}`{optional} | as [`{name}`](#{name}) | {_differences(_default(field), sub) or 'none'} |")
    out.append("")
    for name, sub in own:
        out += _model_tables(sub, prefix=name, level=3, intro=SECTIONS.get(name))
    return out


def _differences(instance, cls) -> str:
    """The fields of a section's default instance that differ from the class's own defaults."""
    if instance is None:
        return ""
    base = cls()
    diffs = [f"`{k}: {json.dumps(getattr(instance, k))}`" for k in cls.model_fields
             if getattr(instance, k) != getattr(base, k)]
    return ", ".join(diffs)


def _model_tables(cls, prefix: str, level: int, intro: str | None = None) -> list[str]:
    """A heading and table for `cls` (unless it is the root), then each nested section after it."""
    comments = _field_comments(cls)
    out, nested = [], []
    if prefix:
        out += [f"{'#' * level} `{prefix}`", ""]
        doc = cls.__dict__.get("__doc__")
        if intro:
            out += [intro, ""]
        elif doc and cls.__module__.startswith("relayrl"):
            out += [_cell(inspect.cleandoc(doc), table=False), ""]
    rows = []
    for name, field in cls.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        sub = _section_class(field.annotation)
        entries = _entry_class(field.annotation)
        if sub is not None and not prefix:  # the root's sections: each gets a heading and table of its own
            nested.append((key, sub))
            continue
        if sub is not None and key in REFUSED:
            rows.append((key, "section", "`null`", "", _describe(key, field, comments, name), None))
            continue
        if sub is not None:
            kind = "section" + (", optional (null: off)" if _optional(field.annotation) else "")
            nested.append((key, sub))
            rows.append((key, kind, "", "", _describe(key, field, comments, name) or SECTIONS.get(key, ""),
                         _slug(key)))
            continue
        if entries is not None:
            nested.append((key + "[]", entries))
        rows.append((key, _type(field.annotation), _yaml(_default(field), field), _bounds(field),
                     _describe(key, field, comments, name), _slug(key + "[]") if entries else None))
    if rows:
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key, typ, default, bounds, meaning, link in rows:
            typ = f"{typ} ({bounds})" if bounds else typ
            ref = f" See [`{key}`](#{link})." if link else ""
            out.append(f"| `{key}` | {_cell(typ)} | {_cell(default)} | {_cell(meaning)}{ref} |")
        out.append("")
    for key, sub in nested:
        top = key if "." not in key else None
        out += _model_tables(sub, prefix=key, level=min(level + (0 if top else 1), 4),
                             intro=SECTIONS.get(key) if top else None)
    return out


def _describe(key: str, field, comments: dict[str, str], name: str) -> str:
    alias = re.sub(r"^critic\.", "trainer.", key)
    text = field.description or MEANINGS.get(key) or comments.get(name) or MEANINGS.get(alias) or ""
    if text.startswith("@"):  # a field covered by the comment above an earlier one: name it in full
        text = f"See `{key.rsplit('.', 1)[0]}.{text[1:]}` above."
    text = re.sub(r"\bNone\b(?=[:),;])", "null", text).replace("both None", "both null")
    return _sentence(text)


def _sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return ""
    text = text[0].upper() + text[1:] if not text.startswith("`") else text
    return text if text.endswith((".", "?", ":")) else text + "."


def _slug(key: str) -> str:
    """The anchor python-markdown's toc gives a heading `` `key` ``."""
    return re.sub(r"[^\w\- ]", "", key).strip().lower().replace(" ", "-")


# -- types, defaults and bounds

def _strip_optional(ann):
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _optional(ann) -> bool:
    return typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in typing.get_args(ann)


def _is_config(t) -> bool:
    from relayrl.config import Config

    return inspect.isclass(t) and issubclass(t, Config)


def _section_class(ann):
    inner = _strip_optional(ann)
    return inner if _is_config(inner) else None


def _entry_class(ann):
    inner = _strip_optional(ann)
    if typing.get_origin(inner) is list:
        (arg,) = typing.get_args(inner) or (None,)
        return arg if _is_config(arg) else None
    return None


def _type(ann) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" if isinstance(a, str) else _yaml(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type(a) for a in args)
    if origin in (list, tuple, set):
        inner = ", ".join(_type(a) for a in args) if args else "any"
        if args and _is_config(args[0]):
            inner = "entry"
        return f"list[{inner}]"
    if origin is dict:
        return "mapping"
    if ann is typing.Any:
        return "any"
    if inspect.isclass(ann) and issubclass(ann, enum.Enum):
        return " | ".join(f"`{m.value}`" for m in ann)
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
        getattr(ann, "__name__", ""), str(ann).replace("typing.", ""))


def _default(field):
    if field.is_required():
        return _REQUIRED
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


_REQUIRED = object()


def _yaml(value, field=None) -> str:
    from relayrl.config import Config

    if value is _REQUIRED:
        return "required"
    if isinstance(value, Config):
        return "(section)"
    if isinstance(value, list) and value and isinstance(value[0], Config):
        value = [v.model_dump(mode="json", exclude_defaults=True) for v in value]
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`" if isinstance(value, (list, dict, bool, type(None))) else f"`{value!r}`"


def _bounds(field) -> str:
    parts = []
    metas = list(field.metadata)
    for arg in typing.get_args(field.annotation):  # Optional[Annotated[float, Field(gt=0)]]
        if typing.get_origin(arg) is typing.Annotated:
            for m in typing.get_args(arg)[1:]:
                metas += getattr(m, "metadata", [m])
    for m in metas:
        for attr, sym in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "at least")):
            v = getattr(m, attr, None)
            if v is not None and isinstance(m, (annotated_types.BaseMetadata, annotated_types.GroupedMetadata)):
                parts.append(f"{sym} {v}" + ((" entry" if v == 1 else " entries") if attr == "min_length" else ""))
    return ", ".join(dict.fromkeys(parts))


# -- comments beside the fields

def _field_comments(cls) -> dict[str, str]:
    """field name -> the comment beside it or the block just above it, for every class of cls's MRO."""
    out: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if k.__module__.startswith("relayrl")]):
        try:
            src = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        out.update(_comments_in_class(src))
    return out


def _comments_in_class(src: str) -> dict[str, str]:
    lines = src.splitlines()
    comments = {}  # line number (1-based) -> (comment text, whether the line holds only the comment)
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            alone = not lines[row - 1][: tok.start[1]].strip()
            text = tok.string.lstrip("#").strip()
            if not re.match(r"^(noqa|type:)", text):
                comments[row] = (text, alone)
    body = ast.parse(src).body[0].body
    out, block_owner = {}, None
    prev_end = 0
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            block_owner = None
            prev_end = getattr(node, "end_lineno", prev_end)
            continue
        name = node.target.id
        above, row = [], node.lineno - 1
        while row > prev_end and row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        beside = [comments[r][0] for r in range(node.lineno, node.end_lineno + 1)
                  if r in comments and not comments[r][1]]
        adjacent = node.lineno == prev_end + 1
        if above or beside:
            out[name] = " ".join(above + beside)
            block_owner = name if above and not beside else None
        elif block_owner and adjacent and re.search(rf"\b{re.escape(name)}\b", out[block_owner]):
            out[name] = "@" + block_owner
        prev_end = node.end_lineno
    return out


# ---------------------------------------------------------------------------------------------------- CLI

def cli_reference() -> str:
    from relayrl.cli.main import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps usage lines to the terminal: a fixed width, a stable page
    try:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        out = [f"`{parser.prog}`: {parser.description}.", "", "Options of every command (before it):", ""]
        out += _arguments(parser, skip={sub.dest})
        for name, p in sub.choices.items():
            out += [f"## `relayrl {name}`", "", _sentence(_cell(helps.get(name) or "", table=False)), "",
                    "```text", p.format_usage().strip(), "```", ""]
            out += _arguments(p, command=name)
        return "\n".join(out)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _arguments(parser: argparse.ArgumentParser, skip: set[str] = frozenset(), command: str = "") -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or a.dest in skip:
            continue
        name = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.metavar or a.dest}`"
        if a.option_strings and a.nargs != 0:
            name += f" `{a.metavar or a.dest.upper()}`"
        if not a.option_strings:
            name += {"?": " (optional)", "*": " (any number)", "+": " (one or more)"}.get(a.nargs, "")
        if a.required and a.option_strings:
            name += " (required)"
        default = "" if a.default in (None, argparse.SUPPRESS) or a.nargs == 0 else f"`{a.default}`"
        meaning = _sentence(a.help or CLI_MEANINGS.get((command, a.dest), ""))
        if a.choices:
            meaning = (meaning + " " if meaning else "") + "One of " + ", ".join(f"`{c}`" for c in a.choices) + "."
        if a.type not in (None, str) and a.nargs != 0:
            meaning = (meaning + " " if meaning else "") + f"({_type(a.type)})"
        rows.append(f"| {name} | {default} | {_cell(meaning)} |")
    if not rows:
        return []
    return ["| argument | default | meaning |", "|---|---|---|", *rows, ""]


# ---------------------------------------------------------------------------------------------------- text

def _cell(text: Any, table: bool = True) -> str:
    """Text for a markdown table cell (or a paragraph): one line, <, > and & escaped outside code spans."""
    s = " ".join(str(text).split())
    parts = re.split(r"(`[^`]*`)", s)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        if table:
            parts[i] = parts[i].replace("|", "\\|")
    return "".join(parts)
