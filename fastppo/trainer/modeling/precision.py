"""Training precision: fp32 master weights, bf16 compute, and the dtype of everything else.

Published checkpoints are stored in bf16, and an AdamW step of 1e-6 is below half a bf16 ulp of
most weights, so training bf16 weights directly barely moves them. The standard recipe, which
this module configures: the trained weights and their optimizer state are fp32 whatever the
checkpoint's dtype; forward and backward run under bf16 autocast (on CUDA by default); losses,
log-probs and reductions stay fp32 (the ops guarantee it). Models that are only read (the
reference, the reward model) are held in the compute dtype, the sampler decodes from a copy in
the rollout dtype (``rollout_weights.py``), and the final policy is saved in the checkpoint's own
dtype unless told otherwise. Trainer checkpoints keep the fp32 masters, so a resume is exact.
"""

from dataclasses import dataclass
from typing import Optional

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
SAVE_DTYPES = ("auto", *DTYPES)
ROLLOUT_DTYPES = SAVE_DTYPES


def stored_dtype(model_config) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in, as its config records it (fp32 if it does not)."""
    names = ("dtype",) if "dtype" in vars(model_config) else ("torch_dtype",)  # transformers 5, 4
    recorded = getattr(model_config, names[0], None)
    if isinstance(recorded, str):
        recorded = DTYPES.get(recorded.replace("torch.", ""))
    return recorded if isinstance(recorded, torch.dtype) and recorded.is_floating_point else torch.float32


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run."""

    device_type: str
    compute: Optional[torch.dtype]  # autocast dtype of forward and backward; None: fp32 throughout
    frozen: torch.dtype  # the reference and reward models
    rollout: torch.dtype  # the weights the sampler decodes with
    save: torch.dtype  # the final policy's saved weights

    @classmethod
    def of(
        cls, autocast: Optional[bool], rollout: str, save: str, device_type: str, stored: torch.dtype
    ) -> "Precision":
        """From the config's ``autocast`` (None: on CUDA only), ``rollout_dtype`` (``"auto"``: bf16 on
        CUDA, fp32 elsewhere) and ``save_dtype`` (``"auto"``: ``stored``, the checkpoint's own), on
        ``device_type``."""
        cuda = device_type == "cuda"
        compute = torch.bfloat16 if (cuda if autocast is None else autocast) else None
        rollout_dtype = (torch.bfloat16 if cuda else torch.float32) if rollout == "auto" else DTYPES[rollout]
        return cls(
            device_type, compute, compute or torch.float32, rollout_dtype, stored if save == "auto" else DTYPES[save]
        )

    def autocast(self):
        """The autocast context of the trainer's forward passes (a no-op when computing in fp32)."""
        return torch.autocast(self.device_type, dtype=self.compute or torch.bfloat16, enabled=self.compute is not None)
