"""Loading Hugging Face models from local paths, refusing missing weights.

For every layer that loads a model: ``load_complete`` refuses a checkpoint that lacks some of the
model's weights (transformers would start them random), and ``cast_parameters`` casts the
parameters, not the buffers."""

import torch
from torch import nn

from .errors import UsageError


def load_complete(auto_class, path, option: str, kind: str):
    """``auto_class.from_pretrained(path)``, refusing a checkpoint that lacks some of the model's
    weights: transformers would start them random (an LM head on a sequence classifier, a score
    head on a causal LM) and the run would look healthy while it trains noise."""
    try:
        model, info = auto_class.from_pretrained(path, output_loading_info=True)
    except ValueError as error:  # transformers' word for "no such model class for this config"
        raise UsageError(f"{option} {path}: not {kind} transformers can load ({error})") from None
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        kinds = ", ".join(getattr(model.config, "architectures", None) or ["?"])
        raise UsageError(
            f"{option} {path} has no weights for {', '.join(missing[:3])}"
            f"{' and more' if len(missing) > 3 else ''}, which would start random: it holds a "
            f"{kinds} checkpoint, not {kind}"
        )
    return model


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """The model's parameters in ``dtype``, in place; buffers (rotary frequencies) keep theirs, as
    transformers keeps them fp32 in a bf16 model."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
