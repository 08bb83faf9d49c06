"""The memory plan of a run and the micro-batch and KV memory that fit.

What a run holds on one device, line by line, the micro-batch and KV memory that fit (``plan.py``),
and ``--plan``'s printout (``printout.py``)."""
