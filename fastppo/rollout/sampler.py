"""``Sampler``: batched, KV-cached generation on the live training weights, returning a Rollout.

For Llama, Mistral, Qwen2, Qwen3 and GPT-2 it runs the lean decoders of ``lean.py`` over a KV
cache allocated once per sampler: prompts are prefilled in groups of similar length (one forward
per group, right-padded, padding bounded by ``PREFILL_PADDING``), each prompt's cache row is
copied to its other samples, and every decode step runs all rows at their own positions (on CUDA as a replayed CUDA graph), attending with flash-attn's
``flash_attn_with_kvcache`` where it can run, else SDPA (``flash.py``). Other causal LMs go
through ``generic.py``. Both share the loop below: draw with ``sample_tokens`` (one fused kernel
on CUDA), record, stop, with one host sync every 16 steps to end early once every row has
finished. Finished rows stop changing.
"""

import contextlib
from typing import Optional, Sequence, Union

import torch

from ..ops.sampling import check_sampling_options, sample_tokens
from .cuda_graphs import DecodeGraphs
from .flash import ATTENTIONS
from .generic import GenericDecoder
from .lean import lean_decoder
from .rollout import Rollout

SYNC_EVERY = 16  # decode steps between checks that some row is still going
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


def _positive_int(x, name: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return x


def _token_ids(x) -> tuple:
    if x is None:
        return ()
    return (x,) if isinstance(x, int) else tuple(x)


@contextlib.contextmanager
def _sampling_mode(model):
    """No autograd and no dropout while sampling; the model's training flag is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class Sampler:
    """Generates rollouts from ``model`` (any Hugging Face causal LM), reusing one KV cache.

    Args:
        model: an ``AutoModelForCausalLM``; its parameters are used by reference, never copied.
        max_batch_size: the most rows (prompts x samples) one ``generate`` call may hold.
        max_seq_len: the longest prompt plus response a row may reach.
        dtype: the KV cache's dtype (default: the model's).
        cuda_graphs: replay the decode step as CUDA graphs (CUDA and the lean path only).
        attention: the lean path's decode attention: ``"flash"`` (flash-attn's
            ``flash_attn_with_kvcache``), ``"sdpa"`` (PyTorch), or ``"auto"``: flash where it can
            run (flash-attn installed, CUDA, a float16/bfloat16 model and cache), else SDPA.
    """

    def __init__(self, model, *, max_batch_size: int, max_seq_len: int, dtype: Optional[torch.dtype] = None,
                 cuda_graphs: bool = True, attention: str = "auto"):
        self.model = model
        self.max_batch_size = _positive_int(max_batch_size, "max_batch_size")
        self.max_seq_len = _positive_int(max_seq_len, "max_seq_len")
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.lean = lean_decoder(model, max_batch_size, max_seq_len, dtype, attention)
        if self.lean is None and attention != "auto":
            raise ValueError(f"attention={attention!r} applies to the lean decoders (Llama, Mistral, Qwen2, Qwen3, "
                             f"GPT-2); a {model.config.model_type!r} model runs its own attention, chosen with "
                             "attn_implementation when it is loaded")
        use_graphs = cuda_graphs and self.lean is not None and self.device.type == "cuda"
        self.graphs = DecodeGraphs(self.lean) if use_graphs else None

    @property
    def fast_path(self) -> bool:
        """Whether this model runs the lean decoder (else the generic one)."""
        return self.lean is not None

    @property
    def attention(self) -> str:
        """The decode attention in use: ``"flash"``, ``"sdpa"``, or ``"model"`` (the generic path's own)."""
        if self.lean is None:
            return "model"
        return "flash" if self.lean.cache.flash_decode is not None else "sdpa"

    def _check_prompts(self, prompts, max_new_tokens) -> list:
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
            max_new_tokens = [max_new_tokens] * len(prompts)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts")
        for i, (prompt, new) in enumerate(zip(prompts, max_new_tokens)):
            _positive_int(new, f"max_new_tokens[{i}]")
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt):
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size})")
            if len(prompt) + new > self.max_seq_len:
                raise ValueError(f"prompt {i} ({len(prompt)} tokens) + max_new_tokens ({new}) exceeds "
                                 f"max_seq_len={self.max_seq_len}")
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

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: Union[int, Sequence[int]],
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 stop_token_ids: Optional[Union[int, Sequence[int]]] = None, pad_token_id: Optional[int] = None,
                 num_samples_per_prompt: int = 1, seed: Optional[int] = None) -> Rollout:
        """Sample ``num_samples_per_prompt`` responses per prompt.

        Args:
            prompts: token-id lists, of any lengths.
            max_new_tokens: an int, or one per prompt.
            temperature: 0 for greedy decoding; ``top_k`` (0: off) and ``top_p`` (1: off) restrict
                the sampled tokens, not the returned log-probs.
            stop_token_ids: tokens that end a row (included in its response); default: the
                model's end-of-sequence ids. ``pad_token_id``: fills ended rows (default: the
                model's pad id, else the first stop id).
            seed: makes the draw reproducible (on the same device).
        """
        max_new = self._check_prompts(prompts, max_new_tokens)
        n = _positive_int(num_samples_per_prompt, "num_samples_per_prompt")
        rows = [list(p) for p in prompts for _ in range(n)]
        if len(rows) > self.max_batch_size:
            raise ValueError(f"{len(prompts)} prompts x {n} samples = {len(rows)} rows exceed "
                             f"max_batch_size={self.max_batch_size}")
        check_sampling_options(temperature, top_k, top_p)
        stop, pad = self._default_stop_and_pad(stop_token_ids, pad_token_id)
        # One seed per step, drawn on the CPU (no device sync): from a generator seeded with
        # ``seed``, else from torch's global one, so a seeded trainer run reproduces either way.
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        step_seeds = torch.randint(1 << 62, (max(max_new),), generator=generator).tolist()

        with _sampling_mode(self.model):
            return self._generate(rows, [m for m in max_new for _ in range(n)], n, float(temperature), top_k,
                                  float(top_p), stop, pad, step_seeds)

    def _start(self, rows: list, n: int):
        """Prefill; return ``(first logits (B, V), decode function)``."""
        if self.lean is None:
            decoder = GenericDecoder(self.model)
            return decoder.start(rows, self.device), decoder.decode
        prompts = rows[::n]  # the first sample's row of each prompt is prefilled, the others copied
        first = [None] * len(prompts)
        for group in prefill_groups([len(p) for p in prompts]):
            L = max(len(prompts[i]) for i in group)
            ids = torch.tensor([prompts[i] + [0] * (L - len(prompts[i])) for i in group], device=self.device)
            lengths = torch.tensor([len(prompts[i]) for i in group], device=self.device)
            cache_rows = torch.tensor([i * n for i in group], device=self.device)
            for i, logits in zip(group, self.lean.prefill(cache_rows, ids, lengths)):  # (V,) each
                first[i] = logits
        if n > 1:
            others = torch.tensor([r for r in range(len(rows)) if r % n], device=self.device)
            self.lean.cache.copy_rows(others // n * n, others, max(len(p) for p in prompts))
        decode = self.graphs.decode if self.graphs is not None else self.lean.decode
        return torch.stack(first).repeat_interleave(n, dim=0), decode

    def _generate(self, rows, max_new, n, temperature, top_k, top_p, stop, pad, step_seeds) -> Rollout:
        device, B = self.device, len(rows)
        prompt_lens = torch.tensor([len(r) for r in rows], device=device)
        limits = torch.tensor(max_new, device=device)
        steps, first_span = max(max_new), max(len(r) for r in rows)
        tokens_out = torch.full((B, steps), pad, dtype=torch.long, device=device)
        logprobs_out = torch.zeros(B, steps, dtype=torch.float32, device=device)
        mask_out = torch.zeros(B, steps, dtype=torch.bool, device=device)
        active = torch.ones(B, dtype=torch.bool, device=device)
        stopped = torch.zeros_like(active)
        stop_ids = torch.tensor(stop, dtype=torch.long, device=device)

        logits, decode = self._start(rows, n)
        for step in range(steps):
            if step > 0:
                # Row r feeds the token sampled last step at position prompt_len + step - 1; rows
                # that have ended keep moving (writing slots nobody reads), clamped to the cache.
                positions = (prompt_lens + step - 1).clamp(max=self.max_seq_len - 1)
                logits = decode(tokens, positions, min(first_span + step, self.max_seq_len))
            tokens, logprobs = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                             seed=step_seeds[step])
            tokens = torch.where(active, tokens, pad)
            tokens_out[:, step] = tokens
            logprobs_out[:, step] = torch.where(active, logprobs, 0.0)
            mask_out[:, step] = active
            hit = active & torch.isin(tokens, stop_ids)
            stopped |= hit
            active &= ~hit & (limits > step + 1)
            if step % SYNC_EVERY == SYNC_EVERY - 1 and not bool(active.any()):
                break

        lens = mask_out.sum(dim=1)
        R = int(lens.max())
        return Rollout(prompt_ids=rows, response_ids=tokens_out[:, :R].contiguous(),
                       response_mask=mask_out[:, :R].contiguous(), response_lens=lens,
                       logprobs=logprobs_out[:, :R].contiguous(),
                       finish_reason=["stop" if s else "length" for s in stopped.tolist()])
