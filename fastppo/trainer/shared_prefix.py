"""Whether a run's forwards encode each prompt once for its samples (``layout.py``), decided once,
before the first rollout, by asking the models themselves.

The shared layout relies on three things a model may not do: take a custom 4-D attention mask
(SDPA and eager attention do; flash-attn and flex do not), place tokens by ``position_ids``
(rotary and learned positions do; ALiBi and anything that counts positions itself do not), and
use one mask for every layer (a sliding window shorter than a row needs its own per layer). The
first is read from the config, the third from the window lengths; everything else is settled by
a probe: two prompts, three samples, the shared forward against the padded one, in the run's
precision. A model that disagrees trains on padded rows, and the start-up summary says why.
"""

import torch

from ..rollout.lean import windows
from . import sharding
from .batch import Batch, response_hidden, response_values
from .layout import SharedPrefix, key_cost, mask_format_of

# the probe's rows: (prompt, response lengths): units of 12, 5 and 3 tokens, so the second and the
# third share a padded row (block-diagonal), and the first's samples sit at shifted positions
PROBE = ((5, (3, 4)), (3, (2,)), (2, (1,)))


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
def check_shared_prefix(models, enabled: bool, longest_row: int, ranks=None) -> tuple:
    """``(shared, why_not)``: how the models take the shared layout (:class:`SharedPrefix`), or
    None and the reason they run padded rows. ``longest_row``: the most prompt + response tokens of a row."""
    if not enabled:
        return None, "--no-shared-prefix"
    policy, critic = models.policy, models.critic
    for model in (policy, critic and critic.backbone):
        if model is None:
            continue
        config = model.config
        implementation = getattr(config, "_attn_implementation", None)
        if mask_format_of(model) is None:
            return None, f"{type(model).__name__}'s {implementation} attention takes no 4-D mask"
        binding = [w for w in _layer_windows(config) if w is not None and w < longest_row]
        if binding:
            return None, (
                f"its sliding window of {min(binding)} tokens is shorter than the longest row ({longest_row}), "
                "and one mask serves every layer"
            )
    shared = SharedPrefix(mask_format_of(policy), key_cost(policy))
    batch = probe_batch(policy.config.vocab_size, models.device)
    tolerance = 1e-4 if models.precision.compute is None else 3e-2
    forwards = {"policy": lambda layout: response_hidden(policy, layout)}
    if critic is not None:
        forwards["critic"] = lambda layout: response_values(critic, layout)
    why_not = None
    try:
        with models.precision.autocast():
            for name, forward in forwards.items():
                error = _disagreement(forward, batch, SharedPrefix(shared.mask_format, 0.0))
                if not error <= tolerance:  # NaN disagrees too
                    why_not = (
                        f"the {name}'s states with the prompt shared differ from the padded forward's by {error:.1e}"
                    )
                    break
    except (RuntimeError, ValueError, TypeError) as error:  # the model refused the mask or the positions
        why_not = f"the model refused the shared layout ({type(error).__name__}: {str(error).splitlines()[0]})"
    for model in (policy, critic):
        sharding.reshard(model)  # no backward follows the probe to free the gathered roots
    if ranks is not None and ranks.most(int(why_not is not None)):  # every rank lays out alike
        return None, why_not or "another rank's model refused the shared layout"
    return (None, why_not) if why_not else (shared, None)


def _layer_windows(config) -> list:
    try:
        return windows(config)
    except AttributeError:  # a config without num_hidden_layers: no window to read
        return [getattr(config, "sliding_window", None)]
