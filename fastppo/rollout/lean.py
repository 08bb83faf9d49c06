"""Lean decoder forwards for the common families, on the Hugging Face module's own parameters.

The model's norms, activations and rotary embedding are called as they are, so the math is the
model's own. Its projections are multiplied through ``packed.py``'s :class:`DecoderWeights`: by
default a rollout copy with each layer's projections on one input fused and stored in the layout
fastest here, made again at the start of each rollout, so it sees the optimizer's last step; or the
modules themselves (``weights="live"``). The attention
is replaced, by one that reads and writes the sampler's :class:`KVCache` with per-row positions
(``attention.py``). ``FAMILIES`` is the one list of what runs here; anything else goes through
``generic.py``.

Prompts are prefilled in groups of similar length, one right-padded forward per group (padding
bounded by ``PREFILL_PADDING``), into the first slot of each prompt; its other samples' slots get
a copy (static cache) or its blocks (paged: the full ones shared, the partial last one copied).
Only the positions whose logits are wanted go through the final norm and the LM head (a prompt's
last token; a step's token), never all L x V of a prompt.
"""

from abc import abstractmethod
from typing import Optional

import torch
from torch import Tensor

from ..windows import UnknownWindows, layer_windows
from .attention import CacheAttention
from .decoder import Decoder
from .flash import FLASH_BLOCK, flash_decode, kernel_backend
from .kv_cache import KVCache
from .packed import DecoderWeights
from .paged import DEFAULT_BLOCK, PagedKVCache, block_within, paged_blocks

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


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder(Decoder):
    """The lean half of the contract: a family supplies ``forward`` and ``logits``; prefill,
    decode and packing over the :class:`KVCache` are shared."""

    def __init__(self, model, attention: CacheAttention, windows: list, weights: DecoderWeights):
        self.model, self.attention, self.windows, self.weights = model, attention, windows, weights
        self.cache = attention.cache
        self.device = self.cache.k[0].device
        self.dtype = next(model.parameters()).dtype  # what the forward computes in

    @classmethod
    @abstractmethod
    def shapes(cls, model) -> Optional[tuple]:
        """``(layers, kv_heads, head_dim, windows)`` of ``model``'s cache, or None when this family's
        forward cannot serve this model (a variant it does not reproduce)."""

    @classmethod
    @abstractmethod
    def projections(cls, model) -> dict:
        """The groups of projections that multiply one input, by name, each a list over layers of
        the group's modules; ``"head"`` is ``[[lm_head]]``."""

    @abstractmethod
    def forward(self, ids: Tensor, positions: Tensor, attend) -> Tensor:
        """The model's blocks on ``ids`` ``(B, L)`` at ``positions`` ``(B, L)``, with attention
        ``attend(layer, q (B, H, L, D), k, v (B, KVH, L, D), scale) -> (B, H, L, D)``; returns the
        last hidden state ``(B, L, hidden)`` before the final norm."""

    @abstractmethod
    def logits(self, x: Tensor) -> Tensor:
        """The final norm and the LM head: ``(..., hidden) -> (..., V)``."""

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

        def attend(layer, q, k, v, scale):
            return self.attention.prefill(layer, slots, q, k, v, scale, self.windows[layer])

        x = self.forward(ids, positions, attend)  # (G, L, hidden)
        return self.logits(x[torch.arange(G, device=ids.device), lengths - 1])  # (G, V)

    def decode(self, tokens: Tensor, positions: Tensor, span: int, live: Tensor = None) -> Tensor:
        # ``live`` is not needed: a slot writes only its own position, which a row rewrites first
        context = self.attention.decode_context(positions)

        def attend(layer, q, k, v, scale):
            return self.attention.decode(layer, q, k, v, positions, span, scale, self.windows[layer], context)

        return self.logits(self.forward(tokens.unsqueeze(1), positions.unsqueeze(1), attend)[:, -1])

    def extend(self, slots: list, tokens: list, starts: list) -> Tensor:
        """The continuations right-padded into one forward; a pad writes nothing and is never read."""
        n, C = len(slots), max(len(t) for t in tokens)
        self.prefilled += sum(len(t) for t in tokens)
        ids = torch.tensor([t + [0] * (C - len(t)) for t in tokens], device=self.device)  # (n, C)
        start = torch.tensor(starts, device=self.device)
        # (n, C); a pad's position may pass the cache: clamped, as it stores nothing
        positions = (start[:, None] + torch.arange(C, device=self.device)).clamp(max=self.cache.max_len - 1)
        lengths = torch.tensor([len(t) for t in tokens], device=self.device)
        slot_index = torch.tensor(slots, device=self.device)

        def attend(layer, q, k, v, scale):
            return self.attention.extend(layer, slot_index, q, k, v, positions, lengths, scale, self.windows[layer])

        x = self.forward(ids, positions, attend)  # (n, C, hidden)
        return self.logits(x[torch.arange(n, device=self.device), lengths - 1])  # (n, V)

    def pack(self, order: list, length: int) -> bool:
        return self.cache.move(order, length)

    def claim(self, slots: list, prompt_len: int, cap: int, positions: int) -> bool:
        return not self.cache.paged or self.cache.claim(slots, prompt_len, cap, positions)

    def hold(self, slots: list, positions: list) -> list:
        return self.cache.hold(slots, positions) if self.cache.paged else super().hold(slots, positions)

    def release(self, slots: list) -> None:
        if self.cache.paged:
            self.cache.release(slots)


class LlamaLikeDecoder(LeanDecoder):
    """Llama, Mistral, Qwen2 and Qwen3: RMSNorm, rotary GQA attention (Qwen3: q/k norms), gated MLP."""

    @classmethod
    def shapes(cls, model):
        if not (hasattr(model, "model") and hasattr(model.model, "rotary_emb")):
            return None
        config = model.config
        try:
            windows = layer_windows(config)
        except UnknownWindows:  # attention this forward does not reproduce
            return None
        return config.num_hidden_layers, config.num_key_value_heads, model.model.layers[0].self_attn.head_dim, windows

    @classmethod
    def projections(cls, model):
        attns, mlps = [b.self_attn for b in model.model.layers], [b.mlp for b in model.model.layers]
        return {
            "qkv": [[a.q_proj, a.k_proj, a.v_proj] for a in attns],
            "o": [[a.o_proj] for a in attns],
            "gate_up": [[m.gate_proj, m.up_proj] for m in mlps],
            "down": [[m.down_proj] for m in mlps],
            "head": [[model.lm_head]],
        }

    def forward(self, ids: Tensor, positions: Tensor, attend) -> Tensor:
        body, w = self.model.model, self.weights
        x = body.embed_tokens(ids)  # (B, L, hidden)
        cos, sin = body.rotary_emb(x, positions)  # (B, L, D) each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        B, L, _ = x.shape
        for i, layer in enumerate(body.layers):
            attn = layer.self_attn
            q, k, v = w["qkv"][i](layer.input_layernorm(x))
            q = q.view(B, L, -1, attn.head_dim).transpose(1, 2)  # (B, H, L, D)
            k = k.view(B, L, -1, attn.head_dim).transpose(1, 2)  # (B, KVH, L, D)
            v = v.view(B, L, -1, attn.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attend(i, q, k, v, attn.scaling).transpose(1, 2).reshape(B, L, -1)
            x = x + w["o"][i](o)[0]
            gate, up = w["gate_up"][i](layer.post_attention_layernorm(x))
            x = x + w["down"][i](layer.mlp.act_fn(gate) * up)[0]
        return x  # (B, L, hidden), before the final norm

    def logits(self, x: Tensor) -> Tensor:
        return self.weights["head"][0](self.model.model.norm(x))[0]


class GPT2Decoder(LeanDecoder):
    """GPT-2: learned positions, fused qkv projection (Conv1D), LayerNorm, GELU MLP."""

    @classmethod
    def shapes(cls, model):
        config = model.config
        if getattr(config, "reorder_and_upcast_attn", False):
            return None
        return config.n_layer, config.n_head, config.n_embd // config.n_head, [None] * config.n_layer

    @classmethod
    def projections(cls, model):
        blocks = model.transformer.h
        return {
            "qkv": [[b.attn.c_attn] for b in blocks],
            "o": [[b.attn.c_proj] for b in blocks],
            "fc": [[b.mlp.c_fc] for b in blocks],
            "proj": [[b.mlp.c_proj] for b in blocks],
            "head": [[model.lm_head]],
        }

    def forward(self, ids: Tensor, positions: Tensor, attend) -> Tensor:
        body, config, w = self.model.transformer, self.model.config, self.weights
        x = body.wte(ids) + body.wpe(positions)  # (B, L, hidden)
        B, L, hidden = x.shape
        D = hidden // config.n_head
        for i, block in enumerate(body.h):
            (qkv,) = w["qkv"][i](block.ln_1(x))  # (B, L, 3 * hidden)
            q, k, v = (t.view(B, L, config.n_head, D).transpose(1, 2) for t in qkv.split(hidden, dim=2))
            scale = (D**-0.5 if config.scale_attn_weights else 1.0) / (
                i + 1 if config.scale_attn_by_inverse_layer_idx else 1
            )
            o = attend(i, q, k, v, scale).transpose(1, 2).reshape(B, L, hidden)
            x = x + w["o"][i](o)[0]
            x = x + w["proj"][i](block.mlp.act(w["fc"][i](block.ln_2(x))[0]))[0]
        return x  # (B, L, hidden), before the final norm

    def logits(self, x: Tensor) -> Tensor:
        return self.weights["head"][0](self.model.transformer.ln_f(x))[0]


#: ``config.model_type`` -> its lean decoder: the families with a fast path.
FAMILIES = {
    "llama": LlamaLikeDecoder,
    "mistral": LlamaLikeDecoder,
    "qwen2": LlamaLikeDecoder,
    "qwen3": LlamaLikeDecoder,
    "gpt2": GPT2Decoder,
}


def lean_decoder(
    model,
    slots: int,
    max_len: int,
    dtype: Optional[torch.dtype],
    attention: str,
    kv_cache: str = "auto",
    block_size: Optional[int] = None,
    memory: Optional[int] = None,
    weights: str = "packed",
    layout: Optional[str] = None,
):
    """A lean decoder with a KV cache of ``slots`` rows for ``model``, or None when its family has no
    fast path. ``attention`` picks the decode attention (see ``flash.py``); ``kv_cache`` the layout,
    ``"paged"`` (blocks of ``block_size`` positions in ``memory`` bytes, see ``paged.py``),
    ``"static"`` (``kv_cache.py``) or ``"auto"``: paged when ``block_size`` is given or ``memory`` is
    short of every slot at ``max_len``, else static: there is then nothing to page, and the paged
    decode's gather of each row's blocks would be a cost with no saving. ``weights`` and ``layout``: what the
    projections multiply by (``packed.py``)."""
    family = FAMILIES.get(model.config.model_type)
    shapes = family and family.shapes(model)
    if shapes is None:
        return None
    layers, kv_heads, head_dim, windows = shapes
    param = next(model.parameters())
    dtype = dtype or param.dtype
    token_bytes = layers * kv_heads * head_dim * dtype.itemsize  # a position's keys (or values)
    if kv_cache == "auto":
        short = memory is not None and memory < 2 * slots * max_len * token_bytes
        kv_cache = "paged" if short or block_size is not None else "static"
    projections = DecoderWeights(family.projections(model), weights, slots, layout)

    backend = kernel_backend(attention, param.device)

    def decode_attention(block):
        return flash_decode(attention, param.device, param.dtype, dtype, head_dim, block)

    if kv_cache == "static":
        flash = decode_attention(None)
        # head-major unless flash-attn reads it: a head's keys of a row in one run, for SDPA and the kernel alike
        cache = KVCache(layers, slots, kv_heads, max_len, head_dim, dtype, param.device, head_major=flash is None)
        return family(model, CacheAttention(cache, flash, backend), windows, projections)
    if block_size is None:  # flash-attn's page when it would take one, else vLLM's default
        flash = flash_decode("auto", param.device, param.dtype, dtype, head_dim, FLASH_BLOCK)
        block_size = FLASH_BLOCK if flash else DEFAULT_BLOCK
    flash = decode_attention(block_size)
    block_size = block_within(block_size, max_len, FLASH_BLOCK if flash else 1)
    num_blocks = paged_blocks(memory, slots, max_len, block_size, token_bytes)
    cache = PagedKVCache(
        layers, slots, kv_heads, max_len, head_dim, dtype, param.device, block_size=block_size, num_blocks=num_blocks
    )
    return family(model, CacheAttention(cache, flash, backend), windows, projections)
