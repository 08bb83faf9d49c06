"""Triton kernel for the PPO clipped policy loss over token tensors: one launch, one read.

Per valid token, with ``A`` the advantage and every quantity in fp32::

    lr    = clamp(logp - old_logp, -20, 20),   ratio = exp(lr)
    pg    = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
    pg    = min(pg, -A * dual_clip)                        where A < 0, with dual clipping
    kl    = k1 | k2 | k3 of d = logp - ref_logp             with a reference

The aggregation (token mean, sequence mean, ...) is a weight per token, ``w``, computed from the
mask beforehand, so the loss is ``sum w * (pg + kl_coef * kl - entropy_coef * entropy)`` and its
gradient with respect to ``logp`` is known token by token in the forward. The kernel writes that
gradient (the backward only scales it by the upstream scalar) and, per program, the partial sums
the loss and the statistics need. Summing the partials is a tiny deterministic reduction; no
atomics, so results are bitwise reproducible.

Masked tokens may hold anything (padding log-probs of -inf, say): every input is replaced by a
harmless value before use, so they contribute exactly 0 and never a NaN. A NaN at a valid token
stays NaN through every clamp (``propagate_nan``), so it shows in the loss.
"""

import triton
import triton.language as tl

from .contract import PARTIALS

# The partials' row width and column of each sum, from the one definition of their layout.
_WIDTH = tl.constexpr(len(PARTIALS))
_PG, _KL, _ENTROPY, _CLIPPED, _HALF_LR_SQ, _RATIO, _RATIO_MAX, _DUAL_CLIPPED, _COUNT = (
    tl.constexpr(PARTIALS.index(name))
    for name in ("pg", "kl", "entropy", "clipped", "half_lr_sq", "ratio", "ratio_max", "dual_clipped", "count")
)


@triton.jit
def _clamp20(x):
    # clamp to [-20, 20] keeping NaN: the hardware min/max would turn a NaN into a bound
    return tl.minimum(tl.maximum(x, -20.0, propagate_nan=tl.PropagateNan.ALL), 20.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _ppo_loss_fwd_kernel(
    logp_ptr,
    old_ptr,
    adv_ptr,
    weight_ptr,
    valid_ptr,
    ref_ptr,
    ent_ptr,
    grad_ptr,
    partials_ptr,
    N,
    clip_low,
    clip_high,
    dual_clip,
    kl_coef,
    HAS_REF: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    DUAL_CLIP: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    # Every load is masked by the bounds alone, so each is a few wide vector loads issued together,
    # before any arithmetic; masking by the loaded `valid` instead would make each load wait for
    # it and split into scalar loads. What masked tokens hold (anything) is replaced right after.
    inside = offs < N
    valid = tl.load(valid_ptr + offs, mask=inside, other=0) != 0
    logp = tl.load(logp_ptr + offs, mask=inside, other=0.0)
    old = tl.load(old_ptr + offs, mask=inside, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=inside, other=0.0)
    w = tl.load(weight_ptr + offs, mask=inside, other=0.0)
    if HAS_REF:
        ref = tl.load(ref_ptr + offs, mask=inside, other=0.0)
    if HAS_ENTROPY:
        ent = tl.load(ent_ptr + offs, mask=inside, other=0.0)
    m = valid.to(tl.float32)
    logp = tl.where(valid, logp.to(tl.float32), 0.0)
    old = tl.where(valid, old.to(tl.float32), 0.0)
    adv = tl.where(valid, adv.to(tl.float32), 0.0)
    w = tl.where(valid, w, 0.0)

    raw = logp - old
    lr = _clamp20(raw)
    ratio = tl.exp(lr)
    pg1 = -adv * ratio
    pg2 = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    clipped = pg2 > pg1  # then the ratio is outside the clip range: no gradient
    pg = tl.where(clipped, pg2, pg1)
    dpg = tl.where(clipped | (raw < -20.0) | (raw > 20.0), 0.0, pg1)  # d(-A * exp(lr))/dlogp = pg1
    dual_clipped = 0.0
    if DUAL_CLIP:
        bound = -adv * dual_clip
        dual_on = (adv < 0) & (bound < pg)
        pg = tl.where(dual_on, bound, pg)
        dpg = tl.where(dual_on, 0.0, dpg)
        dual_clipped = tl.sum(dual_on.to(tl.float32))

    grad = dpg
    kl = tl.zeros_like(pg)
    if HAS_REF:
        d = logp - tl.where(valid, ref.to(tl.float32), 0.0)
        if KL_ESTIMATOR == 1:
            kl = d
            dkl = tl.full(d.shape, 1.0, tl.float32)
        elif KL_ESTIMATOR == 2:
            kl = 0.5 * d * d
            dkl = d
        else:
            dc = _clamp20(d)
            kl = tl.exp(-dc) + dc - 1.0
            dkl = tl.where((d < -20.0) | (d > 20.0), 0.0, 1.0 - tl.exp(-dc))
        grad += kl_coef * dkl
    tl.store(grad_ptr + offs, w * grad, mask=inside)

    entropy = tl.zeros_like(pg)
    if HAS_ENTROPY:
        entropy = tl.where(valid, ent.to(tl.float32), 0.0)
    row = partials_ptr + pid * _WIDTH  # one row of PARTIALS per program
    tl.store(row + _PG, tl.sum(w * pg))
    tl.store(row + _KL, tl.sum(w * kl))
    tl.store(row + _ENTROPY, tl.sum(w * entropy))
    tl.store(row + _CLIPPED, tl.sum((valid & clipped).to(tl.float32)))
    tl.store(row + _HALF_LR_SQ, tl.sum(m * 0.5 * lr * lr))
    tl.store(row + _RATIO, tl.sum(m * ratio))
    ratio_max = tl.max(m * ratio)  # a max reduction drops NaN: put it back
    tl.store(row + _RATIO_MAX, tl.where(tl.sum((ratio != ratio).to(tl.int32)) > 0, float("nan"), ratio_max))
    tl.store(row + _DUAL_CLIPPED, dual_clipped)
    tl.store(row + _COUNT, tl.sum(m))


# One warp per program: the nine partial sums reduce with warp shuffles alone, no shared memory and
# no barrier, and 8 tokens per thread keep a program's loads to 13 vector loads issued together.
# Against 4 warps x 1024 tokens (the same loads) a program's replayed latency is 4,400 cycles
# instead of 7,400, and an SM holds 18 programs instead of 5 (``fastppo bench --sass``).
_BLOCK, _WARPS = 256, 1


def num_programs(N: int) -> int:
    """Rows of the partials tensor ``ppo_loss_forward`` needs for N tokens."""
    return max(1, triton.cdiv(N, _BLOCK))


def ppo_loss_forward(logprobs, old_logprobs, advantages, weights, valid, ref_logprobs, entropy, terms, grad, partials):
    """The launcher ``kernels/contract.py`` declares: one one-warp program per ``_BLOCK`` tokens."""
    N = logprobs.numel()
    if N == 0:
        return
    tokens = (logprobs, old_logprobs, advantages, weights, valid, ref_logprobs, entropy)
    _ppo_loss_fwd_kernel[(num_programs(N),)](
        *tokens,
        grad,
        partials,
        N,
        terms.clip_low,
        terms.clip_high,
        terms.dual_clip,
        terms.kl_coef,
        HAS_REF=ref_logprobs is not None,
        HAS_ENTROPY=entropy is not None,
        DUAL_CLIP=terms.dual_clip > 0,
        KL_ESTIMATOR=terms.kl_estimator,
        BLOCK=_BLOCK,
        num_warps=_WARPS,
    )
