"""Any family whose attention goes through transformers' attention interface, over fastppo's cache.

transformers' decoder families compute their queries, keys and values their own way (biases, QK
norms, partial or no rotary embedding, MoE blocks around them) and then call the attention function
registered under the name in the model's config (``AttentionInterface``), handing it the layer's
``scaling``, ``sliding_window``, ``softcap`` and sinks (``s_aux``). :class:`InterfaceDecoder` runs
the model's own forward with fastppo's function registered there (``IMPLEMENTATION``): each call
hands the layer's fresh keys and values to the sampler's cache and attends through
``attention.py``, as the hand-written forwards of ``lean.py`` do, so everything they have (rows
joining mid-batch, paging and shared prompt blocks, the cascade, the decode kernel, continuations,
CUDA graphs) serves the family too. The model is called with its own position ids and no cache of
its own; the config names fastppo's function only while the sampler's forward runs (no mask is
built for it: transformers skips masks for an attention it has no mask function for).

What a layer passes is honoured or refused, never ignored (``HONOURED``, ``INERT``): a keyword with
a value outside those makes :meth:`InterfaceDecoder.shapes` refuse the model by name, and the
sampler takes ``generic.py``'s path, saying why. ``shapes`` learns the cache's shape from one
forward of two tokens through a recording attention: every layer must attend through the
interface exactly once (a state-space or linear-attention layer does not), with one number of KV
heads and one key size; values shorter than keys (MLA's, decompressed) are stored padded to it.
"""

import contextvars
import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..windows import UnknownWindows, layer_windows
from .cached import CachedDecoder, CacheShape

IMPLEMENTATION = "fastppo_cache"
#: What a layer may pass that the cache attention honours: its scale, its window (checked against
#: the config's, which transformers' masks read), a soft cap, sinks, and dropout when it is 0.
HONOURED = ("scaling", "sliding_window", "softcap", "s_aux", "dropout")
#: What a layer may pass that says nothing about its attention's math (the forward's own options).
INERT = ("position_ids", "cache_position", "use_cache", "output_router_logits", "position_embeddings", "layer_idx")

_call = contextvars.ContextVar("fastppo_cache_attention")


class Unserved(ValueError):
    """A model this decoder cannot serve; the message says why, naming the family."""


def _attention(module, query, key, value, attention_mask, **kwargs):
    """The function registered with transformers: the running forward's own attention."""
    call = _call.get(None)
    if call is None:
        raise RuntimeError(f"attention {IMPLEMENTATION!r} runs only inside fastppo's sampler")
    return call(module, query, key, value, kwargs), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(IMPLEMENTATION, _attention)


def layer_options(family: str, layer: int, window: Optional[int], head_dim: int, kwargs: dict) -> tuple:
    """``(scale, softcap, sinks)`` from what layer ``layer`` of a ``family`` model passed its attention,
    ``window`` the layer's window as its config gives it; :class:`Unserved` for what is not honoured."""
    for name, value in kwargs.items():
        if name in HONOURED or name in INERT or value is None or value is False:
            continue
        if name == "is_causal" and value is True:
            continue
        raise Unserved(
            f"{family}'s attention passes {name}={_shown(value)}, which fastppo's cache attention does not honour"
        )
    if kwargs.get("dropout", 0.0):
        raise Unserved(f"{family}'s attention passes dropout={kwargs['dropout']}, and the sampler decodes without")
    passed = kwargs.get("sliding_window")
    if passed is not None and passed != window:
        raise Unserved(f"{family}'s layer {layer} passes sliding_window={passed!r} where its config gives {window!r}")
    scale = kwargs.get("scaling")
    return (head_dim**-0.5 if scale is None else float(scale)), kwargs.get("softcap"), kwargs.get("s_aux")


def _shown(value) -> str:
    return f"a tensor {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)[:60]


def _configs(model) -> list:
    """The configs ``model``'s modules read their attention's name from (a composite model's several)."""
    found = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "model_type")}
    return list(found.values())


class _Attending:
    """While a forward runs: transformers' config names fastppo's attention, ``call`` answers each
    layer's call, and (``last``) only the rows' ``last`` columns reach the LM head."""

    def __init__(self, model, configs: list, call, last: Optional[Tensor]):
        self.model, self.configs, self.call, self.last = model, configs, call, last

    def __enter__(self):
        self.token = _call.set(self.call)
        self.saved = [(c, c._attn_implementation) for c in self.configs]
        for config, _ in self.saved:
            config._attn_implementation = IMPLEMENTATION
        self.hook = None
        if self.last is not None:
            last = self.last

            def pick(module, args):  # (B, L, hidden) -> (B, 1, hidden): each row's own column
                (x,) = args
                return (x[torch.arange(x.shape[0], device=x.device), last].unsqueeze(1),)

            # first of the head's pre-hooks: a sharded head's own hook then sees the picked columns
            self.hook = self.model.get_output_embeddings().register_forward_pre_hook(pick, prepend=True)

    def __exit__(self, *exc):
        if self.hook is not None:
            self.hook.remove()
        for config, name in self.saved:
            config._attn_implementation = name
        _call.reset(self.token)


class InterfaceDecoder(CachedDecoder):
    """The model's own forward, each layer's attention over the sampler's cache."""

    kind = "modules"

    def __init__(self, model, attention, windows: list, weights):
        super().__init__(model, attention, windows, weights)
        _register()  # here too: a decoder chosen from a kept timing is built with no probe before it
        # a forward that can keep only the last column's logits (a decode step's); a prefill keeps
        # every column, of which the LM head's pre-hook passes on each row's own
        self.keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.configs = _configs(model)

    @classmethod
    def shapes(cls, model) -> CacheShape:
        """The cache's shape read from one recorded forward; raises :class:`Unserved` naming what this
        decoder cannot serve."""
        family = model.config.model_type
        try:
            windows = layer_windows(model.config)
        except UnknownWindows as error:
            raise Unserved(f"{family}: {error}") from None
        _register()
        calls = []

        def record(module, q, k, v, kwargs):
            layer = getattr(module, "layer_idx", None)
            if not isinstance(layer, int) or not 0 <= layer < len(windows):
                raise Unserved(f"{family}'s attention module {type(module).__name__} has no layer index")
            layer_options(family, layer, windows[layer], q.shape[-1], kwargs)
            if v.shape[3] > k.shape[3]:
                raise Unserved(f"{family}'s values are longer than its keys ({v.shape[3]} > {k.shape[3]} a head)")
            calls.append((layer, k.shape[1], k.shape[3], kwargs.get("s_aux") is not None))
            return q.new_zeros(q.shape[0], q.shape[2], q.shape[1], v.shape[3])  # (B, L, H, D)

        param = next(model.parameters())
        ids = torch.zeros(1, 2, dtype=torch.long, device=param.device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), _Attending(model, _configs(model), record, None):
                model(input_ids=ids, position_ids=torch.arange(2, device=param.device)[None], use_cache=False)
        except Unserved:
            raise
        except Exception as error:  # a forward that cannot run this way: its own path serves it
            first = (str(error).splitlines() or [""])[0][:200]
            raise Unserved(
                f"{family}'s forward without its own cache failed: {type(error).__name__}: {first}"
            ) from None
        finally:
            model.train(was_training)
        layers = [c[0] for c in calls]
        if layers != list(range(len(windows))):
            raise Unserved(
                f"{family}: {len(set(layers))} of its {len(windows)} layers attend through transformers' "
                "attention interface (the others mix tokens in code of their own: their own attention, "
                "state-space or linear-attention layers)"
            )
        heads = {(kv_heads, head_dim) for _, kv_heads, head_dim, _ in calls}
        if len(heads) > 1:
            raise Unserved(f"{family}'s layers differ in KV heads or head size ({sorted(heads)})")
        ((kv_heads, head_dim),) = heads
        return CacheShape(len(windows), kv_heads, head_dim, windows, any(c[3] for c in calls))

    def logits_at(self, ids: Tensor, positions: Tensor, attend, last: Optional[Tensor]) -> Tensor:
        family = self.model.config.model_type

        def call(module, q, k, v, kwargs):
            layer, Dv = module.layer_idx, v.shape[3]
            scale, softcap, sinks = layer_options(family, layer, self.windows[layer], q.shape[-1], kwargs)
            if Dv < k.shape[3]:  # MLA's values, shorter than its keys: stored padded with zeros, cut after
                v = F.pad(v, (0, k.shape[3] - Dv))
            return attend(layer, q, k, v, scale, softcap, sinks)[..., :Dv].transpose(1, 2)  # (B, L, H, Dv)

        keep = {"logits_to_keep": 1 if last is None else 0} if self.keeps else {}  # 0: every column
        with _Attending(self.model, self.configs, call, last):
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False, **keep)
        return out.logits[:, -1]  # (B, V)
