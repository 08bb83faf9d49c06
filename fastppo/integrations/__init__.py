"""fastppo's kernels behind the signatures other trainers already call.

One module per trainer (``trl``, ``verl``, ``openrlhf``), each following the installed version of
its trainer (``peers.py``) and installable into it with ``patch()`` (``patching.py``); importing
one never imports the trainer itself.
"""
