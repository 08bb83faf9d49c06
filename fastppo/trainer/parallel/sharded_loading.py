"""Sharded loading: under ``--fsdp`` no rank and no host process ever holds a whole model.

Loading a checkpoint whole on every rank and sharding it after costs each GPU (and its host) the
whole model: ~6 bytes a parameter for GRPO (fp32 masters and the bf16 reference) before anything
is sharded, so the largest model a run can start is smaller than the largest it can train. Here
the models are built with their parameters on the meta device (shapes, no storage; buffers such as
rotary frequencies are real, computed on the host as the model's own code computes them), wrapped
and sharded exactly as a loaded model would be (``build.py``: LoRA, critic, reference, FSDP), and
only then given storage: each rank's shards, read from the checkpoint's safetensors by
``torch.distributed.checkpoint`` with its Hugging Face reader, which asks each file for the slice
of each tensor that rank holds. The values are the file's, converted to the parameter's dtype as
``from_pretrained`` and a cast would: the same bits (tested).

What the checkpoint does not hold starts as it would after a whole load: a critic's value head at
zero, LoRA's A drawn and B at zero (``lora.py``'s ``initial_adapters``, whatever the device).

A checkpoint whose tensor names are not the model's (families whose experts transformers fuses
while loading) cannot be read by name: such a model loads whole, as before, and the start-up
log says so.
"""

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from ...errors import UsageError

SUFFIX = ".safetensors"


@contextlib.contextmanager
def parameters_on_meta():
    """While active, every parameter a module registers lives on the meta device; buffers do not."""
    register = nn.Module.register_parameter

    def on_meta(module, name, parameter):
        register(module, name, parameter)
        if parameter is not None and parameter.device.type != "meta":
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=parameter.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def checkpoint_names(path) -> set:
    """The tensor names in a model directory's safetensors files (their headers only)."""
    names = set()
    for file in sorted(Path(path).glob(f"*{SUFFIX}")):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        names.update(k for k in header if k != "__metadata__")
    return names


def unreadable(model: nn.Module, path) -> str:
    """Why ``model``'s parameters cannot be read from ``path`` by name ("" when they can)."""
    names = checkpoint_names(path)
    if not names:
        return f"{path} holds no {SUFFIX} files"
    # a tied parameter once, as checkpoints store it
    missing = sorted({name for name, _ in model.named_parameters()} - names)
    if missing:
        return f"{path} names its tensors otherwise ({missing[0]} is not among them)"
    return ""


def load_meta_policy(path):
    """``(policy, tokenizer)``: the causal LM of ``path`` with its parameters on the meta device (its
    config, its own classes; its generation config read)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    try:
        with parameters_on_meta():
            policy = AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        raise UsageError(f"--model {path}: not a causal LM transformers can load ({error})") from None
    if (Path(path) / "generation_config.json").is_file():
        policy.generation_config = GenerationConfig.from_pretrained(path)
    return policy, AutoTokenizer.from_pretrained(path)


def materialize(model: nn.Module, device: torch.device, checkpoint, names: dict, offloaded: bool = False) -> None:
    """``model`` (sharded, its parameters on the meta device) given storage on ``device`` (its shards
    in CPU memory when ``offloaded``, as FSDP's offload keeps them) and each parameter of ``names``
    (its name -> the checkpoint's) read from ``checkpoint``, each rank its own shard; buffers kept,
    moved to ``device``; the other parameters left for their owner to set."""
    import torch.distributed.checkpoint as dcp

    buffers = {name: buffer.to(device) for name, buffer in model.named_buffers()}
    model.to_empty(device=torch.device("cpu") if offloaded else device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    own = dict(model.named_parameters())
    state = {names[name]: own[name] for name in names}
    try:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(checkpoint)))
    except Exception as error:  # noqa: BLE001 - DCP wraps each rank's failure; one line names it
        first = (str(error).strip().splitlines() or [type(error).__name__])[-1][:200]
        raise UsageError(f"--model {checkpoint}: its weights could not be read shard by shard ({first})") from None


@torch.no_grad()
def set_whole(parameter, value: torch.Tensor) -> None:
    """``parameter`` set to the whole tensor ``value`` (every rank holding it): a sharded one takes
    its own shard of it, with no communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(parameter, DTensor):
        value = value.to(parameter.to_local().device, parameter.dtype)
        mine = distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=None)
        parameter.to_local().copy_(mine.to_local())
    else:
        parameter.copy_(value)
