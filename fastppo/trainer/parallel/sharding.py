"""Sharded data parallelism with FSDP2: every model's weights, gradients and AdamW state split over ranks.

``--fsdp`` wraps each transformer block of the policy, the critic and the reference with PyTorch's
``fully_shard``, then each model's root (embeddings, final norm, LM head, value head). A block's
weights are all-gathered just before its forward and freed after it (``--fsdp-reshard-after-forward``;
off keeps them to the backward, one all-gather instead of two at the cost of holding the gathered
blocks), and its gradients are reduce-scattered in the backward. Each rank holds 1/N of the fp32
masters, their gradients and their AdamW moments.

Mixed precision computes what one device computes under autocast: a block's linear weights are
gathered in the compute dtype (bf16 on CUDA: half the bytes), its norms (a small group of their
own) and the root in their own dtype, and no input is cast, so the residual stream stays fp32.
Gathering everything in bf16, FSDP's usual recipe, would make the embeddings' output and so the
whole residual stream bf16: 7% off the gradient of a tiny Llama, where reordering the batch moves
bf16 autocast's by 0.3%; this way the sharded gradient is the replicated one to 1e-5.

The fused loss reads the LM head's weight directly, outside any module's forward. So each model's
last hidden states come from :func:`last_hidden_state`, which for a sharded model runs as an FSDP
forward of the root, and the root is wrapped not to reshard after its forward: its parameters stay
gathered through the backward, whose end reduce-scatters the head's gradient like any other. That
gathers the head once per minibatch (V x H in fp32: 0.93 GB for a 152k x 1536 head, cast to the
compute dtype for the loss as on one device) and keeps it while the loss runs. Leaving the head
unsharded instead would keep it whole on every rank with its fp32 gradient and AdamW moments (16
bytes a parameter: 8.7 GB for Qwen2.5-7B's 152k x 3584 head). A vocabulary-parallel head (each rank
scoring every rank's tokens against its slice of the vocabulary, the log-sum-exp combined by an
all-reduce) would hold 1/N of the head and move the hidden states instead (N x tokens x H: 0.13 GB
for 2 ranks of 8192 bf16 tokens at H 4096, against the head's 2.5 GB there), but it needs the loss
kernels to reduce across ranks inside a chunk; it is not built.

Gradients are summed over ranks, not averaged: every rank's loss is already a token mean over all
ranks' tokens (``distributed.py``), as in the unsharded path. FSDP's sum is asked for explicitly
(divide factor 1, forced SUM), the same collective with gloo and NCCL.
"""

import types

import torch
from torch import nn

from ...errors import UsageError

_FORWARD = "fastppo_last_hidden_state"  # the FSDP-registered forward of a sharded model


def _backbone_hidden(model, input_ids, attention_mask, position_ids=None):
    """(B, L, H): the backbone's last hidden states (after its final norm)."""
    out = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state


def last_hidden_state(model, input_ids, attention_mask, position_ids=None):
    """(B, L, H): the model's last hidden states; for a sharded model, run as FSDP's forward of its
    root, so ``model.get_output_embeddings().weight`` is the gathered head until the backward (or
    :func:`reshard`) frees it."""
    forward = getattr(model, _FORWARD, None) or (lambda *inputs: _backbone_hidden(model, *inputs))
    return forward(input_ids, attention_mask, position_ids)


def blocks(model: nn.Module) -> list:
    """The model's transformer blocks: the modules of the classes that ``_no_split_modules`` names
    (transformers' own list of what must not be split across devices) in the model or the Hugging
    Face models inside it (a critic's backbone)."""
    names = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise UsageError(f"--fsdp: {type(model).__name__} names no transformer block class in _no_split_modules")
    return found


def _is_norm(module: nn.Module) -> bool:
    """A normalisation layer with weights (LayerNorm, RMSNorm: autocast leaves them in fp32)."""
    return "Norm" in type(module).__name__ and any(True for _ in module.parameters(recurse=False))


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(
    model: nn.Module,
    *,
    mesh,
    compute_dtype: torch.dtype,
    reshard_after_forward: bool,
    offload: bool,
    hidden_states: bool,
) -> nn.Module:
    """``model`` sharded in place over ``mesh``: its blocks, then its root. ``compute_dtype``: the
    dtype the blocks' linear weights are gathered in (FSDP's mixed precision; None: their own);
    gradients are reduced in fp32.
    ``hidden_states``: register :func:`last_hidden_state` as a forward (for models whose LM head the
    fused loss reads)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):  # torch 2.8 added it
        raise UsageError(f"--fsdp needs torch >= 2.8 (FSDP's summed reductions); this is torch {torch.__version__}")
    trained = any(p.requires_grad for p in model.parameters())
    options = dict(mesh=mesh, **({"offload_policy": CPUOffloadPolicy()} if offload and trained else {}))
    # What autocast computes in the compute dtype on one device (the blocks' linear layers) is
    # gathered in it; the rest (a block's norms, in a group of their own, and the root) in its own
    # dtype, and no input is cast: the residual stream and the norms are then what they are on one
    # device under autocast, and so are the numbers (tested).
    own_dtype = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    compute = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in blocks(model):
        norms = [m for m in block.modules() if _is_norm(m)]
        if norms:
            fully_shard(norms, mp_policy=own_dtype, reshard_after_forward=reshard_after_forward, **options)
        fully_shard(block, mp_policy=compute, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, mp_policy=own_dtype, reshard_after_forward=False, **options)  # gathered to the backward
    for module in model.modules():
        if is_sharded(module):
            module.set_gradient_divide_factor(1.0)  # a sum: each rank's loss is over the global token count
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM, which gloo has too
    if hidden_states:
        setattr(model, _FORWARD, types.MethodType(_backbone_hidden, model))
        register_fsdp_forward_method(model, _FORWARD)
    return model


def reshard(model: nn.Module) -> None:
    """Free what a no-grad pass left gathered (a backward would have): a sharded model's root, and
    its blocks when they are kept from forward to backward."""
    for module in model.modules() if model is not None else ():
        if is_sharded(module):
            module.reshard()


def full_state_dict(model: nn.Module) -> dict:
    """The whole state dict on the CPU of rank 0 (empty elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
