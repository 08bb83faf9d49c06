"""The generic decoder: any causal LM through its own forward and its own cache.

For families without a lean forward. A wave of prompts is left-padded into one batch with an
attention mask and explicit position ids (as ``generate()`` does), then each step feeds one token
per row. Its cache is the model's, which grows as it goes, so rows cannot join a running batch
(``refills`` is False): more rows than the batch holds run in successive waves. Packing selects
the rows still going with the cache's ``batch_select_indices``, where the cache has it.

The attention mask has a column per cache column: a slot that is not live at a step (ended, or
paused between the turns of an episode) gets 0 there, so its cache holds only its real tokens. A
continuation is a chunk of columns for every row, real for the rows it extends and 0 for the
others, so the model's cache grows by the chunk and no row is prefilled again.
"""

import inspect

import torch
from torch import Tensor

from .decoder import Decoder


class GenericDecoder(Decoder):
    refills = False

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device
        # transformers 5.2x renamed the cache argument and output field past_key_values -> cache
        self.cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.cache = None
        self.attention_mask = None

    def prefill(self, slots: list, prompts: list) -> Tensor:
        """A fresh batch: ``slots`` must number the slots ``0 .. B-1``. Every slot is prefilled
        (a prompt once per sample), as the model's own cache has no way to share a prefix."""
        rows = [None] * sum(len(s) for s in slots)
        for prompt, prompt_slots in zip(prompts, slots):
            for slot in prompt_slots:
                rows[slot] = prompt
        if any(r is None for r in rows):
            raise ValueError(f"a fresh batch fills slots 0 .. {len(rows) - 1}, got {slots}")
        self.prefilled += sum(len(r) for r in rows)
        longest = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long, device=self.device)
        self.attention_mask = torch.zeros_like(ids)
        for row, prompt in enumerate(rows):
            ids[row, longest - len(prompt) :] = torch.tensor(prompt, device=self.device)
            self.attention_mask[row, longest - len(prompt) :] = 1
        positions = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=self.attention_mask, position_ids=positions, use_cache=True)
        self.cache = getattr(out, self.cache_name)
        first = torch.tensor([s[0] for s in slots], device=self.device)
        return out.logits[first, -1]  # (G, V)

    def decode(self, tokens: Tensor, positions: Tensor, span: int, live: Tensor) -> Tensor:
        return self._forward(tokens.unsqueeze(1), positions.unsqueeze(1), live.unsqueeze(1))[:, -1]

    def extend(self, slots: list, tokens: list, starts: list) -> Tensor:
        B, C = self.attention_mask.shape[0], max(len(t) for t in tokens)
        self.prefilled += sum(len(t) for t in tokens)
        ids = torch.zeros(B, C, dtype=torch.long, device=self.device)
        real = torch.zeros(B, C, dtype=torch.bool, device=self.device)
        positions = torch.zeros(B, C, dtype=torch.long, device=self.device)
        for slot, row_tokens, start in zip(slots, tokens, starts):
            n = len(row_tokens)
            ids[slot, :n] = torch.tensor(row_tokens, device=self.device)
            real[slot, :n] = True
            positions[slot, :n] = torch.arange(start, start + n, device=self.device)
        logits = self._forward(ids, positions, real)  # (B, C, V)
        last = torch.tensor([len(t) - 1 for t in tokens], device=self.device)
        return logits[torch.tensor(slots, device=self.device), last]

    def _forward(self, ids: Tensor, positions: Tensor, real: Tensor) -> Tensor:
        """``ids`` ``(B, C)`` at ``positions`` appended to the cache, ``real`` ``(B, C)`` marking the
        columns each row may attend to later; the logits ``(B, C, V)``."""
        self.attention_mask = torch.cat([self.attention_mask, real.to(self.attention_mask.dtype)], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=self.attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_name: self.cache},
        )
        self.cache = getattr(out, self.cache_name)
        return out.logits

    def pack(self, order: list, length: int) -> bool:
        if not hasattr(self.cache, "batch_select_indices"):
            return False
        index = torch.tensor(order, device=self.device)
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        return True
