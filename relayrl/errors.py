"""This module defines the errors a user can cause and fix.

Anything a user can cause (bad config, bad model directory, empty dataset, a reward function that
cannot be imported) raises a subclass of `UserError`; the CLI prints its message on one line and
exits with status 2. Everything else is a bug and keeps its traceback.

It is part of relayrl's ground floor: it imports nothing, and it must never import another relayrl
module, since every layer imports it.
"""


class UserError(Exception):
    """An error in the user's input: the message says what is wrong and what to do."""


class ConfigError(UserError):
    """A config key is unknown, has the wrong type or an impossible value."""


class ModelDirError(UserError):
    """A model directory is missing or malformed."""


class DataError(UserError):
    """A dataset is missing, empty or lacks a required field."""


class RewardError(UserError):
    """A reward function cannot be imported, or every sample of a step failed to score."""


class SamplingParamsError(UserError, ValueError):
    """A sampling setting is NaN, infinite, of the wrong type or out of range (a ValueError too, so
    callers that caught the ValueError SamplingParams used to raise keep working)."""


class PromptError(UserError, ValueError):
    """A prompt is empty, or leaves no room for a completion within the model's maximum length."""


class WeightShapeError(UserError):
    """A tensor given to the engine is unknown to the model config, missing, or not of its logical shape."""


class KVCacheError(UserError, ValueError):
    """The KV cache budget cannot hold one sequence (of the model's maximum length, or of a request's)."""


class TensorParallelError(UserError, ValueError):
    """A tensor-parallel degree does not divide the attention heads, KV heads or intermediate size."""


class RunFault(Exception):
    """The run cannot go on because of a fault outside its code and input: a worker process died,
    stopped answering heartbeats, or ran past its deadline. The CLI prints the message on one line
    and exits with status 3 (complete checkpoints are kept: resume with --resume)."""


class EnvError(UserError):
    """An environment cannot be built (unknown name, bad params), or failed on every episode of a step."""


class RunDirError(UserError):
    """A run directory cannot be used: it is a file, read-only or full, another live run holds it, or a
    `--resume` would change what its checkpoints hold (the model)."""
