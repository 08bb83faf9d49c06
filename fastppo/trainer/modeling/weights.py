"""A model's weights made ready to train and saved: dropout off, gradient checkpointing, copies in
another dtype (the reference, the rollout copy), and saving in Hugging Face format with tied
weights written once.
"""

import copy
import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn


def disable_dropout(model: nn.Module) -> None:
    """Dropout off everywhere: PPO's ratio compares two passes that must see the same network."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def enable_checkpointing(model) -> None:
    """Activation checkpointing of every transformer block, non-reentrant (transformers 5 names the
    method ``activation_checkpointing_enable``, 4.x ``gradient_checkpointing_enable``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def copy_in_dtype(model: nn.Module, dtype: Optional[torch.dtype], empty_on: Optional[torch.device] = None) -> tuple:
    """``(copy, pairs)``: a copy of ``model`` whose parameters are new tensors in ``dtype`` (None:
    each its own), frozen, made without a full-precision intermediate; ``pairs`` lists ``(copy's,
    original)`` parameters. Tied weights stay tied (both names map to one new tensor); buffers keep
    their dtype. ``empty_on``: a parameter on the meta device becomes one with no storage on this
    device (to be given storage and filled later)."""

    def copied(p):
        if p.is_meta and empty_on is not None:
            empty = torch.empty(p.shape, dtype=dtype or p.dtype, device=empty_on)
            empty.untyped_storage().resize_(0)
            return empty
        return p.detach().to(dtype or p.dtype, copy=True)

    new = {id(p): nn.Parameter(copied(p), requires_grad=False) for p in model.parameters()}
    duplicate = copy.deepcopy(model, memo=dict(new)).eval()
    return duplicate, [(new[id(p)], p) for p in model.parameters()]


def frozen_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen, eval-mode copy of ``model`` with its parameters in ``dtype`` (the reference model)."""
    return copy_in_dtype(model, dtype)[0]


def tied_aliases(model) -> set:
    """The names of parameters that are another's (a tied LM head): each after the first of its
    tensor. A state dict gathered from shards or cast to another dtype holds them as separate
    copies, which would be saved twice."""
    seen, aliases = set(), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            aliases.add(name)
        seen.add(id(parameter))
    return aliases


def save_model(model, directory, dtype: torch.dtype, state_dict: dict = None) -> None:
    """``model.save_pretrained(directory)`` with the weights (default: the model's) in ``dtype`` and
    its config.json saying so: transformers records the in-memory dtype, which for fp32 master
    weights is not the one saved."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    aliases = tied_aliases(model)  # a tied LM head is the embedding: saved once, tied again on load
    state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items() if k not in aliases}
    model.save_pretrained(str(directory), state_dict=state_dict)
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]  # transformers 5, 4
    config.update({k: name for k in keys})
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
