"""The bench suite: every op beside what a user would otherwise run, measured side by side in one run.

``fastppo bench`` (``cli.py``) prints one table per op family; the pytest-benchmark files under
``bench/`` time the same cases. A family module (``logprobs.py``, ``losses.py``,
``advantages.py``) lists its cases: shapes, inputs, the fewest bytes the op must move, and the
contenders (fastppo, the naive PyTorch a trainer would write, ``torch.compile`` of it, and the
peers in ``peers.py``). ``runner.py`` measures them with ``measure.py``; ``report.py`` prints.
"""
