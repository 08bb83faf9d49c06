"""The generic decoder: any causal LM through its own forward and its own cache.

For families without a lean forward. Prompts are left-padded into one batch with an attention
mask and explicit position ids (as ``generate()`` does), then each step feeds one token per row.
It offers the same ``start`` / ``decode`` contract as the lean decoders, so the sampler's loop,
sampling and stopping are shared. Its cache is the model's, which grows as it goes.
"""

import inspect

import torch
from torch import Tensor


class GenericDecoder:
    def __init__(self, model):
        self.model = model
        # transformers 5.2x renamed the cache argument and output field past_key_values -> cache
        self.cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache = None
        self.attention_mask = None

    def start(self, prompts: list, device: torch.device) -> Tensor:
        """Prefill every row's prompt; return the next-token logits ``(B, V)``."""
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
        self.attention_mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt, device=device)
            self.attention_mask[row, longest - len(prompt):] = 1
        positions = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=self.attention_mask, position_ids=positions, use_cache=True)
        self.cache = getattr(out, self.cache_name)
        return out.logits[:, -1]

    def decode(self, tokens: Tensor, positions: Tensor, span: int) -> Tensor:
        self.attention_mask = torch.cat([self.attention_mask, torch.ones_like(self.attention_mask[:, :1])], dim=1)
        out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=self.attention_mask,
                         position_ids=positions.unsqueeze(1), use_cache=True, **{self.cache_name: self.cache})
        self.cache = getattr(out, self.cache_name)
        return out.logits[:, -1]
