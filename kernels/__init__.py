"""fastppo's device code: Triton kernels and the thin launchers that run them.

Nothing here validates arguments, chooses dtypes or knows about autograd; that is the job of
``fastppo.ops``. Launchers take tensors already shaped the way the kernels expect and write into
output tensors they are given.
"""

from .logprobs import logprobs_backward, logprobs_forward

__all__ = ["logprobs_forward", "logprobs_backward"]
