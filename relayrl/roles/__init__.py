"""This package says where each role runs and how it is called: the policy (actor, reference, critic) in this
process or as worker groups, the engine hosted on the trainer's ranks or in processes of its own, the rollout
worker, reward models, and the weight sync's orchestration between trainer and engine.

It may import relayrl.rollout (a rollout worker runs the agent loop beside its engine) and the layers below;
never the loop (relayrl.controller) or the jobs.
"""
