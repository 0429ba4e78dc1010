"""Tied weights across layouts: which checkpoint entry each of a module's tensors is read from.

A tied model (tie_word_embeddings) holds its embedding once in one process: `lm_head.weight` and
`model.embed_tokens.weight` are one parameter, so its state dict names the weight twice and its optimizer keeps
ONE state, under the canonical name `model.embed_tokens.weight`. Cut into pipeline stages, the last stage holds its
own copy as `lm_head.weight` (relayrl.models.stage), with its own optimizer state, equal to the embedding's (the
pipeline sums the two copies' gradients): on another pp rank (1f1b), or on the same one (zbv, dualpipev).

    saved on      model entries                  optimizer state          loaded into a copy-holding module
    pp = 1        embed_tokens, lm_head (equal)  embed_tokens only        lm_head's state <- embed_tokens'
    pp > 1        embed_tokens, lm_head          both (equal)             each its own
    loaded into pp = 1: lm_head is the embedding itself; only embed_tokens' entries are read (the copy's redundant)

`TIED_ALIASES` names each copy and its canonical weight, as data. `plan_reads` turns the state dicts that
get_state_dict gave into the request DCP loads in place: an entry the checkpoint lacks is read from its canonical
name (under that name when this rank does not hold the canonical weight itself, else copied from it after the
load), and a copy that IS the canonical parameter (one process) reads nothing of its own. Whether a module is tied
comes from its `config` when it has one (CausalLM, a single stage); a merge of several stages has none, and then
the checkpoint's own evidence decides: it lacks a copy's optimizer state only when the model that wrote it held
the copy as the canonical parameter, i.e. was tied.

This module imports torch and the checkpoint's errors only; it must never import the trainer, engine or controller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from relayrl.checkpoint.errors import CheckpointError

# copy -> canonical: the last stage's own lm_head of a tied model is a copy of the embedding
TIED_ALIASES: dict[str, str] = {"lm_head.weight": "model.embed_tokens.weight"}
MODEL = "model"  # the DCP state dict's top-level keys (relayrl.checkpoint.distributed)
OPTIM = "optimizer"
STATE = "state"


def tie_setting(model: nn.Module) -> bool | None:
    """The module's tie_word_embeddings, or None when it carries no config (a merge of pipeline stages)."""
    return getattr(getattr(model, "config", None), "tie_word_embeddings", None)


def _copy_into(dst: Any, src: Any) -> Any:
    if isinstance(dst, torch.Tensor):
        with torch.no_grad():
            dst.copy_(src)
        return dst
    return src  # a plain value (an optimizer's float step, say)


def plan_reads(path: Any, model: nn.Module, state: dict[str, Any], saved: Mapping[str, Any]
               ) -> tuple[dict[str, Any], Callable[[], None]]:
    """The state dict to dcp-load for `state` ({"model": ..., "optimizer": ...} as get_state_dict gave them, whose
    tensors are filled in place) from a checkpoint whose index entries are `saved`, and what to run after the load
    (the copies of a weight read once). A checkpoint whose copy shares the embedding's optimizer state (a tied
    model's), loaded into a model whose config says untied, is one CheckpointError line."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = tie_setting(model)
    model_sd: dict[str, Any] = state[MODEL]
    request_model = dict(model_sd)
    optim = state.get(OPTIM)
    osd_state: dict[str, dict[str, Any]] = optim[STATE] if optim is not None else {}
    request_state = dict(osd_state)
    after: list[Callable[[], None]] = []

    def has_state(fqn: str, fields) -> bool:
        return all(f"{OPTIM}.{STATE}.{fqn}.{f}" in saved for f in fields)

    for copy, canon in TIED_ALIASES.items():
        if copy not in params:
            continue
        if canon in params and params[canon] is params[copy]:  # one parameter under two names: read it once
            if copy in request_model and canon in request_model:
                del request_model[copy]
                after.append(lambda c=copy, k=canon: model_sd.__setitem__(c, model_sd[k]))
            continue
        # this module holds the copy as its own parameter
        if copy in osd_state and not has_state(copy, osd_state[copy]) and has_state(canon, osd_state[copy]):
            if tied is False:
                raise CheckpointError(
                    f"checkpoint {path} holds {copy!r} as {canon!r} (one optimizer state: saved from a model with "
                    f"tie_word_embeddings), but this model's {copy!r} is its own weight (tie_word_embeddings false): "
                    "load it into the model config it was saved with")
            _alias(request_state, osd_state, copy, canon, after)
        if copy in model_sd and f"{MODEL}.{copy}" not in saved and f"{MODEL}.{canon}" in saved and tied is not False:
            _alias(request_model, model_sd, copy, canon, after)

    request = {**state, MODEL: request_model}
    if optim is not None:
        request[OPTIM] = {**optim, STATE: request_state}

    def finish() -> None:
        for fn in after:
            fn()

    return request, finish


def _alias(request: dict[str, Any], full: dict[str, Any], copy: str, canon: str,
           after: list[Callable[[], None]]) -> None:
    """Read `copy`'s entry (a tensor, or an optimizer state's dict of them) from `canon`'s: under canon's name when
    `full` does not hold canon, else copied from canon's after the load."""
    entry = request.pop(copy)
    if canon not in full:
        request[canon] = entry  # the same tensors / dict: DCP fills `full`'s entry in place
        return
    if isinstance(entry, dict):
        after.append(lambda: entry.update({f: _copy_into(v, full[canon][f]) for f, v in entry.items()}))
    else:
        after.append(lambda: _copy_into(entry, full[canon]))
