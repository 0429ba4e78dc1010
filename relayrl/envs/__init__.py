"""Multi-turn environments: the Env protocol and its registry, tools, and each episode's token bookkeeping.

An episode alternates the engine's generation with an environment step until the environment says it is
done (or a turn or token budget runs out). The agent loop that drives the engine is the controller's
(relayrl.rollout.agent_loop); this layer holds what it drives: environments, tools, and the exact
token ids of every turn.

It imports the standard library, relayrl's ground floor, relayrl.rewards, relayrl.sandbox and
relayrl.data only; it must never import the engine, the trainer, sync or the controller.
"""
