"""``--rollout-tp N``: the rollout copy split over groups of N ranks, filled from FSDP's shards.

Under ``--fsdp`` alone every rank decodes a whole copy of the policy (``rollout_weights.py``): the
model must fit one GPU beside its shards. With ``--rollout-tp N`` the ranks form groups of N
consecutive ranks (:class:`RolloutGroup`); each group decodes one batch together over a copy
sharded by ``fastppo.rollout.tensor_parallel`` (heads and MLP columns, vocabulary rows), each rank
holding 1/N of it and of the KV cache. Groups are data parallel: a group rolls out its ranks'
prompts together, and each rank keeps its own prompts' rows for the update, as without TP.

The copy is built on the meta device and sharded before any storage exists, so no rank ever holds
a whole tensor of it; its buffers (rotary frequencies) are the policy's. Each refresh fills it in
place from the policy's FSDP shards with DTensor's redistribute: a rank's FSDP shard of a
column-parallel matrix (split by output rows, as FSDP splits dim 0) is, when N is the world, the
very rows it decodes with, cast and copied with no communication; a row-parallel one (o, down)
takes one all-to-all; a norm, one all-gather of its few values. With groups (N below the world)
each group's N shards are gathered from the other groups' ranks (DTensor's redistribute over a
(replica, tp) mesh). Between rollouts the copy's storage is freed for the update, as the sampler's KV
cache is (``Sampler.sleep``), and each refresh gives it back; the sampler's CUDA graphs, which read
both, are captured again as a rollout starts.

With LoRA, each refresh merges the adapters into the copy (``W + s B A``, each rank its own part,
from the small adapters gathered whole): the frozen base's FSDP shards are split by rows while o
and down decode split by columns, so the copy is a second copy of the base, 1/N of it.
"""

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import UsageError
from .rollout_weights import RolloutWeights


@dataclass(frozen=True)
class RolloutGroup:
    """The ranks that decode one batch together: ``size`` consecutive ranks, this rank the ``member``-th
    of group ``index`` of ``count``."""

    size: int
    index: int
    member: int
    count: int

    @classmethod
    def of(cls, rank: int, world: int, size: int) -> "RolloutGroup":
        return cls(size, rank // size, rank % size, world // size)

    @property
    def first(self) -> int:
        """The group's first rank: the rank whose seeds and prompts the group's rollout uses."""
        return self.index * self.size


def check_rollout_tp(size: int, world: int) -> None:
    """One line for a ``--rollout-tp`` the ranks cannot take: without torchrun, or not dividing the
    world (the config's rules need ``--fsdp`` beside it)."""
    if size == 1:
        return
    if world == 1:
        raise UsageError(
            f"--rollout-tp {size} splits the rollout over {size} ranks, and this is one process: launch with "
            f"torchrun --nproc_per_node=N (N a multiple of {size})"
        )
    if world % size:
        raise UsageError(f"--rollout-tp {size} does not divide the {world} ranks torchrun started")


def check_splittable(model: nn.Module, size: int) -> None:
    """One line for a model the sampler cannot split over ``size`` ranks (its family, its heads)."""
    from ...rollout.tensor_parallel import Unsharded, tp_plan

    try:
        tp_plan(model, size)
    except Unsharded as why:
        raise UsageError(f"--rollout-tp {size}: {why}") from None


def _placements(target) -> tuple:
    """How a copy's parameter lies over the group: a DTensor's placements, else whole on each rank."""
    from torch.distributed.tensor import DTensor, Replicate

    return target.placements if isinstance(target, DTensor) else (Replicate(),)


def _local(target):
    from torch.distributed.tensor import DTensor

    return target.to_local() if isinstance(target, DTensor) else target


class ParallelRolloutWeights(RolloutWeights):
    """The rollout copy of ``policy`` in ``dtype`` on ``device``, split over ``group`` (before the
    policy is sharded: its buffers are read now, its weights at each :meth:`refresh`)."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype, device: torch.device, group: RolloutGroup, lora):
        from torch.distributed.device_mesh import init_device_mesh

        from ...rollout.tensor_parallel import parallelize

        check_splittable(policy, group.size)
        self.policy, self.dtype, self.device, self.group, self.lora = policy, dtype, device, group, lora
        self.gathered = True  # filled from the shards, never whole
        # rank = replica * N + member: a group's ranks are consecutive (one node's, for NVLink)
        self.mesh = init_device_mesh(device.type, (group.count, group.size), mesh_dim_names=("replica", "tp"))
        with torch.device("meta"):  # the policy's class (LoRA's layers are PEFT's, inside it)
            model = type(policy)(copy.deepcopy(policy.config)).to(dtype)
        parallelize(model, self.mesh["tp"], group.size)
        model.to_empty(device=device)
        own = dict(policy.named_buffers())
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(own[name])
        for module in model.modules():  # rotary embeddings keep their first frequencies beside the buffer
            if hasattr(module, "original_inv_freq") and hasattr(module, "inv_freq"):
                module.original_inv_freq = module.inv_freq.clone()
        model.eval().requires_grad_(False)
        self.model = model
        self._parts = dict(model.named_parameters())
        self._local_tensors = [_local(target) for target in self._parts.values()]
        self.release()  # until the first rollout

    def _placed(self, source, target):
        """``target``'s local part of ``source`` (a policy parameter: FSDP's dim-0 shard, or whole),
        in the copy's dtype, through DTensor's redistribute; where nothing moves, the shard's own
        storage (to be read, never written)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(source, DTensor):  # a parameter FSDP left whole
            whole = source.detach().to(self.device, self.dtype)
            return self._split(whole, target)
        local = source.to_local().to(self.device, self.dtype)
        shape, stride = source.shape, source.stride()
        if self.group.count == 1:  # the world is the group: FSDP's mesh and placement are the copy's
            on_mesh = DTensor.from_local(local, self.mesh["tp"], [Shard(0)], shape=shape, stride=stride)
            return on_mesh.redistribute(self.mesh["tp"], _placements(target)).to_local()
        if shape[0] % (self.group.count * self.group.size) == 0:  # FSDP's shard r is (replica, member)'s
            on_mesh = DTensor.from_local(local, self.mesh, [Shard(0), Shard(0)], shape=shape, stride=stride)
            return on_mesh.redistribute(self.mesh, [Replicate(), *_placements(target)]).to_local()
        return self._split(source.to(dtype=self.dtype).full_tensor().to(self.device), target)  # uneven: briefly whole

    def _split(self, whole, target):
        """``target``'s local part of a tensor this rank holds whole."""
        from torch.distributed.tensor import DTensor, Replicate

        replicated = DTensor.from_local(whole, self.mesh["tp"], [Replicate()], run_check=False)
        return replicated.redistribute(self.mesh["tp"], _placements(target)).to_local()

    @torch.no_grad()
    def refresh(self) -> None:
        """Every tensor of the copy filled from the policy's shards, adapters merged (its storage
        given back first, where :meth:`release` freed it)."""
        for local in self._local_tensors:
            local.untyped_storage().resize_(local.numel() * local.element_size())
        sources = dict(self.policy.named_parameters())
        adapted = {}
        if self.lora is not None:
            from peft.tuners.lora import LoraLayer

            adapted = {name: m for name, m in self.policy.named_modules() if isinstance(m, LoraLayer)}
        for name, target in self._parts.items():
            layer, leaf = name.rsplit(".", 1)
            placed = self._placed(sources[f"{layer}.base_layer.{leaf}" if layer in adapted else name], target)
            if layer in adapted and leaf == "weight":  # merged in fp32, rounded once (``placed`` may be
                # the shard itself: never written)
                placed = placed.float() + self._delta(adapted[layer], target)
            _local(target).copy_(placed)

    def _delta(self, layer, target):
        """``s B A`` of a LoRA ``layer``, only ``target``'s local part of it: B's rows of that part or
        A's columns (each adapter gathered whole: rank x features, small beside the layer)."""
        from torch.distributed.tensor import DTensor, Shard

        (adapter,) = layer.active_adapters  # a run's only one
        A, B = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight  # (r, in), (out, r)
        A, B = ((p.full_tensor() if isinstance(p, DTensor) else p).to(self.device, torch.float32) for p in (A, B))
        (placement,) = _placements(target)
        if isinstance(placement, Shard) and placement.dim == 0:
            B = B.chunk(self.group.size, dim=0)[self.group.member]
        elif isinstance(placement, Shard):
            A = A.chunk(self.group.size, dim=1)[self.group.member]
        return layer.scaling[adapter] * (B @ A)

    def freed(self) -> bool:
        return self._local_tensors[0].untyped_storage().nbytes() == 0

    def release(self) -> None:
        """Free the copy's storage until the next :meth:`refresh`: the update has it (the sampler's KV
        cache sleeps with it, and its CUDA graphs are captured again after)."""
        for local in self._local_tensors:
            local.untyped_storage().resize_(0)
