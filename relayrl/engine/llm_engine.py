"""The first rollout engine: batched sampling over a contiguous KV cache.

    prompts x n ──expand──> sequences ──waves of max_num_seqs──> prefill (left-padded)
                                                                 └─> decode step by step:
                                                                     sample → append → finish? → drop finished rows

Finished rows are dropped from the batch (and the cache) as they end, so a long tail of lengths
does not keep computing dead rows. Each output carries the engine's `weights_version`, bumped by
every `load_weights`, so the driver can tell which policy produced a sample.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from relayrl.engine.kv_cache import StaticKVCache
from relayrl.engine.sampler import sample
from relayrl.engine.sampling_params import SamplingParams
from relayrl.models import CausalLM, load_pretrained


@dataclass
class CompletionSample:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    samples: list[CompletionSample]
    weights_version: int


@dataclass
class _Seq:
    request: int
    prompt: list[int]
    params: SamplingParams
    rng: random.Random
    tokens: list[int]
    logprobs: list[float]
    text: str | None = None
    finish: str | None = None


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer=None, max_num_seqs: int = 256, seed: int = 0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.eos_ids = set(model.config.eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.pad_id = model.config.pad_token_id or 0
        self.weights_version = 0
        self._rng = random.Random(seed)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, **kwargs) -> "LLMEngine":
        from relayrl.models.tokenizer import load_tokenizer

        return cls(load_pretrained(path, dtype=dtype), load_tokenizer(path), **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (name, tensor) pairs in Hugging Face names into the engine's parameters, casting to
        the engine's dtype. Every parameter must be given exactly once (a partial sync is a bug)."""
        # tied embeddings: lm_head.weight and embed_tokens.weight are one tensor under two names
        params = dict(self.model.named_parameters(remove_duplicate=False))
        seen = set()
        for name, t in weights:
            if name not in params:
                raise KeyError(f"engine has no parameter '{name}'")
            params[name].copy_(t)
            seen.add(id(params[name]))
        missing = [n for n, p in params.items() if id(p) not in seen]
        if missing:
            raise KeyError(f"weight sync left {len(missing)} parameter(s) stale, e.g. '{sorted(missing)[0]}'")
        self.weights_version += 1
        return self.weights_version

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer")
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(prompt)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        encoded = [self._encode(p) for p in prompts]
        seqs = []
        for r, (ids, sp) in enumerate(zip(encoded, params)):
            if not ids:
                raise ValueError(f"prompt {r} is empty")
            for j in range(sp.n):
                stream = f"{sp.seed}:{j}" if sp.seed is not None else self._rng.getrandbits(64)
                seqs.append(_Seq(r, ids, sp, random.Random(stream), [], []))
        # waves of similar prompt length waste less padding
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].prompt))
        for start in range(0, len(order), self.max_num_seqs):
            self._run_wave([seqs[i] for i in order[start:start + self.max_num_seqs]])
        outputs = [RequestOutput(r, ids, [], self.weights_version) for r, ids in enumerate(encoded)]
        for s in seqs:
            outputs[s.request].samples.append(
                CompletionSample(s.tokens, s.logprobs, s.text if s.text is not None else self._decode(s.tokens), s.finish)
            )
        return outputs

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _check_finished(self, s: _Seq) -> bool:
        tok, sp = s.tokens[-1], s.params
        if (tok in self.eos_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            s.finish = "stop"
        elif sp.stop and self.tokenizer is not None:
            text = self._decode(s.tokens)
            hits = [i for i in (text.find(x) for x in sp.stop) if i >= 0]
            if hits:
                s.finish, s.text = "stop", text[: min(hits)]
        if s.finish is None and len(s.tokens) >= sp.max_tokens:
            s.finish = "length"
        return s.finish is not None

    def _run_wave(self, seqs: list[_Seq]) -> None:
        cfg, model = self.model.config, self.model
        B, P = len(seqs), max(len(s.prompt) for s in seqs)
        max_new = max(s.params.max_tokens for s in seqs)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros(B, P + max_new, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, P - len(s.prompt):] = torch.tensor(s.prompt)
            mask[i, P - len(s.prompt):P] = 1
        per_row = lambda f, dt: torch.tensor([f(s.params) for s in seqs], dtype=dt)  # noqa: E731
        temp = per_row(lambda p: p.temperature, torch.float32)
        top_k = per_row(lambda p: p.top_k, torch.long)
        top_p = per_row(lambda p: p.top_p, torch.float32)
        min_p = per_row(lambda p: p.min_p, torch.float32)
        cache = StaticKVCache(cfg.num_hidden_layers, B, cfg.num_key_value_heads, P + max_new, cfg.head_dim, self.dtype)
        live = list(range(B))
        # only the last prompt position's logits are needed: skip lm_head on the rest of the prefill
        hidden = model(ids, attention_mask=mask[:, :P], kv_cache=cache, return_hidden=True)
        logits = model.lm_head(hidden[:, -1])
        cache.advance(P)
        for t in range(max_new):
            u = torch.tensor([seqs[i].rng.random() for i in live], dtype=torch.float64).float()
            tokens, logps = sample(logits, temp, top_k, top_p, min_p, u)
            keep = []
            for row, (i, tok, lp) in enumerate(zip(live, tokens.tolist(), logps.tolist())):
                s = seqs[i]
                s.tokens.append(tok)
                s.logprobs.append(lp)
                if not self._check_finished(s):
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(live):
                rows = torch.tensor(keep)
                cache.keep_rows(rows)
                mask, tokens = mask[rows], tokens[rows]
                temp, top_k, top_p, min_p = temp[rows], top_k[rows], top_p[rows], min_p[rows]
                live = [live[r] for r in keep]
            mask[:, P + t] = 1
            logits = model(tokens[:, None], attention_mask=mask[:, : P + t + 1], kv_cache=cache)[:, -1]
            cache.advance(1)
