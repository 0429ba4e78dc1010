"""User-facing errors.

Anything a user can cause (bad config, bad model directory, empty dataset, a reward function that
cannot be imported) raises a subclass of `UserError`; the CLI prints its message on one line and
exits with status 2. Everything else is a bug and keeps its traceback.
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
