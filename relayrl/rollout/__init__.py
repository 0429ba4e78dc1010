"""This package produces samples: prompts encoded for the engine, single-turn groups and multi-turn episodes
(the agent loop), the streaming source of the one-step-off and asynchronous modes, and held-out evaluation. Every
sample is one record in flight (sample.Sample) until the driver batches a step's into a TrainBatch.

It imports the engine, environments, rewards and data below it; never the loop (relayrl.controller), the roles
or the jobs above.
"""
