"""fastppo's device code: Triton kernels and the thin launchers that run them.

One module per kernel family (``logprobs``, ``ppo_loss``, ``gae``); each launcher takes tensors already shaped
the way its kernel expects and writes into output tensors it is given. Nothing here validates
arguments, chooses dtypes or knows about autograd: that is the job of ``fastppo.ops``.
"""

from . import gae, logprobs, ppo_loss

__all__ = ["logprobs", "ppo_loss", "gae"]
