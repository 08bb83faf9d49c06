"""A rollout laid out for the update, and the forward passes that read it.

Each row is its prompt followed by its response, right-padded; ``positions`` points at the hidden
state that predicts each response token, so the fused ops from hidden states gather exactly the
rows they score and never build full logits. ``prepare`` fills in what the update needs before
its first step: the old and reference log-probs and the values (no-grad passes), then the
advantages as the run's estimator (``estimators.py``) defines them.
"""

import contextlib
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..ops import IGNORE_INDEX, masked_whiten, token_logprobs_from_hidden
from . import sharding


@dataclass
class Batch:
    """One rollout laid out for the updates: prompt + response per row, right-padded."""

    input_ids: Tensor  # (B, L)
    attention_mask: Tensor  # (B, L)
    positions: Tensor  # (B, R): the position whose hidden state predicts each response token
    response_ids: Tensor  # (B, R)
    mask: Tensor  # (B, R) bool
    sampler_logprobs: Tensor  # (B, R) fp32, from the sampler
    old_logprobs: Optional[Tensor] = None  # (B, R); None until the update computes them
    ref_logprobs: Optional[Tensor] = None
    values: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    returns: Optional[Tensor] = None

    def rows(self, index: Tensor) -> "Batch":
        return Batch(**{k: None if v is None else v[index] for k, v in self.__dict__.items()})


def loss_mask(rollout, mask_truncated: bool) -> tuple:
    """``(mask, share)``: the response mask (B, R), with ``mask_truncated`` without the responses
    that hit max_new_tokens (which keep their scores in their group's baseline); and their share."""
    if not mask_truncated:
        return rollout.response_mask, 0.0
    truncated = torch.tensor([f == "length" for f in rollout.finish_reason], device=rollout.response_mask.device)
    return rollout.response_mask & ~truncated[:, None], float(truncated.float().mean())


def warn_truncated(share: float, max_new_tokens: int) -> None:
    warnings.warn(
        f"{share:.0%} of a batch's responses hit max_new_tokens={max_new_tokens} and are left out of the "
        "loss (--mask-truncated), so the update learns from the rest only; raise --max-new-tokens (said "
        "once per run; stop_rate logs it every iteration)"
    )


def lay_out(rollout, mask: Tensor, pad_id: int, device) -> Batch:
    """``rollout``'s rows as a :class:`Batch` with the response ``mask`` (B, R) given."""
    lens = rollout.response_lens.tolist()
    rows = [list(p) + rollout.response_ids[i, :n].tolist() for i, (p, n) in enumerate(zip(rollout.prompt_ids, lens))]
    L = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row, device=device)
        attention_mask[i, : len(row)] = 1
    R = rollout.response_ids.shape[1]
    prompt_lens = torch.tensor([len(p) for p in rollout.prompt_ids], device=device)
    positions = (prompt_lens[:, None] - 1 + torch.arange(R, device=device)).clamp(max=L - 1)  # (B, R)
    return Batch(
        input_ids,
        attention_mask,
        positions,
        rollout.response_ids.to(device),
        mask.to(device),
        rollout.logprobs.to(device),
    )


def response_hidden(model, batch: Batch) -> Tensor:
    """Last hidden states at the positions that predict the response tokens: (B, R, H), in the
    autocast dtype under autocast (the fused ops accumulate in fp32 whatever it is)."""
    hidden = sharding.last_hidden_state(model, batch.input_ids, batch.attention_mask)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the final norm hands back fp32: the LM head computes in bf16 too
        hidden = hidden.to(torch.get_autocast_dtype(device))
    return hidden.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def response_values(critic, batch: Batch) -> Tensor:
    """The critic's values at the positions that predict the response tokens: (B, R) fp32."""
    return critic(batch.input_ids, batch.attention_mask).gather(1, batch.positions).float()


def head_params(model, like: Tensor) -> tuple:
    """The LM head's weight and bias in the dtype of the hidden states (bf16 under autocast)."""
    head = model.get_output_embeddings()
    bias = None if head.bias is None else head.bias.to(like.dtype)
    return head.weight.to(like.dtype), bias


def response_labels(batch: Batch) -> Tensor:
    """The response tokens as labels, ``IGNORE_INDEX`` where masked: (B, R)."""
    return batch.response_ids.masked_fill(~batch.mask, IGNORE_INDEX)


def response_logprobs(model, batch: Batch, temperature: float) -> Tensor:
    """The response tokens' log-probs under ``model`` at ``temperature``: (B, R) fp32."""
    hidden = response_hidden(model, batch)
    weight, bias = head_params(model, hidden)
    return token_logprobs_from_hidden(hidden, weight, response_labels(batch), bias=bias, temperature=temperature)


@torch.no_grad()
def prepare(batch: Batch, scores: Tensor, models, config, kl_coef: float, group=None) -> Batch:
    """``batch`` with the old log-probs (unless the update computes them: ``old_logprobs_from_update``),
    the reference log-probs, the values, and the advantages and returns of ``config``'s estimator
    for the sequence ``scores`` (B,); whitened over the ranks of ``group`` when the estimator says so."""
    temperature, estimator = config.rollout.temperature, config.estimator
    with models.precision.autocast():
        if not config.old_logprobs_from_update:
            batch.old_logprobs = response_logprobs(models.policy, batch, temperature)
        if models.reference is not None:
            with models.lora.adapters_off() if models.lora is not None else contextlib.nullcontext():
                batch.ref_logprobs = response_logprobs(models.reference, batch, temperature)
        if models.critic is not None:
            batch.values = response_values(models.critic, batch) * batch.mask
    for model in (models.policy, models.reference, models.critic):
        sharding.reshard(model)  # no backward follows these passes to free the gathered roots
    advantages, batch.returns = estimator.advantages(
        scores, batch, config.algo, config.rollout.samples_per_prompt, kl_coef
    )
    batch.advantages = masked_whiten(advantages, batch.mask, group=group) if estimator.whiten else advantages
    return batch


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over valid tokens: how much the critic explains."""
    valid = mask.bool()
    returns, residual = returns[valid].double(), (returns - values)[valid].double()
    if returns.numel() < 2 or returns.var() == 0:
        return float("nan")
    return float(1 - residual.var() / returns.var())
