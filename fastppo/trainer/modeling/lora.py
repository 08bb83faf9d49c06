"""LoRA through PEFT: low-rank adapters on the policy's projections, the base frozen and shared.

The point of LoRA is memory, so nothing is copied: the frozen base weights are stored once, in the
rollout dtype (bf16 on CUDA), and serve the update, the reference and the sampler; only the
adapters are trained, in fp32 with fp32 AdamW state.

- The reference is the same model with the adapters switched off (``adapters_off``).
- The sampler decodes through the LoRA-wrapped projections themselves: the lean decoders call the
  model's own ``q_proj``, ``mlp`` and so on, which PEFT has wrapped. Merging the adapters into a
  rollout copy each refresh would cost a second copy of the base (the memory LoRA saves); the
  wrapped projections cost two rank-r matmuls each, about ``2r / hidden`` of the projection's
  work (3% at r=64, hidden 4096).
- Adapter dropout is 0: PPO's ratio compares two passes that must see the same network.
- The LM head is never adapted: the fused loss reads its weight directly.
- The output is the adapter in PEFT format; ``save_merged`` writes a plain Hugging Face model of
  base + adapter, without touching the training model.
"""

import math
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ...errors import UsageError
from .weights import save_model

ADAPTER = "default"  # PEFT's name for a model's only adapter


def _require_peft():
    try:
        import peft
    except ModuleNotFoundError:
        raise UsageError("--lora-rank needs PEFT, which is not installed: pip install 'fastppo[lora]'") from None
    return peft


def adaptable_layers(model, targets="all-linear"):
    """``(name, module)`` of the linear layers LoRA adapts for PEFT's ``targets`` ("all-linear", or
    leaf names from :func:`lora_targets`): every linear or GPT-2 Conv1D layer but the LM head."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and module is not head:
            if targets == "all-linear" or name.rsplit(".", 1)[-1] in targets:
                yield name, module


def projection_names(model) -> list:
    """The distinct names of the model's linear layers that LoRA may adapt (the LM head excluded)."""
    return sorted({name.rsplit(".", 1)[-1] for name, _ in adaptable_layers(model)})


def lora_targets(model, target_modules: Optional[str]):
    """PEFT's ``target_modules`` from the comma-separated option (None: every projection)."""
    if target_modules is None:
        return "all-linear"
    names = [n.strip() for n in target_modules.split(",") if n.strip()]
    head = model.get_output_embeddings()
    head_names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if module is head}
    if head_names & set(names):
        raise UsageError(
            f"config field lora_target_modules: LoRA on the LM head ({', '.join(head_names & set(names))}) "
            "is not supported: the fused loss reads the head's weight directly"
        )
    known = projection_names(model)
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(
            f"config field lora_target_modules: {', '.join(unknown) or 'nothing'} is not a linear layer "
            f"of this model; it has {', '.join(known)}"
        )
    return names


class LoRA:
    """The PEFT wrapping of a policy. ``model`` is the Hugging Face model with the wrapped layers
    (what the trainer and the sampler run); the adapters are its only trainable parameters."""

    def __init__(
        self, policy, rank: int, alpha: Optional[float], target_modules: Optional[str], base_dtype: torch.dtype
    ):
        peft = _require_peft()
        targets = lora_targets(policy, target_modules)
        policy.requires_grad_(False)
        for p in policy.parameters():
            p.data = p.data.to(base_dtype)
        config = peft.LoraConfig(
            r=rank,
            lora_alpha=alpha if alpha is not None else 2 * rank,
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
        )
        self.peft_model = peft.get_peft_model(policy, config, autocast_adapter_dtype=False)
        self.model = self.peft_model.get_base_model()
        for p in self.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # fp32 masters for what is trained

    def initial_adapters(self, seed: int) -> dict:
        """``{parameter name: whole value}`` of every adapter at the start of a run: A drawn as PEFT
        draws it (Kaiming-uniform), from a generator of ``seed`` layer by layer, B zero. Drawn here
        rather than by PEFT, so that a model built on the meta device and sharded before it has
        storage (``parallel/sharded_loading.py``) starts from the same adapters as one loaded whole."""
        from peft.tuners.lora import LoraLayer

        generator = torch.Generator().manual_seed(seed)
        values = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer):
                A, B = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight  # (r, in), (out, r)
                a = torch.empty(A.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
                values[f"{name}.lora_A.{ADAPTER}.weight"] = a
                values[f"{name}.lora_B.{ADAPTER}.weight"] = torch.zeros(B.shape, dtype=torch.float32)
        return values

    def adapters_off(self):
        """While active, the model is the base model: the reference of a LoRA run."""
        return self.peft_model.disable_adapter()

    def save_adapter(self, directory, state_dict: dict = None) -> None:
        """The adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``), fp32;
        from ``state_dict`` (the model's, gathered from its shards) when given."""
        if state_dict is not None:  # PEFT picks the adapter's entries out of the wrapper's names
            state_dict = {f"base_model.model.{k}": v for k, v in state_dict.items()}
        self.peft_model.save_pretrained(str(directory), state_dict=state_dict)

    @torch.no_grad()
    def load_adapter(self, directory) -> None:
        """The adapter weights :meth:`save_adapter` wrote, copied into the live adapters in place."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(
            self.peft_model, load_file(str(Path(directory) / "adapter_model.safetensors"))
        )
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"{directory}: adapter weights this model has no place for: {result.unexpected_keys[:3]}")

    @torch.no_grad()
    def merged_state_dict(self, dtype: torch.dtype, state_dict: dict = None) -> dict:
        """The base model's state dict with each adapter folded into its layer (W + scale x B A), in
        ``dtype``; from ``state_dict`` (the model's, gathered from its shards) when given."""
        from peft.tuners.lora import LoraLayer

        state = self.model.state_dict() if state_dict is None else state_dict
        merged = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer):
                a, b = (state[f"{name}.lora_{side}.{ADAPTER}.weight"].float() for side in "AB")
                delta = (b @ a) * module.scaling[ADAPTER]  # (out, in)
                if module.fan_in_fan_out:  # GPT-2's Conv1D stores (in, out)
                    delta = delta.T
                merged[f"{name}.weight"] = (state[f"{name}.base_layer.weight"].float() + delta).to(dtype)
        for key, value in state.items():
            if ".lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            if plain not in merged:
                merged[plain] = value.to(dtype) if value.is_floating_point() else value
        return merged

    def save_merged(self, directory, dtype: torch.dtype, state_dict: dict = None) -> None:
        """A plain Hugging Face model of base + adapter in ``dtype``, loadable without PEFT (from
        ``state_dict``, as :meth:`merged_state_dict`)."""
        save_model(self.model, directory, dtype, self.merged_state_dict(dtype, state_dict))
