"""How a batch's rows go through a model: each prompt encoded once for all its samples, or one
padded row per sample.

**Shared prefix** (the idea of Prefix Grouper, Liu et al., 2025, arXiv 2506.05433). The rows that
share a prompt become one *unit*: the prompt, then each response in turn. Position ids restart at
the prompt's end for every response, and a 4-D attention mask lets a response token see the prompt
and its own response's earlier tokens, nothing else. So every token sees exactly the keys, at
exactly the positions, that it sees in its own padded row: its hidden state is the unshared
forward's, and the prompt's hidden states receive the sum of their samples' gradients, as the
unshared forward gives them. In GRPO with 8 samples of a 200-token prompt and 40-token answers,
a group is 520 tokens instead of 8 padded rows of 200 + the longest answer.

Under the mask alone a unit's attention is dense (every query against every key of its row), so a
group whose responses are long is cut into smaller units, each with its prompt, where that costs
less: a token costs 1 and a query-key pair ``key_cost`` (``2 hidden / parameters per block``: the
attention's multiply-adds per key over the block's per token), and each group takes the cut that
costs least (one unit, one per sample, or between). Short answers to long prompts share whole;
long answers to short prompts are one row each, packed without padding. A model on SDPA attends
through ``unit_attention.py`` instead, which skips the pairs the mask forbids where its plan
(``Layout.plan``) says that costs clearly less.

Units are packed first-fit, longest first, into rows as long as the longest unit (block-diagonal
in the mask), so short groups fill the room long ones leave, and attention never spans more than
the longest unit. A pad token attends to itself alone: a query with no key at all gives NaN
through the softmax, and NaN times a zero gradient poisons the backward.

Each model reads the mask in its own form (``model_mask``): its attention's format (bool for
SDPA, additive for eager), and for a model with sliding windows (``windows.py``) a key outside a
query's window masked, by positions, as its padded row would window it; a model whose layers'
windows differ gets one mask per layer type, as transformers' ``causal_mask_mapping``. So a policy
and a critic of different attention implementations or windows share one layout.

**Padded** rows are the fallback, for models that cannot take the mask (``check_shared_prefix``).

**Micro-batches by tokens** (``microbatches``): a minibatch split into parts of at most
``max_tokens`` laid-out tokens, units kept whole when they fit, rows of similar length together.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from ...windows import FULL, SLIDING, UnknownWindows, layer_windows
from .unit_attention import IMPLEMENTATION, UnitPlan, plan_units, with_plan


@dataclass
class SharedPrefix:
    """How a run's forwards share a prompt: the cost of an attended key in tokens (``key_cost``),
    which decides how a group is cut into units."""

    key_cost: float


@dataclass
class Layout:
    """What one forward reads: ``N`` model rows of ``L`` tokens, and where each response token's
    predicting hidden state lands."""

    input_ids: Tensor  # (N, L)
    attention_mask: Tensor  # (N, L) 0/1 for padded rows; (N, L, L) bool, query x key, for units
    position_ids: Optional[Tensor]  # (N, L); None: each row counts from 0 (padded rows)
    index: Tensor  # (B, R) flat index into (N * L): the state that predicts each response token
    plan: Optional[UnitPlan] = None  # the units' attention split by their mask (``unit_attention.py``)

    def mask_for(self, model) -> Union[Tensor, dict]:
        """The attention mask ``model`` reads: padded rows' own, or the units' in its form (``model_mask``)."""
        if self.position_ids is None:
            return self.attention_mask
        return model_mask(model, self.attention_mask, self.position_ids, self.plan)

    def gather(self, states: Tensor) -> Tensor:
        """``(N, L, ...) -> (B, R, ...)``: the states at ``index``."""
        return states.flatten(0, 1)[self.index]

    @property
    def tokens(self) -> int:
        """The token slots the forward computes, padding included."""
        return self.input_ids.numel()


def padded_layout(input_ids: Tensor, prompt_lens: Tensor, lens: Tensor, R: int) -> Layout:
    """Row ``b`` is its prompt and response, right-padded to the longest of these rows (not of the
    whole batch they were taken from)."""
    L = int((prompt_lens + lens).max())
    B = input_ids.shape[0]
    columns = torch.arange(L, device=input_ids.device)
    attention_mask = (columns < (prompt_lens + lens)[:, None]).long()  # (B, L)
    positions = (prompt_lens[:, None] - 1 + torch.arange(R, device=input_ids.device)).clamp(max=L - 1)  # (B, R)
    index = torch.arange(B, device=input_ids.device)[:, None] * L + positions
    return Layout(input_ids[:, :L], attention_mask, None, index)


def groups(input_ids: Tensor, prompt_lens: list) -> list:
    """The rows grouped by prompt (its token ids), each group in row order; groups in order of
    their first row."""
    found = {}
    for b, (row, P) in enumerate(zip(input_ids.tolist(), prompt_lens)):
        found.setdefault(tuple(row[:P]), []).append(b)
    return list(found.values())


def units(input_ids: Tensor, prompt_lens: list, lens: list, key_cost: float) -> list:
    """The rows of each prompt in the units that cost least to encode (see the module): each a
    list of consecutive samples of one prompt."""
    out = []
    for group in groups(input_ids, prompt_lens):
        p, best = prompt_lens[group[0]], None
        for m in range(1, len(group) + 1):
            pieces = [group[i * len(group) // m : (i + 1) * len(group) // m] for i in range(m)]
            sizes = [p + sum(lens[b] for b in piece) for piece in pieces]
            cost = sum(size + key_cost * size * size for size in sizes)
            if best is None or cost < best[0]:
                best = (cost, pieces)
        out += best[1]
    return out


def _first_fit(sizes: list) -> list:
    """Indices of ``sizes`` in bins as large as the largest, first-fit, largest first."""
    bins, room = [], []
    capacity = max(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        fit = next((j for j, r in enumerate(room) if r >= sizes[i]), None)
        if fit is None:
            bins.append([i])
            room.append(capacity - sizes[i])
        else:
            bins[fit].append(i)
            room[fit] -= sizes[i]
    return bins


def shared_layout(input_ids: Tensor, prompt_lens: Tensor, lens: Tensor, R: int, shared: SharedPrefix) -> Layout:
    """The units of these rows (``units``) packed into model rows, the mask in the format the
    models take (``check_shared_prefix``); each model reads the mask through ``Layout.mask_for``."""
    device = input_ids.device
    P, n = prompt_lens.tolist(), lens.tolist()
    found = units(input_ids, P, n, shared.key_cost)
    sizes = [P[g[0]] + sum(n[b] for b in g) for g in found]
    packed = [[found[u] for u in bin_] for bin_ in _first_fit(sizes)]
    N, L = len(packed), max(sizes)
    cpu_ids = input_ids.cpu()
    ids = torch.zeros(N, L, dtype=torch.long)
    positions = torch.zeros(N, L, dtype=torch.long)
    unit = -1 - torch.arange(L).repeat(N, 1)  # (N, L): a pad is a unit of its own
    sample = torch.full((N, L), -2)  # (N, L): -1 on prompts, the row b on its response
    index = torch.zeros(len(P), R, dtype=torch.long)  # (B, R)
    prompts, responses = [], []  # (flat start, length) of each unit's prompt; (flat start, length, unit)
    for r, row in enumerate(packed):
        at = 0
        for u, group in enumerate(row):
            p = P[group[0]]
            prompts.append((r * L + at, p))
            ids[r, at : at + p] = cpu_ids[group[0], :p]
            positions[r, at : at + p] = torch.arange(p)
            unit[r, at : at + p + sum(n[b] for b in group)] = u
            sample[r, at : at + p] = -1
            last = r * L + at + p - 1  # the prompt's last token predicts every response's first
            at += p
            for b in group:
                responses.append((r * L + at, n[b], len(prompts) - 1))
                ids[r, at : at + n[b]] = cpu_ids[b, p : p + n[b]]
                positions[r, at : at + n[b]] = torch.arange(p, p + n[b])
                sample[r, at : at + n[b]] = b
                index[b] = last  # past the response's end: a masked token, any real state serves
                scored = min(n[b], R)  # a batch cut to fewer columns scores fewer tokens
                index[b, 1:scored] = r * L + at + torch.arange(max(scored - 1, 0))
                at += n[b]
    column = torch.arange(L)
    allowed = (
        (unit[:, :, None] == unit[:, None, :])
        & (column[None, None, :] <= column[None, :, None])
        & ((sample[:, None, :] == -1) | (sample[:, None, :] == sample[:, :, None]))
    )  # (N, L, L): query, key
    plan = plan_units(prompts, responses, N, L, device)
    return Layout(ids.to(device), allowed.to(device), positions.to(device), index.to(device), plan)


def microbatches(prompt_lens: list, lens: list, groups: list, max_tokens: Optional[int], at_least: int = 1) -> list:
    """A minibatch's rows (``groups``: its units, each a list of rows) split into parts of at most
    ``max_tokens`` prompt + response tokens (None: one part), each a list of rows; longest units
    first, so a part's units are of similar length. A unit longer than the budget is split into
    smaller units of the same prompt (each encodes the prompt again); a row longer than the budget
    is a part of its own. Then the part of most rows is halved until there are ``at_least`` parts
    (sharded ranks must run as many forwards as each other)."""
    parts = (
        [[b for g in groups for b in g]] if max_tokens is None else _by_tokens(prompt_lens, lens, groups, max_tokens)
    )
    while len(parts) < at_least:
        most = max(range(len(parts)), key=lambda i: len(parts[i]))
        if len(parts[most]) < 2:
            raise ValueError(f"{sum(map(len, parts))} rows cannot make {at_least} micro-batches")
        half = len(parts[most]) // 2
        parts[most : most + 1] = [parts[most][:half], parts[most][half:]]
    return parts


def _by_tokens(prompt_lens: list, lens: list, groups: list, max_tokens: int) -> list:
    pieces = []
    for group in groups:
        p, piece = prompt_lens[group[0]], []
        for b in group:
            if piece and p + sum(lens[i] for i in piece) + lens[b] > max_tokens:
                pieces.append(piece)
                piece = []
            piece.append(b)
        pieces.append(piece)
    sized = sorted(((prompt_lens[g[0]] + sum(lens[b] for b in g), g) for g in pieces), key=lambda s: -s[0])
    parts, part, used = [], [], 0
    for size, piece in sized:
        if part and used + size > max_tokens:
            parts.append(part)
            part, used = [], 0
        part += piece
        used += size
    return parts + [part]


def key_cost(model) -> float:
    """The cost of one attended key in tokens: ``2 hidden`` multiply-adds (scores and values over
    all heads) over the multiply-adds of one token through a block (its parameters)."""
    config = model.config
    tables = {
        id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m
    }
    embeddings = sum(tables.values())  # a tied LM head is the embedding table, counted once
    layers = getattr(config, "num_hidden_layers", None) or 1
    per_block = max(sum(p.numel() for p in model.parameters()) - embeddings, 1) / layers
    return 2 * config.hidden_size / per_block


def model_mask(model, allowed: Tensor, positions: Tensor, plan: Optional[UnitPlan] = None) -> Union[Tensor, dict]:
    """``allowed`` (N, L, L) in ``model``'s form: windowed where its layers window (a key at
    position ``k`` outside ``q - w < k <= q`` masked, as in its padded row), in its attention's
    format (``mask_format_of``), with a head axis: (N, 1, L, L); one per layer type (a dict, as
    transformers' ``causal_mask_mapping``) when only some layers' windows bind these rows. A
    model on the units' attention (``unit_attention.adopt``) gets ``plan`` with a mask no window
    binds (a bound window is the dense mask's to apply)."""
    config, form = model.config, mask_format_of(model)
    if getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
        plan = None
    windows = layer_windows(config)
    if all(w is None for w in windows):  # no window: nothing to read from the positions
        return with_plan(form(allowed[:, None]), plan)
    span = int(positions.max()) + 1
    refusal = mask_refusal(config, span)
    if refusal:
        raise ValueError(f"{type(model).__name__}: {refusal}")
    binding = {w for w in windows if w is not None and w < span}
    if not binding:
        return with_plan(form(allowed[:, None]), plan)
    near = positions[:, None, :] - positions[:, :, None]  # (N, L, L): key position - query position
    windowed = form((allowed & (near > -min(binding)))[:, None])  # one binding width: mask_refusal
    if len(set(windows)) == 1:
        return windowed
    return {FULL: form(allowed[:, None]), SLIDING: windowed}  # layer types: mask_refusal


def mask_refusal(model_config, span: int) -> Optional[str]:
    """Why a model of ``model_config`` cannot take the units' masks on rows of up to ``span`` positions
    (``model_mask``), or None. A model whose windows cannot be read is taken as windowed."""
    try:
        windows = layer_windows(model_config)
    except UnknownWindows as unknown:
        return f"{unknown}, and a mask of shared prompts cannot be windowed for it"
    binding = sorted({w for w in windows if w is not None and w < span})
    if len(set(windows)) > 1 and binding and not getattr(model_config, "layer_types", None):
        return (
            f"its layers' sliding windows ({binding[0]} tokens shorter than its rows of up to {span}) differ from "
            "layer to layer, and its forward takes one mask for every layer"
        )
    return None


def mask_format_of(model) -> Optional[Callable]:
    """How ``model``'s attention takes a custom 4-D mask: bool for SDPA, additive (0 or the most
    negative float) for eager; None for implementations that take none (flash-attn, flex)."""
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation in ("sdpa", IMPLEMENTATION):
        return lambda allowed: allowed
    if implementation == "eager":
        return lambda allowed: torch.zeros(allowed.shape, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        )
    return None
