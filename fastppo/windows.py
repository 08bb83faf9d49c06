"""Each layer's sliding window, read as transformers' modeling code reads it.

Which layers of a Hugging Face causal LM attend through a sliding window, and how wide, read from
its config the way transformers' modeling code decides it: one answer for the sampler's decode
masks (``rollout/lean.py``, ``rollout/interface.py``), the shared-prefix layout's masks
(``trainer/update/row_layout.py``) and its check.

transformers picks each layer's mask in one of these ways:

- a config with ``layer_types`` (Qwen2 and Qwen3, whose configs derive them from
  ``use_sliding_window`` and ``max_window_layers``; Gemma 2 and 3, Cohere2, GPT-OSS, Olmo3, SmolLM3,
  Ministral, ...): layer ``i`` takes the mask of its type, ``"sliding_attention"`` windowed by
  ``sliding_window``, ``"full_attention"`` causal;
- a config without them: every layer windowed by ``sliding_window`` when it is set (Mistral,
  Mixtral, Phi-3, Starcoder2, PhiMoE, Qwen3-MoE, whose config clears it unless
  ``use_sliding_window``); a list gives each layer its own;
- GPT-Neo's ``attention_layers``: a ``"local"`` layer bands its scores by column inside the
  attention itself (``window_size``), whatever mask it is given.

``use_sliding_window`` is a flag only some families read (``FLAGGED``, from each one's modeling
and configuration code); the others window by ``sliding_window`` whatever it says, and hub
checkpoints of Mistral-type models ship ``"use_sliding_window": false`` beside a window their
model applies. Reading the flag for them would see no window where the model has one.

A window ``w`` lets the query at position ``q`` see the keys at ``q - w < k <= q``: ``w`` keys, itself
included (transformers' ``sliding_window_overlay``). What this module cannot read (a layer type it
does not know: chunked, linear, convolutional; a window that is not a positive int) raises
:class:`UnknownWindows`, and a caller treats that model as windowed everywhere: the shared layout
falls back to padded rows, the sampler takes the generic path.
"""

from typing import Optional

FULL, SLIDING = "full_attention", "sliding_attention"

# The families whose configs without ``layer_types`` read ``use_sliding_window``, and what it switches
# on: "layers", the layers from ``max_window_layers`` (Qwen2, Qwen2-MoE and Qwen3 configs older than
# their ``layer_types``, which newer ones derive from the same two fields); "all", every layer
# (Qwen3-MoE, whose config also clears the window when it is off). Where ``layer_types`` are given,
# every family masks a "sliding_attention" layer by its window whatever the flag (SmolLM3's
# attention reads the flag, but only for flash-attn: its masks do not).
FLAGGED = {"qwen2": "layers", "qwen2_moe": "layers", "qwen3": "layers", "qwen3_moe": "all"}


class UnknownWindows(ValueError):
    """A config whose attention windows cannot be read; the message says what is unknown."""


def layer_windows(config) -> list:
    """Per layer of ``config``, the sliding window in tokens, or None for full causal attention."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    flag = FLAGGED.get(getattr(config, "model_type", None))
    switched_off = flag is not None and getattr(config, "use_sliding_window", False) is not True
    if layer_types:
        unknown = sorted(set(layer_types) - {FULL, SLIDING})
        if unknown:
            raise UnknownWindows(f"its layer types {unknown} are not full or sliding-window attention")
        return [_width(window) if kind == SLIDING else None for kind in layer_types]
    if getattr(config, "attention_layers", None):  # GPT-Neo
        if "local" not in config.attention_layers:
            return [None] * layers
        raise UnknownWindows(f"its local layers band their attention by column (window {config.window_size})")
    if isinstance(window, (list, tuple)):
        if len(window) != layers:
            raise UnknownWindows(f"its sliding_window lists {len(window)} windows for {layers} layers")
        return [None if w in (None, 0) else _width(w) for w in window]
    if window is None or switched_off:
        return [None] * layers
    first = getattr(config, "max_window_layers", 0) if flag == "layers" else 0
    return [_width(window) if i >= first else None for i in range(layers)]


def _width(window) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnknownWindows(f"its sliding_window is {window!r}, not a positive number of tokens")
    return window


def smallest_window(config) -> Optional[int]:
    """The narrowest window of any layer of ``config``; None when every layer attends in full.
    Raises :class:`UnknownWindows` like :func:`layer_windows`."""
    return min((w for w in layer_windows(config) if w is not None), default=None)
