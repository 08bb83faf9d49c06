"""The errors a run reports as one line, and their exit codes.

The errors ``fastppo train`` prints as one line: what a user gave the trainer (a config, a data
file, a model, a run directory, a reward's return value: exit 2), a reward function that failed
while the run went on, and a run that trained nothing or reached non-finite weights (exit 1). Any
other exception is a bug and keeps its traceback."""


class UsageError(ValueError):
    """Something the user gave is wrong; the message says what, naming the field, file or line."""


class TrainingFailed(RuntimeError):
    """The run ended without training: every optimizer step had a non-finite gradient."""


class RewardFailed(RuntimeError):
    """A reward function raised, or tried to exit the process, while scoring a batch."""
