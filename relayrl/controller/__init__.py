"""This package is the RL application: the driver (the loop), the roles (actor, reference, rollout,
reward) in this process or as worker groups, the weight sync's orchestration, and the train / sft / demo
jobs.

The controller may import every layer below the CLI; it must never import relayrl.cli, which imports it.
"""
