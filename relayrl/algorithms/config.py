"""AlgoConfig says which algorithm pieces a run uses, with their coefficients (the `algo:` config section).

Names (advantage, loss, agg, kl_kind) are checked against the registries, so a typo is an error
naming the key and listing the choices:

    config error: loss: Value error, unknown loss 'ppo2'; known: gspo, ppo (got 'ppo2')

It imports pydantic, relayrl.config and the registry it checks names against (which knows the built-in names
without importing their modules or torch); it must never import another relayrl layer: the algorithms are a
leaf, which the trainer and the controller import.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from relayrl.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOSSES,
    Registry,
    advantage_is_token_level,
)
from relayrl.config import Config

PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]


def _check_name(registry: Registry, name: str) -> str:
    return registry.check(name)  # raises ValueError listing the known names


class AlgoConfig(Config):
    # advantage estimator: grpo | dr_grpo | rloo | remax (sequence-level; remax adds a greedy baseline rollout)
    # | reinforce_pp | reinforce_pp_baseline (token-level). norm_std divides by the group std (grpo), or by the
    # batch's token std (reinforce_pp*; False is OpenRLHF's --no_advantage_std_norm)
    advantage: str = "grpo"
    norm_std: bool = True
    # policy loss: ppo (token ratios) | gspo (sequence ratio); agg: how tokens reduce to a scalar
    loss: str = "ppo"
    agg: str = "token-mean"
    # clip range [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO clip-higher.
    # clip_low < 1 so the lower bound stays a positive ratio.
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0)
    # dual-clip: for A < 0 a token's loss is also capped at -dual_clip_c * A (c > 1; None: off)
    dual_clip_c: float | None = Field(None, gt=1)
    # KL(pi || ref) penalty, added to the loss when kl_coef > 0 and a reference model is run
    kl_coef: float = Field(0.0, ge=0)
    kl_kind: str = "k3"
    # entropy bonus: loss -= entropy_coef * entropy (negative values minimise entropy)
    entropy_coef: float = 0.0
    # rollout-vs-trainer correction: TIS weight cap (None: no TIS); MIS band on the
    # geometric-mean sequence ratio (both None: no MIS)
    tis_cap: PositiveFloat | None = 2.0
    mis_low: NonNegFloat | None = None
    mis_high: PositiveFloat | None = None
    # the policy the clipped ratio is taken against. recompute: the trainer's weights before the update
    # (pi_prox of decoupled PPO), with TIS / MIS weighting pi_prox / pi_behaviour; behaviour: the engine's
    # sampling logprobs themselves (plain PPO: no recompute, no correction for stale or mismatched samples)
    proximal: Literal["recompute", "behaviour"] = "recompute"
    # where the proximal logprobs come from (proximal=recompute). auto: an update that is one optimiser step on
    # the batch (one PPO epoch, one mini-batch, no LoRA dropout, nothing reading them before the update) takes the
    # logprobs of its own forward, detached: the same weights, so provably the recompute's numbers, without its
    # forward pass; any other update recomputes. recompute: always the extra forward (the former behaviour).
    # engine: the engine's own sampling logprobs, for an fp32 engine synced and verified every step (sync mode):
    # equal to the trainer's within the canary's bound, not exactly (relayrl.controller.config.old_logp_source)
    old_logp: Literal["auto", "recompute", "engine"] = "auto"
    # PPO with a critic (advantage: gae): GAE's discount and lambda (verl's algorithm.gamma / algorithm.lam),
    # the critic's value clip (None: none), whitening of the advantages over the batch's model tokens, and
    # the KL put in the reward (kl_coef then penalises each token's reward instead of adding a loss term).
    # gamma and kl_in_reward also apply to reinforce_pp / reinforce_pp_baseline (OpenRLHF --gamma, and
    # --init_kl_coef without --use_kl_loss); lam, value_clip and whiten_advantages are gae's only
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    value_clip: PositiveFloat | None = 0.2
    whiten_advantages: bool = True
    kl_in_reward: bool = False
    # MoE models (relayrl.models.moe). routing_replay (R3): the old-logprob, reference and update forwards use the
    # experts the rollout engine routed each token to (its record, TrainBatch.routing) instead of routing again, so
    # the trainer scores a token through the experts that sampled it: a bf16 engine and an fp32 trainer otherwise
    # choose different experts on near-tied tokens (moe/routing_mismatch), and the ratio then measures that, not the
    # policy's change. The routers keep their gradient (the replayed experts' weights are the router's
    # probabilities). Refused for a dense model and for multi-turn episodes (no record).
    routing_replay: bool = False
    # the routers' auxiliary losses, added to the policy loss (relayrl.models.router_losses): load balancing
    # (Switch Transformer; transformers' router_aux_loss_coef) and the router z-loss (ST-MoE). 0 (off) for RL: the
    # policy starts from a pretrained model whose routers are already balanced; a balancing term pulls the routers
    # towards uniform load whatever the reward, outside the clipped ratio (nothing bounds how far it moves the
    # policy per step), and under routing replay the forward does not even use the routers' choices. Turn them on
    # when the trainer-side load (moe/load_max_over_mean) drifts up over a long run
    moe_aux_loss_coef: float = Field(0.0, ge=0)
    moe_z_loss_coef: float = Field(0.0, ge=0)
    # DAPO dynamic sampling: drop groups without reward spread, resample up to N rounds
    filter_groups: bool = False
    max_resample_rounds: int = Field(3, ge=0)

    @field_validator("advantage")
    @classmethod
    def _advantage_known(cls, v: str) -> str:
        return _check_name(ADVANTAGES, v)

    @field_validator("loss")
    @classmethod
    def _loss_known(cls, v: str) -> str:
        return _check_name(LOSSES, v)

    @field_validator("agg")
    @classmethod
    def _agg_known(cls, v: str) -> str:
        return _check_name(AGGREGATIONS, v)

    @field_validator("kl_kind")
    @classmethod
    def _kl_known(cls, v: str) -> str:
        return _check_name(KL_ESTIMATORS, v)

    @model_validator(mode="after")
    def _kl_in_reward_needs_token_rewards(self) -> AlgoConfig:
        # a sequence-level estimator never reads a per-token reward, and the loss term is off: no KL at all
        if self.kl_in_reward and not advantage_is_token_level(self.advantage):
            raise ValueError(f"kl_in_reward puts the KL in token rewards, which '{self.advantage}' does not use "
                             "(it would train with no KL at all): use a token-level estimator (gae, reinforce_pp, "
                             "reinforce_pp_baseline) or keep the KL in the loss (kl_in_reward=false)")
        return self

    @model_validator(mode="after")
    def _mis_band(self) -> AlgoConfig:
        if (self.mis_low is None) != (self.mis_high is None):
            raise ValueError("mis_low and mis_high must be set together (or both left unset)")
        if self.mis_low is not None and self.mis_high is not None and self.mis_low >= self.mis_high:
            raise ValueError(f"mis_low ({self.mis_low}) must be below mis_high ({self.mis_high})")
        return self

    @property
    def uses_router(self) -> bool:
        """Whether the run needs the MoE routers' record in the update (replay or an auxiliary loss)."""
        return self.routing_replay or self.moe_aux_loss_coef > 0 or self.moe_z_loss_coef > 0

    @property
    def uses_mis(self) -> bool:
        return self.mis_low is not None and self.mis_high is not None
