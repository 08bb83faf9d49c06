"""The one error type for what a user gave the trainer: a config, a data file, a model, a run
directory, a reward's return value. ``fastppo train`` prints it as one line and exits 2; any
other exception is a bug and keeps its traceback."""


class UsageError(ValueError):
    """Something the user gave is wrong; the message says what, naming the field, file or line."""


class TrainingFailed(RuntimeError):
    """The run ended without training: every optimizer step had a non-finite gradient."""
