"""The configuration: fields, the assembled config, its command line and rules.

One dataclass per concern, each field with its help and bound (``fields.py``), assembled and typed
(``config.py``), read from the command line and a ``--config`` file (``arguments.py``) and checked
by the rules that span fields (``rules.py``)."""
