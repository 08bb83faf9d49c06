"""The critic: a transformer backbone and a scalar value head on its last hidden states, started from
the policy or from a reward model, saved as a Hugging Face backbone with the head beside it.
"""

import copy
from pathlib import Path

import torch
from torch import nn

from ...errors import UsageError
from ...hf import load_complete


class Critic(nn.Module):
    """A value model: a transformer backbone and a scalar head on its last hidden states."""

    def __init__(self, backbone: nn.Module, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    @classmethod
    def from_policy(cls, policy) -> "Critic":
        """The policy's backbone (a copy) with a zero-initialised head."""
        head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return cls(copy.deepcopy(policy.base_model), head)

    @classmethod
    def from_reward_model(cls, path, policy) -> "Critic":
        """A reward model's backbone and its scoring row as the head (it must share the policy's vocabulary)."""
        from transformers import AutoModelForSequenceClassification

        model = load_complete(AutoModelForSequenceClassification, path, "--reward-model", "a sequence classifier")
        if model.config.vocab_size != policy.config.vocab_size:
            raise UsageError(
                f"critic_init=reward_model needs the policy's vocabulary: the reward model has "
                f"{model.config.vocab_size} tokens, the policy {policy.config.vocab_size}"
            )
        score = getattr(model, "score", None)  # the scoring layer of HF's *ForSequenceClassification
        if not isinstance(score, nn.Linear):
            raise UsageError(
                f"critic_init=reward_model: {path} has no linear 'score' layer to start the value head from"
            )
        head = nn.Linear(model.config.hidden_size, 1)
        with torch.no_grad():
            head.weight.copy_(score.weight[:1])
            head.bias.copy_(score.bias[:1] if score.bias is not None else torch.zeros(1))
        return cls(model.base_model, head)

    def forward(self, input_ids, attention_mask, position_ids=None):
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # (B, L), a new tensor rather than a view of the head's (B, L, 1) output (FSDP warns of those)
        return hidden @ self.head.weight[0] + self.head.bias[0]

    HEAD_FILE = "value_head.safetensors"

    def save_pretrained(self, path, state_dict: dict = None) -> None:
        """The backbone in Hugging Face format, the scalar head beside it in safetensors; from
        ``state_dict`` (a sharded critic's, gathered) when given."""
        from safetensors.torch import save_file

        state_dict = self.state_dict() if state_dict is None else state_dict
        part = {
            name: {k.removeprefix(f"{name}."): v for k, v in state_dict.items() if k.startswith(f"{name}.")}
            for name in ("backbone", "head")
        }
        self.backbone.save_pretrained(path, state_dict=part["backbone"])
        save_file({k: v.contiguous() for k, v in part["head"].items()}, str(Path(path) / self.HEAD_FILE))

    @classmethod
    def from_pretrained(cls, path) -> "Critic":
        from safetensors.torch import load_file
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path)
        head = nn.Linear(backbone.config.hidden_size, 1)
        head.load_state_dict(load_file(str(Path(path) / cls.HEAD_FILE)))
        return cls(backbone, head)
