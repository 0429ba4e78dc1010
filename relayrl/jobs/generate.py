"""`relayrl generate`: sample completions of prompts given on the command line, from a model directory or GGUF file.

    generate(model, prompts, params, chat=None, system=None) -> yields (prompt index, sample index, sample)

A prompt goes through the model's chat template as data.chat_template says (chat True: always, False: never, None:
auto), text the tokenizer cannot represent is refused in one line (relayrl.rollout.charset), and sampling stops at
every end-of-sequence id of the model (config.json's, the tokenizer's, generation_config.json's). Every check runs
before the model loads.

Like the rest of relayrl.jobs, it may import every layer below the CLI; it must never import relayrl.cli.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from relayrl.data import DataConfig, Example
from relayrl.data.chat import has_chat_template, string_template
from relayrl.engine import LLMEngine, SamplingParams
from relayrl.errors import PromptError, UserError
from relayrl.jobs.base_model import resolve_model
from relayrl.models.hf_io import generation_eos_ids, load_config
from relayrl.models.tokenizer import load_tokenizer
from relayrl.rollout.charset import check_representable
from relayrl.rollout.prompts import encode_text
from relayrl.single_controller.process_setup import configure_process


def generate(model: str, prompts: Sequence[str], params: SamplingParams, chat: bool | None = None,
             system: str | None = None) -> Iterator[tuple[int, int, object]]:
    for i, p in enumerate(prompts):
        if not p:  # the BOS token added below would otherwise make it a prompt
            raise PromptError(f"prompt {i} is empty: give some text to continue")
    mode = {True: "always", False: "never", None: "auto"}[chat]
    model_dir = resolve_model(model)  # no tokenizer: one line; a GGUF file: converted once into the cache
    params = replace(params, stop_token_ids=generation_eos_ids(model_dir))
    tok = load_tokenizer(model_dir)
    if mode == "always" and not has_chat_template(tok):
        raise UserError(f"--chat: the tokenizer of {model} has no chat template; drop --chat (the prompt is then "
                        "sent as raw text) or add a chat_template to its tokenizer_config.json")
    if system is not None and (mode == "never" or (mode == "auto" and not string_template(tok))):
        why = ("--no-chat sends raw text" if mode == "never" else
               f"the tokenizer of {model} has no chat template" if not has_chat_template(tok) else
               f"the chat template of {model} is for conversations only (relayrl's tiny tokenizers)")
        raise UserError(f"--system needs the chat template, but {why}; drop --system"
                        + ("" if mode == "never" or not has_chat_template(tok) else ", or give --chat"))
    # text the tokenizer would drop is refused, as in train and eval: the model would answer another prompt
    check_representable(tok, {"command-line": [Example(p, "") for p in prompts]},
                        DataConfig(chat_template=mode, system_prompt=system), str(model),
                        "rephrase the prompt, or use a model whose tokenizer has them",
                        max_tokens=load_config(model_dir).max_position_embeddings)
    ids = [encode_text(tok, p, mode, system) for p in prompts]
    configure_process()  # this process runs the model: its CPU kernels, decided once (relayrl.parallel.cpu_kernels)
    engine = LLMEngine.from_pretrained(model_dir)
    for i, out in enumerate(engine.generate(ids, params)):
        for j, s in enumerate(out.samples):
            yield i, j, s
