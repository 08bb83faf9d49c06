"""Lean decoder forwards for the common families, on the Hugging Face module's own parameters.

The model's submodules (norms, projections, MLPs, rotary embedding) are called as they are, so
the math is the model's own and its parameters are used by reference, never copied: an
optimizer step is seen by the next rollout. Only the attention is replaced, by one that reads
and writes the sampler's :class:`KVCache` with per-row positions. Anything else goes through
``generic.py``.

Each decoder offers ``prefill(rows (G,), ids (G, L), lengths (G,)) -> logits (G, V)`` for a
group of right-padded prompts, stored in cache rows ``rows``, and ``decode(tokens (B,),
positions (B,), span) -> logits (B, V)`` for one step of every row. Only the positions whose
logits are wanted go through the final norm and the LM head (a prompt's last token; a step's
token), never all L x V of a prompt.
"""

from typing import Optional

import torch
from torch import Tensor

from .flash import flash_decode
from .kv_cache import KVCache

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _windows(config) -> list:
    """Per layer, the sliding-window length or None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    uses_window = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    return [window if uses_window else None] * config.num_hidden_layers


class _Decoder:
    """Shared driver: subclasses run the layers given an attention function."""

    def __init__(self, model, cache: KVCache, windows: list):
        self.model, self.cache, self.windows = model, cache, windows

    def prefill(self, rows: Tensor, ids: Tensor, lengths: Tensor) -> Tensor:
        """Right padding is safe: causal attention keeps a prompt's tokens from seeing the pads
        after them, and the keys a pad leaves in the cache, at or past the row's length, are each
        rewritten by the decode step that first reads them."""
        G, L = ids.shape
        positions = torch.arange(L, device=ids.device).expand(G, L)  # (G, L)

        def attend(layer, q, k, v, scale):
            return self.cache.prefill_attention(layer, rows, q, k, v, scale, self.windows[layer])

        x = self.forward(ids, positions, attend)  # (G, L, hidden)
        return self.logits(x[torch.arange(G, device=ids.device), lengths - 1])  # (G, V)

    def decode(self, tokens: Tensor, positions: Tensor, span: int) -> Tensor:
        masks = self.cache.decode_masks(positions, span, set(self.windows))

        def attend(layer, q, k, v, scale):
            return self.cache.decode_attention(layer, q, k, v, positions, span, scale, self.windows[layer], masks)

        return self.logits(self.forward(tokens.unsqueeze(1), positions.unsqueeze(1), attend)[:, -1])


class LlamaLikeDecoder(_Decoder):
    """Llama, Mistral, Qwen2 and Qwen3: RMSNorm, rotary GQA attention (Qwen3: q/k norms), gated MLP."""

    def forward(self, ids: Tensor, positions: Tensor, attend) -> Tensor:
        body = self.model.model
        x = body.embed_tokens(ids)  # (B, L, hidden)
        cos, sin = body.rotary_emb(x, positions)  # (B, L, D) each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        B, L, _ = x.shape
        for i, layer in enumerate(body.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(B, L, -1, attn.head_dim).transpose(1, 2)  # (B, H, L, D)
            k = attn.k_proj(h).view(B, L, -1, attn.head_dim).transpose(1, 2)  # (B, KVH, L, D)
            v = attn.v_proj(h).view(B, L, -1, attn.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = attend(i, q, k, v, attn.scaling).transpose(1, 2).reshape(B, L, -1)
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x  # (B, L, hidden), before the final norm

    def logits(self, x: Tensor) -> Tensor:
        return self.model.lm_head(self.model.model.norm(x))


class GPT2Decoder(_Decoder):
    """GPT-2: learned positions, fused qkv projection (Conv1D), LayerNorm, GELU MLP."""

    def forward(self, ids: Tensor, positions: Tensor, attend) -> Tensor:
        body, config = self.model.transformer, self.model.config
        x = body.wte(ids) + body.wpe(positions)  # (B, L, hidden)
        B, L, hidden = x.shape
        D = hidden // config.n_head
        for i, block in enumerate(body.h):
            qkv = block.attn.c_attn(block.ln_1(x))  # (B, L, 3 * hidden)
            q, k, v = (t.view(B, L, config.n_head, D).transpose(1, 2) for t in qkv.split(hidden, dim=2))
            scale = (D**-0.5 if config.scale_attn_weights else 1.0) / (i + 1 if config.scale_attn_by_inverse_layer_idx else 1)
            o = attend(i, q, k, v, scale).transpose(1, 2).reshape(B, L, hidden)
            x = x + block.attn.c_proj(o)
            x = x + block.mlp(block.ln_2(x))
        return x  # (B, L, hidden), before the final norm

    def logits(self, x: Tensor) -> Tensor:
        return self.model.lm_head(self.model.transformer.ln_f(x))


def lean_decoder(model, max_batch: int, max_len: int, dtype: Optional[torch.dtype], attention: str):
    """A lean decoder with its KV cache for ``model``, or None when its family has no fast path.

    ``attention`` picks the decode attention (see ``flash.py``).
    """
    config = model.config
    param = next(model.parameters())
    dtype = dtype or param.dtype

    def cache(num_layers, kv_heads, head_dim):
        kernel = flash_decode(attention, param.device, param.dtype, dtype, head_dim)
        return KVCache(num_layers, max_batch, kv_heads, max_len, head_dim, dtype, param.device, kernel)

    if config.model_type in LLAMA_LIKE and hasattr(model, "model") and hasattr(model.model, "rotary_emb"):
        head_dim = model.model.layers[0].self_attn.head_dim
        return LlamaLikeDecoder(model, cache(config.num_hidden_layers, config.num_key_value_heads, head_dim),
                                _windows(config))
    if config.model_type == "gpt2" and not getattr(config, "reorder_and_upcast_attn", False):
        return GPT2Decoder(model, cache(config.n_layer, config.n_head, config.n_embd // config.n_head),
                           [None] * config.n_layer)
    return None
