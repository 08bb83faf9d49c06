"""Hand-written decoder forwards for the common families, on the Hugging Face module's own parameters.

The model's norms, activations and rotary embedding are called as they are, so the math is the
model's own. Its projections are multiplied through ``packed.py``'s :class:`DecoderWeights`: by
default a rollout copy with each layer's projections on one input fused and stored in the layout
fastest here, made again at the start of each rollout, so it sees the optimizer's last step; or the
modules themselves (``weights="live"``). The attention is handed to the sampler's cache
(``cached.py``). ``FAMILIES`` is the one list of the families with a forward here; the others run
their own modules over the same cache (``interface.py``), or their own forward and cache
(``generic.py``) where that cannot serve them (``decoders.py`` chooses).
"""

from abc import abstractmethod

import torch
from torch import Tensor

from ..windows import UnknownWindows, layer_windows
from .cached import CachedDecoder, CacheShape


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder(CachedDecoder):
    """A hand-written forward: a family supplies ``projections``, ``forward`` and ``logits``."""

    kind = "lean"

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

    def logits_at(self, ids: Tensor, positions: Tensor, attend, last) -> Tensor:
        x = self.forward(ids, positions, attend)  # (B, L, hidden)
        x = x[:, -1] if last is None else x[torch.arange(x.shape[0], device=x.device), last]
        return self.logits(x)  # (B, V)


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
        return CacheShape(
            config.num_hidden_layers, config.num_key_value_heads, model.model.layers[0].self_attn.head_dim, windows
        )

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
        return CacheShape(config.n_layer, config.n_head, config.n_embd // config.n_head, [None] * config.n_layer)

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


#: ``config.model_type`` -> its hand-written forward.
FAMILIES = {
    "llama": LlamaLikeDecoder,
    "mistral": LlamaLikeDecoder,
    "qwen2": LlamaLikeDecoder,
    "qwen3": LlamaLikeDecoder,
    "gpt2": GPT2Decoder,
}
