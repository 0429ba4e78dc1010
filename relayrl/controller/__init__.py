"""This package is the RL loop alone: the Driver (sync weights, take a batch from the rollout source, advantages,
logprobs, the update, the step's metrics), the run's config (RunConfig), the advantage stage and the step's cost.

It is typed against protocols owned by the layers below (Policy, RolloutEngine, Scorer, WeightSync, and the rollout
source of relayrl.rollout); what builds the roles and runs the loop is relayrl.jobs.
"""
