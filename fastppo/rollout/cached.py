"""The decoders over fastppo's own KV cache: prefill, decode, extend and packing, whatever the forward.

Two kinds of forward run over the sampler's cache (:class:`~fastppo.rollout.static_cache.StaticKVCache` or
``paged.py``'s), with per-row positions: the hand-written ones of ``lean.py`` (the common families,
on packed, fused weights) and the model's own modules with the attention handed over at
transformers' attention interface (``interface.py``, every other family that attends through it).
Both are a :class:`CachedDecoder`: a forward that takes an ``attend(layer, q, k, v, scale, softcap,
sinks)`` and stores nothing itself, and the attention (``attention.py``) that stores and attends.

Prompts are prefilled in groups of similar length, one right-padded forward per group (padding
bounded by ``PREFILL_PADDING``), into the first slot of each prompt; its other samples' slots get
a copy (static cache) or its blocks (paged: the full ones shared, the partial last one copied).
Only the positions whose logits are wanted go through the LM head (a prompt's last token; a step's
token), never all L x V of a prompt.
"""

from abc import abstractmethod
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .attention import CacheAttention, LayerAttention
from .decoder import Decoder
from .packed import DecoderWeights

PREFILL_PADDING = 0.25  # a prefill group's padded tokens stay under this share of its real ones
PREFILL_TOKENS = 8192  # and its padded size under this many tokens (activations, attention scores)


def prefill_groups(lengths: list) -> list:
    """Prompt indices in groups prefilled together: by length, each group as large as it can be
    with padding within ``PREFILL_PADDING`` of its tokens and at most ``PREFILL_TOKENS`` in all
    (a prompt longer than that is a group of its own)."""
    groups, group, real = [], [], 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        padded = (len(group) + 1) * lengths[i]  # sorted: this prompt is the group's longest
        if group and (padded > (1 + PREFILL_PADDING) * (real + lengths[i]) or padded > PREFILL_TOKENS):
            groups.append(group)
            group, real = [], 0
        group.append(i)
        real += lengths[i]
    return groups + [group]


class CacheShape(NamedTuple):
    """What a model's KV cache holds: ``layers`` of ``kv_heads`` heads of ``head_dim``, each layer's
    sliding window (None: full attention), and whether any layer's attention has sinks."""

    layers: int
    kv_heads: int
    head_dim: int
    windows: list
    sinks: bool = False


class CachedDecoder(Decoder):
    """The contract over fastppo's cache: a kind of forward supplies ``shapes`` and ``logits_at``;
    prefill, decode, extend and packing are shared."""

    #: The name ``Sampler(decoder=...)`` gives this kind of forward.
    kind: str

    def __init__(self, model, attention: CacheAttention, windows: list, weights: DecoderWeights):
        self.model, self.attention, self.windows, self.weights = model, attention, windows, weights
        self.cache = attention.cache
        self.device = self.cache.k[0].device
        self.dtype = next(model.parameters()).dtype  # what the forward computes in

    @classmethod
    @abstractmethod
    def shapes(cls, model) -> Optional[CacheShape]:
        """The shape of ``model``'s cache, or None when this forward cannot serve this model (a
        variant it does not reproduce)."""

    @abstractmethod
    def logits_at(self, ids: Tensor, positions: Tensor, attend, last: Optional[Tensor]) -> Tensor:
        """The model on ``ids`` ``(B, L)`` at ``positions`` ``(B, L)``, its attention through
        ``attend(layer, q (B, H, L, D), k, v (B, KVH, L, D), scale, softcap, sinks) -> (B, H, L, D)``;
        the next-token logits ``(B, V)`` at each row's column ``last`` ``(B,)`` (None: the last)."""

    def prefill(self, slots: list, prompts: list) -> Tensor:
        self.prefilled += sum(len(p) for p in prompts)
        first = None  # (G, V)
        for group in prefill_groups([len(p) for p in prompts]):
            L = max(len(prompts[i]) for i in group)
            ids = torch.tensor([prompts[i] + [0] * (L - len(prompts[i])) for i in group], device=self.device)
            lengths = torch.tensor([len(prompts[i]) for i in group], device=self.device)
            logits = self._prefill_group(torch.tensor([slots[i][0] for i in group], device=self.device), ids, lengths)
            if first is None:
                first = logits.new_empty(len(prompts), logits.shape[1])
            first[torch.tensor(group, device=self.device)] = logits
        copies = [(s[0], other, len(p)) for s, p in zip(slots, prompts) for other in s[1:]]
        if copies:
            src, dst, lengths = zip(*copies)
            self.cache.share(list(src), list(dst), list(lengths))
        return first

    def _prefill_group(self, slots: Tensor, ids: Tensor, lengths: Tensor) -> Tensor:
        """Right padding is safe: causal attention keeps a prompt's tokens from seeing the pads
        after them, and the keys a pad leaves in the cache, at or past the row's length, are each
        rewritten by the decode step that first reads them."""
        G, L = ids.shape
        positions = torch.arange(L, device=ids.device).expand(G, L)  # (G, L)

        def attend(layer, q, k, v, *options):
            return self.attention.prefill(layer, slots, q, k, v, self._how(layer, *options))

        return self.logits_at(ids, positions, attend, lengths - 1)  # (G, V)

    def decode(self, tokens: Tensor, positions: Tensor, span: int, live: Tensor = None) -> Tensor:
        # ``live`` is not needed: a slot writes only its own position, which a row rewrites first
        context = self.attention.decode_context(positions)

        def attend(layer, q, k, v, *options):
            return self.attention.decode(layer, q, k, v, positions, span, context, self._how(layer, *options))

        return self.logits_at(tokens.unsqueeze(1), positions.unsqueeze(1), attend, None)

    def extend(self, slots: list, tokens: list, starts: list) -> Tensor:
        """The continuations right-padded into one forward; a pad writes nothing and is never read."""
        C = max(len(t) for t in tokens)
        self.prefilled += sum(len(t) for t in tokens)
        ids = torch.tensor([t + [0] * (C - len(t)) for t in tokens], device=self.device)  # (n, C)
        start = torch.tensor(starts, device=self.device)
        # (n, C); a pad's position may pass the cache: clamped, as it stores nothing
        positions = (start[:, None] + torch.arange(C, device=self.device)).clamp(max=self.cache.max_len - 1)
        lengths = torch.tensor([len(t) for t in tokens], device=self.device)
        slot_index = torch.tensor(slots, device=self.device)

        def attend(layer, q, k, v, *options):
            return self.attention.extend(layer, slot_index, q, k, v, positions, lengths, self._how(layer, *options))

        return self.logits_at(ids, positions, attend, lengths - 1)  # (n, V)

    def _how(self, layer: int, scale: float, softcap: Optional[float] = None, sinks=None) -> LayerAttention:
        """Layer ``layer``'s attention options: those ``attend`` is given, and the layer's window."""
        return LayerAttention(scale, self.windows[layer], softcap, sinks)

    def pack(self, order: list, length: int) -> bool:
        return self.cache.move(order, length)

    def claim(self, slots: list, prompt_len: int, cap: int, positions: int) -> bool:
        return not self.cache.paged or self.cache.claim(slots, prompt_len, cap, positions)

    def hold(self, slots: list, positions: list) -> list:
        return self.cache.hold(slots, positions) if self.cache.paged else super().hold(slots, positions)

    def release(self, slots: list) -> None:
        if self.cache.paged:
            self.cache.release(slots)
