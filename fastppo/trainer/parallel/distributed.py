"""Data parallelism over ``torch.distributed``, as ``torchrun`` launches it.

``torchrun --nproc_per_node=K -m fastppo train ...`` starts K ranks (gloo on CPU, NCCL on
CUDA). Each rank rolls out its own shard of the iteration's prompts; what must be global is made
so here: token counts (the loss of every rank is a token mean over all ranks' tokens, so summed
gradients are the whole batch's), whitening statistics, the KL fed to the adaptive controller,
and the logged metrics. Rank 0 alone writes logs and checkpoints. A single process is the
world-size-1 case of the same code.
"""

import importlib
import os
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ...errors import UsageError


def world_size() -> int:
    """The number of ranks torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank among them (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


class Ranks:
    def __init__(self, device_type: str):
        self.world = world_size()
        self.rank = rank()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.owns_group = self.world > 1 and not dist.is_initialized()
        if self.world > 1 and device_type == "cuda":
            # each rank's own GPU as the current one: NCCL's barriers and FSDP's gather buffers and
            # streams go to the current device, which is otherwise GPU 0 on every rank
            torch.cuda.set_device(self.local_rank)
        if self.owns_group:
            # torch._dynamo, when first imported after the process group exists (transformers
            # imports it while loading a model), keeps a reference to the group that
            # destroy_process_group cannot drop (see ``group`` for what that costs). Imported
            # first, it holds nothing.
            importlib.import_module("torch._dynamo")

            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")

    @property
    def group(self):
        """The world's process group, or None for one process.

        Looked up at each use, never kept: a reference held here would keep the group and its
        threads alive past destroy_process_group, to interpreter shutdown, where a gloo thread
        freeing its last all-reduce needs the GIL and aborts the process ("terminate called
        without an active exception").
        """
        return dist.group.WORLD if self.world > 1 else None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, tensor: Tensor) -> Tensor:
        """The sum over ranks (a new tensor; the input is left as it was)."""
        total = tensor.detach().clone()
        if self.world > 1:
            dist.all_reduce(total, group=self.group)
        return total

    def most(self, count: int) -> int:
        """The largest ``count`` over ranks."""
        if self.world == 1:
            return count
        top = torch.tensor(count, device=self.device())
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        return int(top)

    def mean_of(self, metrics: dict) -> dict:
        """Each float metric averaged over ranks."""
        if self.world == 1:
            return metrics
        keys = [k for k, v in metrics.items() if isinstance(v, float)]
        values = self.sum(torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device()))
        return {**metrics, **{k: float(v) / self.world for k, v in zip(keys, values)}}

    def sum_gradients(self, parameters) -> None:
        """All-reduce the gradients (summed), bucketed into one flat tensor per dtype."""
        if self.world == 1:
            return
        grads = [p.grad for p in parameters if p.grad is not None]
        for dtype in {g.dtype for g in grads}:
            bucket = [g for g in grads if g.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def device(self) -> torch.device:
        if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def on_main(self, check: Callable):
        """``check()`` on rank 0 alone, its result there (None elsewhere); a :class:`UsageError` it
        raises is raised on every rank, which would otherwise wait for rank 0 forever."""
        result, refusal = None, None
        if self.main:
            try:
                result = check()
            except UsageError as error:
                refusal = error
        shared = self.gather(refusal)[0] if self.world > 1 else refusal  # a copy, without the traceback
        if shared is not None:
            raise refusal or shared
        return result

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Destroy the process group if these ranks created it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
