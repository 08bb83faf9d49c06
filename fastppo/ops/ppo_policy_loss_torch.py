"""PyTorch twin of ``fastppo.kernels.ppo_policy_loss``: the CPU path, with the same launcher signature.

It walks the tokens in chunks of ``CHUNK`` (as the kernel's programs do), each chunk writing one
row of partial sums: whole-batch temporaries of a few million tokens would be fresh pages on
every call, and measured twice as slow on a CPU. See the kernel's docstring for the math.
"""

import torch

from ..kernels.contract import PARTIALS, LossTerms
from .kl import kl_penalty

# Tokens per chunk: 512 KiB per fp32 temporary, cache-sized (2**16 to 2**18 measured best).
CHUNK = 1 << 17


def num_programs(N: int) -> int:
    """Rows of partials this implementation writes: one per chunk."""
    return max(1, -(-N // CHUNK))


def _kl_slope(d: torch.Tensor, kl_estimator: int) -> torch.Tensor:
    """d kl / d logp for the estimators of :func:`fastppo.kl_penalty` (k3 clamps d to [-20, 20])."""
    if kl_estimator == 1:
        return torch.ones_like(d)
    if kl_estimator == 2:
        return d
    in_range = (d >= -20.0) & (d <= 20.0)
    return torch.where(in_range, 1.0 - torch.exp(-d.clamp(-20.0, 20.0)), 0.0)


def ppo_loss_forward(logprobs, old_logprobs, advantages, weights, valid, ref_logprobs, entropy, terms, grad, partials):
    """The launcher ``kernels/contract.py`` declares: one row of PARTIALS per chunk of ``CHUNK`` tokens."""
    tokens = (logprobs, old_logprobs, advantages, weights, valid, ref_logprobs, entropy)
    for row, start in enumerate(range(0, logprobs.numel(), CHUNK)):
        part = slice(start, start + CHUNK)
        _chunk_forward(*(None if x is None else x[part] for x in tokens), terms, grad[part], partials[row])


def _chunk_forward(
    logprobs, old_logprobs, advantages, weights, valid, ref_logprobs, entropy, terms: LossTerms, grad, partials_row
):
    def safe(x):  # masked tokens may hold -inf or NaN: replace them before any arithmetic
        return torch.where(valid, x.float(), 0.0)

    logp, old, adv = safe(logprobs), safe(old_logprobs), safe(advantages)
    raw = logp - old
    lr = raw.clamp(-20.0, 20.0)
    ratio = lr.exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - terms.clip_low, 1.0 + terms.clip_high)
    clipped = pg2 > pg1  # the ratio is outside the clip range: no gradient
    pg = torch.where(clipped, pg2, pg1)
    slope = torch.where(clipped | (raw < -20.0) | (raw > 20.0), 0.0, pg1)  # d(-A exp(lr))/dlogp
    dual_on = torch.zeros_like(valid)
    if terms.dual_clip > 0:
        bound = -adv * terms.dual_clip
        dual_on = (adv < 0) & (bound < pg)
        pg = torch.where(dual_on, bound, pg)
        slope = torch.where(dual_on, 0.0, slope)
    kl = torch.zeros_like(pg)
    if ref_logprobs is not None:
        ref = safe(ref_logprobs)
        kl = kl_penalty(logp, ref, f"k{terms.kl_estimator}")
        slope = slope + terms.kl_coef * _kl_slope(logp - ref, terms.kl_estimator)
    grad.copy_(weights * slope)

    ent = safe(entropy) if entropy is not None else torch.zeros_like(pg)
    m = valid.float()
    sums = {
        "pg": (weights * pg).sum(),
        "kl": (weights * kl).sum(),
        "entropy": (weights * ent).sum(),
        "clipped": (valid & clipped).sum(),
        "half_lr_sq": (m * 0.5 * lr * lr).sum(),
        "ratio": (m * ratio).sum(),
        "ratio_max": (m * ratio).max(),
        "dual_clipped": dual_on.sum(),
        "count": m.sum(),
    }
    partials_row.copy_(torch.stack([sums[name].float() for name in PARTIALS]))
