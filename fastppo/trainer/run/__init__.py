"""The run directory: lock, inputs, logs, checkpoints, signals, summaries.

Claimed and locked (``directory.py``, ``lock.py``), its inputs recorded (``inputs.py``), its metrics
and examples logged and plotted (``log.py``, ``plot.py``), its state (``state.py``) checkpointed and
resumed (``checkpoint.py``), its stop signals (``signals.py``) and what it says of itself
(``summaries.py``)."""
