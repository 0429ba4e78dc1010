"""The Critic trains PPO's value model: V(s_t) for every token the policy chose, regressed on the GAE returns.

    values[:, t] = score(hidden state at t - 1)        the value of the state in which token t was chosen
                                                       (aligned like the logprobs: logp[:, t] = log p(ids[t] | ids[:t]))
    update: the Actor's loop (PPO epochs, mini-batches, exact micro-batch accumulation with global
            denominators, data parallel) with the clipped value loss (relayrl.algorithms.value_loss)
            in place of the policy objective

The value model is a relayrl.models.score.ScoreModel: the policy's architecture with a one-label head
(from the policy's weights with a fresh head, or a directory of its own). It runs under every layout the
actor does: its parameters shard and replicate the same way, and the head is a plain replicated layer.

It imports torch, relayrl.algorithms, relayrl.models, relayrl.parallel and the trainer's own modules only;
like all of the trainer, it must never import the engine, sync, the controller or the CLI.
"""

from __future__ import annotations

import torch

from relayrl.algorithms import AlgoConfig
from relayrl.algorithms.value_loss import value_loss
from relayrl.models.score import ScoreModel
from relayrl.parallel.dims import ParallelDims
from relayrl.trainer.actor import Actor
from relayrl.trainer.batch import TrainBatch
from relayrl.trainer.config import TrainerConfig


def token_values(model: ScoreModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] values aligned to tokens (column 0: 0)."""
    v = model(input_ids, attention_mask=attention_mask)[..., 0]
    return torch.nn.functional.pad(v[:, :-1], (1, 0))


class Critic(Actor):
    """The value model and its optimiser; `update` returns value_loss, clip_frac, value_mean, grad_norm, lr."""

    def __init__(self, model: ScoreModel, cfg: TrainerConfig, algo: AlgoConfig, *, total_steps: int, seed: int = 0,
                 dims: ParallelDims | None = None):
        # the value model neither replays routing nor adds the routers' losses (the actor's settings)
        algo = algo.model_copy(update=dict(routing_replay=False, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0))
        super().__init__(model, cfg, algo, total_steps=total_steps, temperature=1.0, seed=seed, dims=dims)
        self.guard.who = "critic"

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self.per_token(batch, lambda mb: token_values(self.model, mb.input_ids, mb.attention_mask))

    def loss(self, mb: TrainBatch, num_tokens: torch.Tensor, num_seqs: float,
             router_share: float | None = None) -> tuple[torch.Tensor, dict]:
        with self._autocast():
            v = token_values(self.model, mb.input_ids, mb.attention_mask).float()
        return value_loss(v, mb.values, mb.returns, mb.response_mask, clip=self.algo.value_clip,
                          num_tokens=num_tokens, num_seqs=num_seqs)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        out = super().update(batch)
        out.pop("ratio_max", None)  # a policy figure: the value loss has no ratio
        return out
