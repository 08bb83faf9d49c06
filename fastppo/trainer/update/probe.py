"""Whether a run's forwards encode each prompt once for its samples (``row_layout.py``), decided once,
before the first rollout, by asking the models themselves.

The shared layout relies on three things a model may not do: take a custom 4-D attention mask
(SDPA and eager attention do; flash-attn and flex do not), place tokens by ``position_ids``
(rotary and learned positions do; ALiBi and anything that counts positions itself do not), and
window its layers as ``windows.py`` reads them from its config (transformers applies no window
of its own under a custom mask, so the units' masks carry it: ``layout.model_mask``). The mask
and the windows are read from each model's config; everything else is settled by a probe: two
prompts, three samples, the shared forward against the padded one, in the run's precision, for
the policy and the critic each. Its rows span at most 9 positions, fewer than any real window,
so for the probe the config's ``sliding_window`` is narrowed to ``PROBE_WINDOW`` (each window of
a list), which the padded forward's own masks and the units' read alike. It is narrowed whatever
``windows.py`` reads of it (a flag that says off included): a window the units' masks get wrong,
or one the model applies where ``windows.py`` sees none, shows as a disagreement. A model that
disagrees trains on padded rows, and the start-up summary says why, naming it.
"""

import contextlib
from typing import TYPE_CHECKING, Optional

import torch

from ..parallel import sharding
from . import unit_attention
from .batch import Batch, response_hidden, response_values
from .row_layout import SharedPrefix, key_cost, mask_format_of, mask_refusal

if TYPE_CHECKING:  # for the annotations only
    from ..parallel.distributed import Ranks

# the probe's rows: (prompt, response lengths): units of 12, 5 and 3 tokens, so the second and the
# third share a padded row (block-diagonal), and the first's samples sit at shifted positions
PROBE = ((5, (3, 4)), (3, (2,)), (2, (1,)))
PROBE_WINDOW = 3  # the probe's windows: shorter than its rows, so that every windowed layer binds


def probe_batch(vocab: int, device) -> Batch:
    """Rows of ``PROBE`` with random tokens, as the update lays them out."""
    generator = torch.Generator().manual_seed(0)
    rows, prompt_lens, lens = [], [], []
    for p, responses in PROBE:
        prompt = torch.randint(vocab, (p,), generator=generator)
        for n in responses:
            rows.append(torch.cat([prompt, torch.randint(vocab, (n,), generator=generator)]))
            prompt_lens.append(p)
            lens.append(n)
    L, R = max(map(len, rows)), max(lens)
    input_ids = torch.stack([torch.cat([r, r.new_zeros(L - len(r))]) for r in rows])
    lens = torch.tensor(lens)
    mask = torch.arange(R) < lens[:, None]
    return Batch(
        input_ids.to(device),
        torch.tensor(prompt_lens, device=device),
        lens.to(device),
        torch.zeros(len(rows), R, dtype=torch.long, device=device),
        mask.to(device),
        torch.zeros(len(rows), R, device=device),
    )


def _disagreement(forward, batch: Batch, shared: SharedPrefix) -> float:
    """How far ``forward``'s states at the valid response positions, shared, are from the padded
    ones: the largest difference at one position over the mean size of a position's state."""
    T = int(batch.mask.sum())
    shared, padded = (forward(batch.layout(f)).float()[batch.mask].reshape(T, -1) for f in (shared, None))
    return float((shared - padded).norm(dim=1).max() / padded.norm(dim=1).mean().clamp(min=1e-30))


@torch.no_grad()
def check_shared_prefix(models, enabled: bool, longest_row: int, ranks: Optional["Ranks"] = None) -> tuple:
    """``(shared, why_not)``: how the models take the shared layout (:class:`SharedPrefix`), or
    None and the reason they run padded rows. ``longest_row``: the most prompt + response tokens of a row."""
    if not enabled:
        return None, "--no-shared-prefix"
    policy, critic = models.policy, models.critic
    backbones = {"policy": policy, "critic": critic and critic.backbone}
    for name, model in backbones.items():
        if model is None:
            continue
        if mask_format_of(model) is None:
            implementation = getattr(model.config, "_attn_implementation", None)
            return None, f"the {name}'s {implementation} attention takes no 4-D mask"
        refusal = mask_refusal(model.config, longest_row)
        if refusal:
            return None, f"the {name} ({model.config.model_type}): {refusal}"
    adopted = [model for model in backbones.values() if model is not None and unit_attention.adopt(model)]
    why_not = _probe(models, backbones)
    if why_not is not None and adopted:  # the units' attention disagrees: the dense mask, as before
        for model in adopted:
            unit_attention.release(model)
        why_not = _probe(models, backbones)
    elif adopted and getattr(models, "reference", None) is not None:  # a frozen copy of the policy, alike
        unit_attention.adopt(models.reference)
    if ranks is not None and ranks.most(int(why_not is not None)):  # every rank lays out alike
        return None, why_not or "another rank's model refused the shared layout"
    return (None, why_not) if why_not else (SharedPrefix(key_cost(policy)), None)


def _probe(models, backbones: dict) -> Optional[str]:
    """Why the models' shared forwards disagree with their padded ones on ``probe_batch``, or None."""
    policy, critic = models.policy, models.critic
    batch = probe_batch(policy.config.vocab_size, models.device)
    tolerance = 1e-4 if models.precision.compute is None else 3e-2
    forwards = {"policy": lambda layout: response_hidden(policy, layout)}
    if critic is not None:
        forwards["critic"] = lambda layout: response_values(critic, layout)
    why_not = None
    for name, forward in forwards.items():
        try:
            with models.precision.autocast(), narrowed_windows(backbones[name].config):
                error = _disagreement(forward, batch, SharedPrefix(key_cost=0.0))
        except (RuntimeError, ValueError, TypeError, KeyError) as refused:  # the mask or the positions
            why_not = f"the {name} refused the shared layout ({type(refused).__name__}: {str(refused).splitlines()[0]})"
            break
        if not error <= tolerance:  # NaN disagrees too
            why_not = f"the {name}'s states with the prompt shared differ from the padded forward's by {error:.1e}"
            break
    for model in (policy, critic):
        sharding.reshard(model)  # no backward follows the probe to free the gathered roots
    return why_not


def _narrowed(window):
    """A ``sliding_window`` value narrowed to ``PROBE_WINDOW``: a positive int, or each of a list's;
    anything else (None, 0: no window) as it is."""
    if isinstance(window, (list, tuple)):
        return type(window)(_narrowed(w) for w in window)
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return min(window, PROBE_WINDOW)
    return window


@contextlib.contextmanager
def narrowed_windows(model_config):
    """``model_config``'s ``sliding_window`` narrowed to ``PROBE_WINDOW`` while the block runs, then
    restored; a config without one is left as it is."""
    if not hasattr(model_config, "sliding_window"):
        yield
        return
    window = model_config.sliding_window
    model_config.sliding_window = _narrowed(window)
    try:
        yield
    finally:
        model_config.sliding_window = window
