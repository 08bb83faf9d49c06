"""The update's attention over shared-prompt units, computing only the pairs their mask allows.

A unit (``row_layout.py``) is a prompt and its samples' responses in one row, under a mask that lets a
response token see the prompt and its own response's earlier tokens. SDPA under such a mask
computes every query against every key of the row and throws most away: with 8 responses of 84
tokens after a 280-token prompt, 72% of the 950 x 950 pairs are masked. Here the same attention
runs as two dense SDPA calls that hold (almost) no masked pair:

* each unit's prompt attends causally to itself (``is_causal``, which SDPA's kernels skip blocks
  for), the units' prompts right-padded into one batch;
* each response's tokens attend to ``[its unit's prompt keys, its own keys]``, the responses
  right-padded into one batch, with a mask that opens the prompt's real keys and its own keys
  causally.

Queries are gathered from the rows in one read, keys and values in two (the prompts', the
responses'; a response's keys are its prompt's, then its own), and each real token's output put
back where its row holds it; autograd carries the gradients back through both (the prompt's keys
receive the sum over their samples, as under the dense mask). A layout pad, which belongs to no
unit, gets a zero output: no real token reads it, and its own state is never scored.

On a 2-core AMD EPYC, SmolLM2-135M's update on its chat workload (2 prompts x 8 samples) ran 1.12x
faster than under the dense mask (``fastppo bench --op trainer_options``, both side by side;
``bench/results/cpu-2cores-2026-12-06-amd-update-attention.md``). :func:`plan_units` builds the
plan only where its padded pairs are clearly fewer than the dense row's (a long-tail response
padding every other would cost more); elsewhere the mask is read densely, as before.

transformers reaches an attention through its ``AttentionInterface`` by the name in the model's
config: :func:`adopt` registers :func:`attend` under ``IMPLEMENTATION`` and points an SDPA model at
it. :func:`attend` takes the split path only for a mask that carries a plan (``with_plan``), and
hands every other call to transformers' own SDPA attention (the probe's padded rows, a generic
sampler's decode), so the model computes as before wherever no plan is given.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

IMPLEMENTATION = "fastppo_units"
PLAN_ATTRIBUTE = "fastppo_unit_plan"  # the attribute of a units' mask that carries its plan
DENSE_SHARE = 0.75  # a plan is used when its padded pairs are under this share of the dense rows'


@dataclass
class UnitPlan:
    """Where each unit's prompt and each response lie in a layout of ``N`` rows of ``L`` tokens,
    as flat indices into ``N * L``: the ``U`` prompts right-padded to ``P`` tokens, the ``S``
    responses to ``Rn``, each pad the index of its prompt's or response's first token."""

    tokens: Tensor  # (U * P + S * Rn,) the prompts' tokens, then the responses'
    response_unit: Tensor  # (S,) the unit whose prompt each response follows
    response_mask: Tensor  # (S, 1, Rn, P + Rn) bool: its unit's real prompt keys, then its own causally
    real: Tensor  # (T,) the real tokens' rows among the padded outputs (U * P prompt rows, then S * Rn)
    scatter: Tensor  # (T,) where each real token lies in the layout
    shape: tuple  # (U, P, S, Rn)


def plan_units(units: list, responses: list, rows: int, length: int, device) -> Optional[UnitPlan]:
    """The plan of a layout of ``rows`` rows of ``length`` tokens: ``units`` ``(start, prompt
    length)`` and ``responses`` ``(start, length, unit)``, each start a flat index. None where
    there is nothing to split or the split would not cost clearly less than the dense rows."""
    responses = [r for r in responses if r[1] > 0]
    if not units or not responses:
        return None
    P, Rn = max(p for _, p in units), max(n for _, n, _ in responses)
    split_pairs = len(units) * P * (P + 1) // 2 + len(responses) * Rn * (P + Rn)
    if split_pairs >= DENSE_SHARE * rows * length * length:
        return None
    pad = torch.arange(max(P, Rn))

    def padded(start: int, n: int, width: int) -> Tensor:
        return start + torch.where(pad[:width] < n, pad[:width], 0)

    prompt_lens = torch.tensor([p for _, p in units])
    response_lens = torch.tensor([n for _, n, _ in responses])
    unit = torch.tensor([u for _, _, u in responses])
    query = torch.arange(Rn)
    own = query[None, :] <= query[:, None]  # (Rn, Rn)
    prompt_keys = torch.arange(P)[None, :] < prompt_lens[unit][:, None]  # (S, P)
    mask = torch.cat((prompt_keys[:, None, :].expand(-1, Rn, -1), own.expand(len(responses), -1, -1)), dim=2)
    real_prompt = (torch.arange(P)[None, :] < prompt_lens[:, None]).flatten()  # (U * P,)
    real_response = (query[None, :] < response_lens[:, None]).flatten()  # (S * Rn,)
    real = torch.cat((real_prompt, real_response)).nonzero().squeeze(1)
    prompts = torch.stack([padded(start, p, P) for start, p in units])  # (U, P)
    answers = torch.stack([padded(start, n, Rn) for start, n, _ in responses])  # (S, Rn)
    tokens = torch.cat((prompts.flatten(), answers.flatten()))
    tensors = (t.to(device) for t in (tokens, unit, mask[:, None], real, tokens[real]))
    return UnitPlan(*tensors, shape=(len(units), P, len(responses), Rn))


def with_plan(mask: Tensor, plan: Optional[UnitPlan]) -> Tensor:
    """``mask`` carrying ``plan`` to :func:`attend` (a view of it: the layout's own tensor stays bare)."""
    if plan is None:
        return mask
    carried = mask.view(mask.shape)
    setattr(carried, PLAN_ATTRIBUTE, plan)
    return carried


def _gather(x: Tensor, index: Tensor, sizes: tuple) -> tuple:
    """``x`` (N, h, L, D) at the flat token indices ``index``, in one read, split into the
    ``(n, m)`` of ``sizes``: a ``(n, h, m, D)`` view each. One ``index_select`` per tensor: its
    backward zero-fills one gradient and adds into it once, where a gather per part by indexing
    (``flat[index]``) zero-fills a gradient per part, adds with ``index_put``'s accumulation and
    sums the parts."""
    flat = x.transpose(1, 2).flatten(0, 1)  # (N * L, h, D)
    parts = flat.index_select(0, index).split([n * m for n, m in sizes])
    return tuple(part.view(n, m, *flat.shape[1:]).transpose(1, 2) for part, (n, m) in zip(parts, sizes))


def split_attention(query: Tensor, key: Tensor, value: Tensor, plan: UnitPlan, scale: Optional[float]) -> Tensor:
    """Attention of ``query`` (N, H, L, D) over ``key``, ``value`` (N, KVH, L, D) as the units'
    mask allows it, by ``plan``: (N, L, H, D), zero at the layout's pads."""
    N, H, L, D = query.shape
    gqa = H != key.shape[1]
    U, P, S, Rn = plan.shape
    parts = ((U, P), (S, Rn))
    prompt_q, response_q = _gather(query, plan.tokens, parts)  # (U, H, P, D), (S, H, Rn, D)
    # the keys and values in two reads: a response's own, copied into its keys below, are then
    # freed, where a view of one read would keep them alive beside the copy until the backward
    prompts, answers = plan.tokens[: U * P], plan.tokens[U * P :]
    # (U, KVH, P, D) and (S, KVH, Rn, D) each
    prompt_k, own_k = _gather(key, prompts, parts[:1]) + _gather(key, answers, parts[1:])
    prompt_v, own_v = _gather(value, prompts, parts[:1]) + _gather(value, answers, parts[1:])
    # (S, KVH, P + Rn, D): each response's prompt, then its own. A prompt key's gradient is its
    # samples' parts summed, then its prompt's added: fp32 sums depend on the grouping, and gathering
    # a response's keys straight from the rows (a few percent faster a layer) added the samples'
    # parts one by one onto the prompt's, which moved the default run's trained figures.
    keys = torch.cat((prompt_k.index_select(0, plan.response_unit), own_k), dim=2)
    values = torch.cat((prompt_v.index_select(0, plan.response_unit), own_v), dim=2)
    prompt_out = F.scaled_dot_product_attention(
        prompt_q, prompt_k, prompt_v, is_causal=True, scale=scale, enable_gqa=gqa
    )  # (U, H, P, D)
    response_out = F.scaled_dot_product_attention(
        response_q, keys, values, attn_mask=plan.response_mask, scale=scale, enable_gqa=gqa
    )  # (S, H, Rn, D)
    outputs = torch.cat((prompt_out.transpose(1, 2).flatten(0, 1), response_out.transpose(1, 2).flatten(0, 1)))
    out = query.new_zeros(N * L, H, D).index_copy(0, plan.scatter, outputs.index_select(0, plan.real))
    return out.view(N, L, H, D)


def attend(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: the split path for a mask with a plan (no dropout, no
    soft cap, no sinks), transformers' SDPA attention for anything else."""
    plan = getattr(attention_mask, PLAN_ATTRIBUTE, None)
    plain = dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    if plan is None or not plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return split_attention(query, key, value, plan, scaling), None


def adopt(model) -> bool:
    """Point ``model``'s SDPA attention at :func:`attend` (registered with transformers once);
    False, and nothing changed, where its attention is another or this transformers has no
    attention registry (before 4.53)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
    except ImportError:
        return False
    if IMPLEMENTATION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(IMPLEMENTATION, attend)
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # its 2-D masks made as SDPA's are
    model.config._attn_implementation = IMPLEMENTATION
    return True


def release(model) -> None:
    """Point ``model`` back at transformers' SDPA attention where :func:`adopt` moved it."""
    if getattr(model.config, "_attn_implementation", None) == IMPLEMENTATION:
        model.config._attn_implementation = "sdpa"
