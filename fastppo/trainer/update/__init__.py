"""The learning step: layout, batch, advantages, loss and optimizer step.

Rows laid out shared or padded (``row_layout.py``, the probe that chooses in ``probe.py``), the batch
prepared (``batch.py``), the advantages of each estimator (``estimators.py``), the loss
(``loss.py``) and the guarded optimizer step (``optimizers.py``)."""
