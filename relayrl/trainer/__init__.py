"""This package is the trainer: the actor's update (forward, backward, optimiser step), logprob recompute,
the optimiser and schedule, SFT, checkpointing of the actor, an MoE model's routing replay and router
terms (routing), and the Policy protocol the driver sees it through.

The trainer imports relayrl.parallel, relayrl.models, relayrl.algorithms, relayrl.checkpoint and
relayrl's ground floor; it must never import the engine, sync, the controller or the CLI: the controller
joins the trainer to the engine, through the weight sync.
"""
