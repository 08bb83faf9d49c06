"""The weights the sampler decodes with: the policy itself, or a copy in the rollout dtype.

Decoding is bound by reading the weights, so on CUDA the sampler reads a bf16 copy of the fp32
master weights: half the bytes per step, and flash-attn's kernels apply. The copy is device-local
and refreshed in place (one fused copy of every tensor, a few milliseconds) before each rollout,
so the sampler's KV cache, its CUDA graphs and its modules keep their addresses, and nothing is
serialised or sent to a second engine. Refreshing before the rollout rather than after each
optimizer step copies once per iteration however many steps it took, and also picks up weights
loaded by a resume. When the dtypes agree there is no copy: the sampler reads the policy's own
parameters.

A sharded policy (``--fsdp``) cannot be decoded: its blocks hold 1/N of their weights, gathered only
inside their own forward, and the lean decoders call the blocks' projections directly. So with
``gathered`` the copy is made whole before the policy is sharded, each refresh fills it from the
shards (one all-gather per tensor, each straight into its place in the copy), and :meth:`release`
frees its storage again for the update. The full model is then resident only during the rollout,
in the rollout dtype. Gathering once per rollout moves the weights once; gathering block by block
at each decode step would move them once per generated token. Freed storage comes back at another
address, so the sampler's CUDA graphs are off then.
"""

from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn

from .weights import copy_in_dtype


class RolloutWeights:
    """``model`` is what the sampler runs; :meth:`refresh` brings it up to date with the policy."""

    def __init__(
        self, policy: nn.Module, dtype: Optional[torch.dtype], gathered: bool = False, device: torch.device = None
    ):
        """``dtype`` None: the policy itself whatever its dtypes (LoRA, whose frozen base is already
        held in the rollout dtype), or with ``gathered`` a copy in the policy's own dtypes.
        ``gathered``: the policy is about to be sharded; the copy is filled from its shards, on
        ``device`` (a policy on the meta device, read shard by shard, gives it none of its own)."""
        self.policy, self.gathered = policy, gathered
        if not gathered and (dtype is None or all(p.dtype == dtype for p in policy.parameters())):
            self.model, self._targets, self._sources = policy, [], []
            return
        device = device or next(policy.parameters()).device
        self.model, pairs = copy_in_dtype(policy, dtype, empty_on=device if gathered else None)
        self._targets = [target for target, _ in pairs]
        # gathered: by name, holding none of the policy's whole tensors, which sharding replaces
        self._sources = [] if gathered else [source for _, source in pairs]
        if gathered:
            self._by_name = dict(self.model.named_parameters(remove_duplicate=False))
            self._buffers_on(device)
            self.release()

    def _buffers_on(self, device: torch.device) -> None:
        """The copy's buffers on ``device`` (a policy read shard by shard holds them on the host)."""
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)

    @property
    def shared(self) -> bool:
        """True when the sampler reads the policy's own parameters (nothing to refresh)."""
        return self.model is self.policy

    @torch.no_grad()
    def refresh(self) -> None:
        if not self.gathered:
            if self._targets:
                torch._foreach_copy_(self._targets, self._sources)
            return
        from torch.distributed.tensor import DTensor

        for name, source in self.policy.named_parameters():
            target = self._by_name[name]
            target.untyped_storage().resize_(target.numel() * target.element_size())
            # cast on the shard (brought from the CPU under --fsdp-offload), gather in the rollout
            # dtype: half the bytes of gathering fp32
            shard = source.to(device=target.device, dtype=target.dtype) if isinstance(source, DTensor) else None
            target.copy_(source if shard is None else shard.full_tensor())

    @contextmanager
    def whole(self):
        """The copy whole while the block runs: a gathered copy whose storage is free is filled (on
        every rank alike: the gathers are collectives) and freed again after."""
        freed = self.freed()
        if freed:
            self.refresh()
        try:
            yield self.model
        finally:
            if freed:
                self.release()

    def freed(self) -> bool:
        """Whether the copy's storage is free (:meth:`release`) until the next :meth:`refresh`."""
        return self.gathered and bool(self._targets) and self._targets[0].untyped_storage().nbytes() == 0

    def release(self) -> None:
        """Free a gathered copy's storage until the next :meth:`refresh` (no-op otherwise)."""
        if self.gathered:
            for target in self._targets:
                target.untyped_storage().resize_(0)
