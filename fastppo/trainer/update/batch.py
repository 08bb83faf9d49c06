"""A rollout laid out for the update, and the forward passes that read it.

A batch holds each row's prompt and response; a forward reads it through a :class:`Layout`
(``row_layout.py``): each prompt encoded once for its samples where the model allows it, padded rows
otherwise. The layout says where the hidden state predicting each response token lands, so the
fused ops from hidden states gather exactly the rows they score and never build full logits.
``prepare`` fills in what the update needs before its first step: the old and reference log-probs
and the values (no-grad passes), then the advantages as the run's estimator (``estimators.py``)
defines them.
"""

import contextlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from ...ops import IGNORE_INDEX, masked_whiten, token_logprobs_from_hidden
from ..parallel import sharding
from .row_layout import Layout, SharedPrefix, groups, microbatches, padded_layout, shared_layout, units

if TYPE_CHECKING:  # for the annotations only
    from ..configuration.config import TrainConfig
    from ..parallel.distributed import Ranks


@dataclass
class Batch:
    """One rollout for the updates: prompt + response per row, right-padded."""

    input_ids: Tensor  # (B, L): prompt then response tokens
    prompt_lens: Tensor  # (B,)
    lens: Tensor  # (B,) response tokens of each row (the loss may mask some: ``mask``)
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

    def layout(self, shared: Optional[SharedPrefix] = None) -> Layout:
        """How a forward reads these rows: each prompt encoded once for its samples as ``shared``
        says, or padded rows (None)."""
        R = self.response_ids.shape[1]
        if shared is None:
            return padded_layout(self.input_ids, self.prompt_lens, self.lens, R)
        return shared_layout(self.input_ids, self.prompt_lens, self.lens, R, shared)

    def groups(self) -> list:
        """The rows grouped by prompt (``layout.groups``)."""
        return groups(self.input_ids, self.prompt_lens.tolist())

    def minibatches(self, count: int, generator: torch.Generator) -> list:
        """The rows in ``count`` random minibatches of equal size (index tensors), the samples of a
        prompt kept together: the prompts are shuffled by ``generator`` (the run's own: a tool or
        reward that seeds torch's global one changes nothing), their rows laid end to end, and the
        order cut into ``count`` pieces (a piece may cut through a prompt's samples)."""
        found = self.groups()
        order = [b for g in torch.randperm(len(found), generator=generator).tolist() for b in found[g]]
        return list(torch.tensor(order, device=self.mask.device).chunk(count))

    def parts(self, max_tokens, shared: Optional[SharedPrefix], at_least: int = 1) -> list:
        """These rows in micro-batches of at most ``max_tokens`` tokens (``layout.microbatches``;
        None: one), as index tensors; with ``shared`` a prompt counts once for each of its units."""
        P, n = self.prompt_lens.tolist(), self.lens.tolist()
        found = [[b] for b in range(len(P))] if shared is None else units(self.input_ids, P, n, shared.key_cost)
        parts = microbatches(P, n, found, max_tokens, at_least)
        return [torch.tensor(rows, device=self.mask.device) for rows in parts]


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
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
    return Batch(
        input_ids.to(device),
        torch.tensor([len(p) for p in rollout.prompt_ids], device=device),
        rollout.response_lens.to(device),
        rollout.response_ids.to(device),
        mask.to(device),
        rollout.logprobs.to(device),
    )


def response_hidden(model, layout: Layout) -> Tensor:
    """Last hidden states at the positions that predict the response tokens: (B, R, H), in the
    autocast dtype under autocast (the fused ops accumulate in fp32 whatever it is)."""
    hidden = sharding.last_hidden_state(model, layout.input_ids, layout.mask_for(model), layout.position_ids)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the final norm hands back fp32: the LM head computes in bf16 too
        hidden = hidden.to(torch.get_autocast_dtype(device))
    return layout.gather(hidden)


def response_values(critic, layout: Layout) -> Tensor:
    """The critic's values at the positions that predict the response tokens: (B, R) fp32."""
    return layout.gather(critic(layout.input_ids, layout.mask_for(critic.backbone), layout.position_ids)).float()


def head_params(model, like: Tensor) -> tuple:
    """The LM head's weight and bias in the dtype of the hidden states (bf16 under autocast)."""
    head = model.get_output_embeddings()
    bias = None if head.bias is None else head.bias.to(like.dtype)
    return head.weight.to(like.dtype), bias


def response_labels(batch: Batch) -> Tensor:
    """The response tokens as labels, ``IGNORE_INDEX`` where masked: (B, R)."""
    return batch.response_ids.masked_fill(~batch.mask, IGNORE_INDEX)


def response_logprobs(model, batch: Batch, layout: Layout, temperature: float) -> Tensor:
    """The response tokens' log-probs under ``model`` at ``temperature``: (B, R) fp32."""
    hidden = response_hidden(model, layout)
    weight, bias = head_params(model, hidden)
    return token_logprobs_from_hidden(hidden, weight, response_labels(batch), bias=bias, temperature=temperature)


def forward_parts(batch: Batch, models, config: "TrainConfig", ranks: Optional["Ranks"] = None) -> list:
    """The micro-batches (index tensors into ``batch``) that its forwards run in; as many on every
    one of ``ranks`` when the models are sharded (each forward gathers with the others)."""
    budget, shared = config.algo.max_tokens_per_microbatch, models.shared_prefix
    parts = batch.parts(budget, shared)
    if models.sharded and ranks is not None and budget is not None:
        most = ranks.most(len(parts))
        if most > len(parts):  # cut again only when another rank runs more
            parts = batch.parts(budget, shared, at_least=most)
    return parts


@torch.no_grad()
def prepare(
    batch: Batch, scores: Tensor, models, config: "TrainConfig", kl_coef: float, ranks: Optional["Ranks"] = None
) -> Batch:
    """``batch`` with the old log-probs (unless the update computes them: ``old_logprobs_from_update``),
    the reference log-probs, the values, and the advantages and returns of ``config``'s estimator
    for the sequence ``scores`` (B,); whitened over ``ranks`` when the estimator says so."""
    temperature, estimator = config.rollout.temperature, config.estimator
    wanted = {
        "old_logprobs": None if config.old_logprobs_from_update else models.policy,
        "ref_logprobs": models.reference,
        "values": models.critic,
    }
    wanted = {name: model for name, model in wanted.items() if model is not None}
    for name in wanted:
        setattr(batch, name, torch.zeros_like(batch.sampler_logprobs))
    for index in forward_parts(batch, models, config, ranks):
        part = batch.rows(index)
        layout = part.layout(models.shared_prefix)
        with models.precision.autocast():
            for name, model in wanted.items():
                lora_off = name == "ref_logprobs" and models.lora is not None
                with models.lora.adapters_off() if lora_off else contextlib.nullcontext():
                    if name == "values":
                        done = response_values(model, layout) * part.mask
                    else:
                        done = response_logprobs(model, part, layout, temperature)
                getattr(batch, name)[index] = done
    for model in (models.policy, models.reference, models.critic):
        sharding.reshard(model)  # no backward follows these passes to free the gathered roots
    advantages, batch.returns = estimator.advantages(
        scores, batch, config.algo, config.rollout.samples_per_prompt, kl_coef
    )
    group = None if ranks is None else ranks.group
    batch.advantages = masked_whiten(advantages, batch.mask, group=group) if estimator.whiten else advantages
    return batch


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over valid tokens: how much the critic explains."""
    valid = mask.bool()
    returns, residual = returns[valid].double(), (returns - values)[valid].double()
    if returns.numel() < 2 or returns.var() == 0:
        return float("nan")
    return float(1 - residual.var() / returns.var())
