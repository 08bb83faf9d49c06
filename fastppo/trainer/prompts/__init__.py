"""The prompts: built-in tasks and files, mapped, rendered, fitted, ordered.

Built-in tasks (``tasks.py``) or files (``files.py``) whose columns are mapped (``columns.py``),
chat rendered (``chat.py``), tokenized and fitted to the context (``dataset.py``), and drawn in the
epoch order (``order.py``)."""
