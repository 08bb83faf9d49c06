"""``Sampler``: batched, KV-cached generation on the live training weights, returning a Rollout.

A model decodes over a KV cache of fastppo's, allocated once per sampler, through a hand-written
forward (the families of ``lean.FAMILIES``, on a rollout copy of the projections packed for the
step: ``packed.py``, refreshed when the weights change) or through its own modules, its attention
handed over at transformers' attention interface (``interface.py``); ``decoders.py`` chooses. The
cache is paged (``paged.py``: blocks through a block table, a prompt's blocks shared by its
samples, rows admitted while memory covers them) when its budget is short of every slot at the
cap, else static (``static_cache.py``: every one of ``max_batch_size`` slots at ``max_seq_len``); the
decode attention is ``attention.py``'s (flash-attn, fastppo's decode kernel or its twin, chosen in
``flash.py``; on CUDA each step a replayed CUDA graph). A model neither serves (state-space or
linear-attention layers, a keyword its attention passes that the cache attention does not honour)
goes through ``generic.py``, and ``Sampler.path`` says why. All run the continuous-batching loop of
``batching.py``: rows enter free slots as earlier rows finish, finished rows leave the batch, and
each step's draw is ``sample_tokens`` (one fused kernel on CUDA). Given a
:class:`~fastppo.rollout.turns.Turns`, the rows are multi-turn episodes: a row pauses between turns
in its slot and its continuation is prefilled onto its cache (``turns.py``).
"""

from typing import Callable, Optional, Sequence, Union

import torch

from ..limits import GiB
from ..ops import checks
from ..ops.sample_tokens import check_sampling_options, sample_tokens
from ..windows import UnknownWindows, smallest_window
from .batching import TOOL_SCHEDULES, TOOL_WINDOW, LoopSettings, RolloutLoop, row_cap, sampling_mode, sync_every
from .cuda_graphs import DecodeGraphs, graph_rows
from .decoders import DECODERS, cached_decoder
from .flash import ATTENTIONS
from .generic import GenericDecoder
from .packed import WEIGHTS
from .paged import KVMemoryError
from .rollout import Rollout
from .stream import RolloutStream, StreamLoop
from .turns import Turns
from .weight_layouts import LAYOUTS

KV_CACHES = ("auto", "paged", "static")


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return x


def _token_ids(x) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, int) else tuple(x)


class Draw:
    """A decode step's draw: ``sample_tokens`` with one seed per step, drawn on the CPU (no device
    sync) from a generator seeded with ``seed``, else from torch's global one, so a seeded trainer
    run reproduces either way."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: Optional[int]):
        self.options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(self, logits):
        step_seed = int(torch.randint(1 << 62, (1,), generator=self.generator))
        return sample_tokens(logits, **self.options, seed=step_seed)


class Sampler:
    """Generates rollouts from ``model`` (any Hugging Face causal LM), reusing one KV cache.

    Args:
        model: an ``AutoModelForCausalLM``; its parameters are used by reference, never copied.
        max_batch_size: the most rows decoded at once (the KV cache's slots). A ``generate`` call
            may ask for more: the others wait for free slots.
        max_seq_len: the longest prompt plus response a row may reach.
        dtype: the KV cache's dtype (default: the model's).
        cuda_graphs: replay the decode step as CUDA graphs (CUDA, over fastppo's cache only).
        attention: the decode attention over fastppo's cache: ``"flash"`` (flash-attn's
            ``flash_attn_with_kvcache``), ``"triton"`` (fastppo's ``decode_attention`` kernel: each
            row's live keys read where they lie, a group's shared prompt once), ``"sdpa"`` (that
            op's PyTorch twin), or ``"auto"``: flash where it can run (flash-attn installed, CUDA, a
            float16/bfloat16 model and cache), else the kernel on CUDA, else SDPA.
        compact_below: when fewer than this share of the batch's rows are still going (checked
            every 16 steps on an accelerator, every step on the CPU), the live rows move into the
            holes and the batch shrinks to them; 1 packs whenever a row has ended, 0 never moves
            a row (free slots past the last live one still leave the batch).
        kv_cache: the KV layout, ``"paged"``, ``"static"`` or ``"auto"``: paged when
            ``kv_block_size`` is given or ``kv_memory`` is short of every slot at ``max_seq_len``,
            else static (nothing to page).
        kv_block_size: positions per block of the paged cache (default: 256 where flash-attn's
            decode runs, which pages in multiples of 256, else 16); never more than
            ``max_seq_len`` (a multiple of 256 rounded up to one).
        kv_memory: bytes of the paged cache; rows enter while it covers them, so it bounds the
            rows in flight with ``max_batch_size`` (default: enough for every slot at
            ``max_seq_len``, the static layout's memory).
        weights: what a hand-written forward's projections multiply by: ``"packed"``, a copy with each
            layer's projections on one input fused, in the layout fastest on this machine for
            ``max_batch_size`` rows, made again at the start of each ``generate`` (one pass over
            the weights); or ``"live"``, the model's own modules.
        layout: the packed copy's layout (``layouts.LAYOUTS``); default: measured at start and
            kept per machine (``calibration.py``).
        decoder: ``"lean"`` (a hand-written forward, ``lean.FAMILIES``), ``"modules"`` (the model's own
            modules, attending over fastppo's cache), ``"generic"`` (its own forward and cache), or
            ``"auto"``: the first of those that serves the model (``decoders.py``); ``path`` says which.
    """

    def __init__(
        self,
        model,
        *,
        max_batch_size: int,
        max_seq_len: int,
        dtype: Optional[torch.dtype] = None,
        cuda_graphs: bool = True,
        attention: str = "auto",
        compact_below: float = 1.0,
        kv_cache: str = "auto",
        kv_block_size: Optional[int] = None,
        kv_memory: Optional[int] = None,
        weights: str = "packed",
        layout: Optional[str] = None,
        decoder: str = "auto",
    ):
        self.model = model
        self.max_batch_size = _positive_int(max_batch_size, "max_batch_size")
        self.max_seq_len = _positive_int(max_seq_len, "max_seq_len")
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if not checks.is_real(compact_below) or not 0 <= compact_below <= 1:
            raise ValueError(f"compact_below must be a number in [0, 1], got {compact_below!r}")
        self.compact_below = float(compact_below)
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
        if kv_block_size is not None:
            _positive_int(kv_block_size, "kv_block_size")
        if kv_memory is not None:
            _positive_int(kv_memory, "kv_memory")
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
        if layout is not None and layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {layout!r}")
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
        self.cached, path = cached_decoder(
            model, max_batch_size, max_seq_len, dtype, attention, kv_cache, kv_block_size, kv_memory, weights, layout,
            decoder,
        )  # fmt: skip
        #: Which path this model decodes on and why, one line (``fastppo train`` logs it at start-up).
        self.path = path
        #: The decoder in use, by the name ``decoder=`` takes: ``"lean"``, ``"modules"`` or ``"generic"``.
        self.decoder = "generic" if self.cached is None else self.cached.kind
        if self.cached is None and attention != "auto":
            raise ValueError(f"attention={attention!r} cannot be used: the sampler's path is {path}")
        use_graphs = cuda_graphs and self.cached is not None and self.device.type == "cuda"
        self.graphs = DecodeGraphs(self.cached) if use_graphs else None
        self._asleep = None  # (tensor, bytes) of the KV cache while :meth:`sleep` holds its memory freed
        #: Slots the last ``generate`` decoded, summed over its steps (free and ended ones included):
        #: against its tokens, what the long tail cost.
        self.rows_decoded = 0
        #: Tokens the last ``generate`` prefilled: prompts, and episodes' continuations.
        self.prefill_tokens = 0
        #: The most rows the last ``generate`` had in flight (decoding, paused or waiting for memory).
        self.peak_rows = 0
        #: How often in the last ``generate`` a row or a prompt waited for KV memory (paged cache).
        self.memory_waits = 0
        #: Seconds the last ``generate`` waited for tools (an episode's ``Turns.ready``).
        self.tool_wait_seconds = 0.0
        #: The last ``generate``'s decode steps, its rows decoding summed over them (what the steps
        #: did: against ``steps * max_batch_size``, the batch's occupancy), and its steps with under a
        #: quarter of the slots decoding.
        self.steps = self.live_rows = self.sparse_steps = 0

    @property
    def kv_cache(self):
        """fastppo's KV cache (``paged.py``'s or ``static_cache.py``'s), None on the generic path."""
        return None if self.cached is None else self.cached.cache

    @property
    def weights(self):
        """The :class:`~fastppo.rollout.packed.DecoderWeights` a cached decoder multiplies by (its
        ``weights``, ``layout`` and ``bytes``; "live" for a model's own modules), None on the generic path."""
        return None if self.cached is None else self.cached.weights

    @property
    def fast_path(self) -> bool:
        """Whether this model decodes over fastppo's cache (else the generic path; ``path`` says why)."""
        return self.cached is not None

    @property
    def attention(self) -> str:
        """The decode attention in use: ``"flash"``, ``"triton"`` (fastppo's kernel), ``"sdpa"`` (its
        PyTorch twin), or ``"model"`` (the generic path's own)."""
        if self.cached is None:
            return "model"
        if self.cached.attention.flash_decode is not None:
            return "flash"
        return "triton" if self.cached.attention.backend == "triton" else "sdpa"

    def _check_prompts(self, prompts, max_new_tokens, n: int) -> list:
        """Each row's budget, ``n`` rows per prompt, from an int, one per prompt or one per row."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if len(max_new_tokens) == len(prompts):
            max_new_tokens = [new for new in max_new_tokens for _ in range(n)]
        if len(max_new_tokens) != len(prompts) * n:
            raise ValueError(
                f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts of {n} samples"
            )
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size})")
            for new in max_new_tokens[i * n : (i + 1) * n]:
                _positive_int(new, f"max_new_tokens[{i}]")
                if len(prompt) + new > self.max_seq_len:
                    raise ValueError(
                        f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({new}) exceeds "
                        f"max_seq_len={self.max_seq_len}"
                    )
        return list(max_new_tokens)

    def _default_stop_and_pad(self, stop_token_ids, pad_token_id):
        config = self.model.config
        generation = getattr(self.model, "generation_config", None)
        if stop_token_ids is None:
            stop_token_ids = getattr(generation, "eos_token_id", None) or getattr(config, "eos_token_id", None)
        stop = _token_ids(stop_token_ids)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = stop[0] if stop else 0
        for t in (*stop, pad_token_id):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop and pad token ids must be in [0, {self.vocab_size}), got {t}")
        return stop, pad_token_id

    def _check_generic_turns(self) -> None:
        """The generic path's continuations leave masked columns in the model's cache; a window
        counted in cache columns would then cover other tokens than the model's window does."""
        try:
            windowed = smallest_window(self.model.config) is not None
        except UnknownWindows:
            windowed = True
        if windowed:
            raise ValueError(
                f"multi-turn rollouts of a {self.model.config.model_type!r} model, which attends in "
                f"windows and decodes on the generic path, are not supported ({self.path})"
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: Union[int, Sequence[int]],
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Optional[Union[int, Sequence[int]]] = None,
        pad_token_id: Optional[int] = None,
        num_samples_per_prompt: int = 1,
        seed: Optional[int] = None,
        on_rows_ended: Optional[Callable[[int], None]] = None,
        turns: Optional[Turns] = None,
        tool_schedule: str = "fixed",
        tool_window: int = TOOL_WINDOW,
    ) -> Rollout:
        """Sample ``num_samples_per_prompt`` responses per prompt.

        Args:
            prompts: token-id lists, of any lengths.
            max_new_tokens: an int, one per prompt, or one per row (``num_samples_per_prompt``
                rows per prompt, a prompt's samples together).
            temperature: 0 for greedy decoding; ``top_k`` (0: off) and ``top_p`` (1: off) restrict
                the sampled tokens, not the returned log-probs.
            stop_token_ids: tokens that end a row (included in its response); default: the
                model's end-of-sequence ids. ``pad_token_id``: fills ended rows (default: the
                model's pad id, else the first stop id).
            seed: makes the draw reproducible (on the same device).
            on_rows_ended: called with the number of rows that ended, at each look for them (a
                progress bar's ``update``).
            turns: makes each row an episode of turns (``turns.py``): ``max_new_tokens`` then
                bounds the tokens the model draws in an episode and ``max_seq_len`` all of its
                tokens; the response holds the continuations too, with mask 0 and log-prob 0, and
                ``response_lens`` counts every token of it.
            tool_schedule: when a row paused for its tools resumes (``batching.py``): ``"fixed"``,
                ``tool_window`` decode steps after its turn ended, whatever the tools' timing, so a
                seed reproduces the episodes; or ``"eager"``, as soon as its tools are done, the
                loop waiting for tools only when no row can decode (reproducible in distribution,
                not token for token).
        """
        n = _positive_int(num_samples_per_prompt, "num_samples_per_prompt")
        max_new = self._check_prompts(prompts, max_new_tokens, n)
        draw, stop, pad = self._check_options(n, temperature, top_k, top_p, stop_token_ids, pad_token_id, seed)
        self._check_turns(turns is not None, tool_schedule, tool_window)
        self._wake()
        if self.kv_cache is not None and self.kv_cache.paged:
            self._check_kv_memory(prompts, n, max_new, turns is not None)
            self.kv_cache.reset_peak()
        self.refresh()
        settings = self._loop_settings(draw, stop, pad, tool_schedule, tool_window)
        decoder = settings.decoder
        decoder.prefilled = 0
        loop = RolloutLoop(settings, [list(p) for p in prompts], n, max_new, on_rows_ended, turns)
        with sampling_mode(self.model):
            rollout = loop.run()
        self.rows_decoded, self.prefill_tokens = loop.rows_decoded, decoder.prefilled
        self.peak_rows, self.memory_waits = loop.peak_rows, loop.memory_waits
        self.tool_wait_seconds = loop.tool_wait
        self.steps, self.live_rows, self.sparse_steps = loop.steps_run, loop.live_steps, loop.sparse_steps
        return rollout

    def stream(
        self,
        *,
        prompts_per_batch: int,
        ahead: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Optional[Union[int, Sequence[int]]] = None,
        pad_token_id: Optional[int] = None,
        num_samples_per_prompt: int = 1,
        seed: Optional[int] = None,
        episodes: bool = False,
        tool_schedule: str = "fixed",
        tool_window: int = TOOL_WINDOW,
    ) -> RolloutStream:
        """A :class:`~fastppo.rollout.stream.RolloutStream` over this sampler's cache: batches of
        ``prompts_per_batch`` prompts, up to ``ahead`` of them entering the batch while an earlier one
        finishes. The options are :meth:`generate`'s; ``episodes``: each batch comes with its
        ``Turns``. While the stream has rows in flight its cache is theirs: ``generate`` would
        overwrite it."""
        n = _positive_int(num_samples_per_prompt, "num_samples_per_prompt")
        _positive_int(prompts_per_batch, "prompts_per_batch")
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"ahead must be an int >= 0, got {ahead!r}")
        budget = _positive_int(max_new_tokens, "max_new_tokens")
        draw, stop, pad = self._check_options(n, temperature, top_k, top_p, stop_token_ids, pad_token_id, seed)
        self._check_turns(episodes, tool_schedule, tool_window)
        self._wake()
        settings = self._loop_settings(draw, stop, pad, tool_schedule, tool_window)
        loop = StreamLoop(settings, n, prompts_per_batch, ahead, budget, episodes)
        return RolloutStream(self, loop, draw)

    def _check_options(self, n, temperature, top_k, top_p, stop_token_ids, pad_token_id, seed) -> tuple:
        """``(draw, stop ids, pad id)``: the sampling options checked, and the step's draw."""
        if n > self.max_batch_size:
            raise ValueError(
                f"num_samples_per_prompt={n} exceeds max_batch_size={self.max_batch_size}: a prompt's "
                "samples are decoded together"
            )
        check_sampling_options(temperature, top_k, top_p)
        stop, pad = self._default_stop_and_pad(stop_token_ids, pad_token_id)
        return Draw(temperature, top_k, top_p, seed), stop, pad

    def _check_turns(self, episodes: bool, tool_schedule: str, tool_window: int) -> None:
        if tool_schedule not in TOOL_SCHEDULES:
            raise ValueError(f"tool_schedule must be one of {TOOL_SCHEDULES}, got {tool_schedule!r}")
        if isinstance(tool_window, bool) or not isinstance(tool_window, int) or tool_window < 0:
            raise ValueError(f"tool_window must be an int >= 0, got {tool_window!r}")
        if episodes and self.cached is None:
            self._check_generic_turns()

    def sleep(self) -> None:
        """Free the KV cache's memory until the next ``generate`` or ``stream`` (a trainer's update
        then has it, as verl's engines sleep): the cache keeps its tensors, their storage goes, and
        the CUDA graphs that read its addresses are dropped, captured again when next needed. Not
        while a stream has rows in flight: their keys and values are in it."""
        if self.cached is None or self._asleep is not None:
            return
        cache = self.cached.cache
        self._asleep = [(t, t.untyped_storage().nbytes()) for t in cache.k + cache.v]
        for tensor, _ in self._asleep:
            tensor.untyped_storage().resize_(0)

    def _wake(self) -> None:
        """The KV cache's memory back, zeroed (as it was made), after :meth:`sleep`."""
        if self._asleep is None:
            return
        for tensor, nbytes in self._asleep:
            tensor.untyped_storage().resize_(nbytes)
            tensor.zero_()
        self._asleep = None
        if self.graphs is not None:
            self.graphs = DecodeGraphs(self.cached)

    def refresh(self) -> None:
        """A hand-written forward's packed copy caught up with the parameters (one pass over the
        weights), before a rollout or a stream's next batch."""
        if self.cached is not None:
            self.cached.weights.refresh()

    def _decoder(self) -> tuple:
        """``(decoder, decode)`` for a rollout: the cached decoder with its CUDA graphs' step where it
        has them, else a generic decoder."""
        if self.cached is not None:
            return self.cached, self.graphs.decode if self.graphs is not None else self.cached.decode
        decoder = GenericDecoder(self.model)
        return decoder, decoder.decode

    def _loop_settings(self, draw, stop: tuple, pad: int, tool_schedule: str, tool_window: int) -> LoopSettings:
        """What this call's rollout loop decodes with: the decoder from :meth:`_decoder`, this sampler's
        slots and context, and the call's checked options."""
        decoder, decode = self._decoder()
        bucket = graph_rows if self.graphs is not None else None
        slots, max_len = self.max_batch_size, self.max_seq_len
        return LoopSettings(
            decoder, decode, slots, max_len, draw, stop, pad, self.compact_below, bucket, tool_schedule, tool_window
        )

    def _check_kv_memory(self, prompts, n: int, max_new: list, episodes: bool) -> None:
        """Refuse a rollout a prompt of which the paged cache could never admit, even empty."""
        cache, ahead = self.kv_cache, sync_every(self.device)
        need = max(
            cache.smallest(
                len(p), n, row_cap(len(p), max_new[i * n : (i + 1) * n], self.max_seq_len, episodes), len(p) + ahead
            )
            for i, p in enumerate(prompts)
        )
        if need > cache.num_blocks:
            smallest = need * cache.block_bytes
            raise KVMemoryError(
                cache.num_blocks * cache.block_bytes,
                f"({cache.num_blocks} blocks) cannot admit {n} samples of the longest prompt: {need} blocks "
                f"needed, the smallest that works is {smallest / GiB:.3g} GiB ({smallest:,} bytes)",
                smallest,
            )
