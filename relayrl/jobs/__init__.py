"""This package holds the jobs an entry point runs: train (build the roles, run the driver, log, evaluate,
checkpoint, resume), sft, the demo, and the checks before a run starts (preflight).

It may import every layer below the CLI; it must never import relayrl.cli, which imports it.
"""
