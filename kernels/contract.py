"""What each kernel family's Triton module (``kernels/<family>.py``) and its PyTorch twin
(``fastppo/ops/<family>_torch.py``) agree on, declared once, in a module that imports no triton (the
twins run where triton is not installed): the launchers both define, each with one signature, so an
op calls whichever ``dispatch.implementation`` hands it; the argument types they take; and the
memory layouts both write.

Launchers take tensors and write outputs: no autograd, no checks, no policy about shapes or dtypes
(the ops do that). A Triton launcher may add keyword-only tuning arguments with defaults (tile
sizes, splits), which tests and the sm_90 compile study pass and the ops never do; nothing else may
differ. ``tests/ops/test_launchers.py`` holds both modules of every family to this file.
"""

from typing import Any, NamedTuple

# The columns of the PPO loss's per-program partial sums, in the order both implementations
# store them: a (programs, len(PARTIALS)) fp32 tensor that ``fastppo.ops.ppo_policy_loss`` sums.
PARTIALS = ("pg", "kl", "entropy", "clipped", "half_lr_sq", "ratio", "ratio_max", "dual_clipped", "count")


def row_unit(*sizes) -> int:
    """The largest power of two up to 16 that divides every one of ``sizes`` (row strides and V).

    Triton marks an integer argument divisible by 16 or not at all, so rows of a vocabulary of
    1000 (16-byte aligned in bf16: 2000 bytes apart) would be read 2 bytes at a time. Launchers
    pass the row strides and V in units of this instead, and the kernels multiply by it as a
    constant, which tells the compiler every row starts at a multiple of it.
    """
    unit = 16
    while unit > 1 and any(size % unit for size in sizes):
        unit //= 2
    return unit


class Cascade(NamedTuple):
    """How decode attention reads a group's shared prompt once (``kernels/decode_attention.py``).

    ``members`` ``(E, M)`` int32: each entry's rows (the samples sharing one prefix, up to M of
    them, -1 where an entry has fewer); ``shared`` ``(E,)`` int32: the positions ``[0, shared)``
    the entry's rows hold in the same blocks (0: an unused entry); ``starts`` ``(B,)`` int32: each
    row's ``shared`` (0 for a row in no entry), where its own keys begin; ``longest``: an int at
    least every ``shared``. A row is in at most one entry. The math is plain attention's: this
    only says what may be read once.
    """

    members: Any
    shared: Any
    starts: Any
    longest: int


class LossTerms(NamedTuple):
    """The PPO loss's scalar settings, as its launchers take them and its ops pass them on (checked
    by ``fastppo.ops.ppo_policy_loss.loss_spec``). A custom op's schema has no such type: the ops carry
    them as one ``float[]`` and :meth:`from_floats` makes them terms again."""

    clip_low: float
    clip_high: float
    dual_clip: float  # 0 when off
    kl_coef: float
    kl_estimator: int  # 1, 2 or 3: k1, k2, k3
    entropy_coef: float  # the loss's sum only: the launchers' gradient leaves the entropy's out

    @classmethod
    def from_floats(cls, values) -> "LossTerms":
        """The terms a custom op received as ``float[]``, the estimator's number an int again."""
        terms = cls(*values)
        return terms._replace(kl_estimator=int(terms.kl_estimator))


def logprobs_forward(logits, labels, temperature, inv_temperature, ignore_index, logp, entropy, lse, stats=None):
    """Fill ``logp``, ``entropy``, ``lse`` (fp32 ``(N,)``) from ``logits`` ``(B, T, V)`` (any strides),
    and ``stats`` (fp32 ``(N, 3)``: log sum p^2, mean z, label is the first argmax) when given.
    ``labels`` is ``(N,)`` with N = B * T; ``temperature`` is ``(N,)`` or None, when the scalar
    ``inv_temperature`` applies to every row. ``entropy`` may be None when it is not wanted."""


def logprobs_backward(
    logits, grad, labels, temperature, inv_temperature, ignore_index, lse, entropy, grad_logp, grad_entropy
):
    """Write d(loss)/d(logits) into ``grad`` (``logits``' shape; may be ``logits`` itself or another
    dtype) from the upstream ``grad_logp`` and ``grad_entropy`` ``(N,)`` (the latter None when the
    entropy was not used)."""


def num_programs(N: int) -> int:
    """Rows of the partials tensor ``ppo_loss_forward`` writes for N tokens."""


def ppo_loss_forward(logprobs, old_logprobs, advantages, weights, valid, ref_logprobs, entropy, terms, grad, partials):
    """Write d(loss)/d(logprobs) into ``grad`` and each program's sums of ``PARTIALS`` into the
    zeroed fp32 ``partials`` ``(num_programs(N), len(PARTIALS))``. Token tensors are contiguous
    ``(N,)``: ``weights`` and ``grad`` fp32, ``valid`` bool, ``ref_logprobs`` and ``entropy``
    optional; ``terms`` is a :class:`LossTerms`."""


def gae(rewards, values, mask, gamma, lam, advantages, returns):
    """Fill ``advantages`` and ``returns`` (contiguous fp32 ``(B, T)``) from ``(B, T)`` ``rewards``
    and ``values`` (any float dtype and strides) and ``mask`` (bool or numeric, nonzero where the
    position is part of the trajectory)."""


def sample_forward(logits, inv_temperature, greedy, seed, tokens, logprobs):
    """Fill ``tokens`` (int64) and ``logprobs`` (fp32), both ``(B,)``, from ``logits`` ``(B, V)``:
    ``inv_temperature`` scales the logits, ``greedy`` takes the argmax instead of a Gumbel-max draw
    keyed by ``seed`` (an int in ``[0, 2**63)``); the log-prob is the full vocabulary's."""


def decode_attention(
    q, k_cache, v_cache, table, rows, lengths, max_length, scale, window, softcap, sinks, cascade, out
):
    """Fill ``out`` ``(B, H, D)`` (contiguous, q's dtype) with each query's attention over its cache
    row's positions ``[max(0, lengths[b] - window), lengths[b])`` (``window`` None: from 0), every
    length at most the int ``max_length``. ``k_cache``, ``v_cache``: a static ``(slots, max_len, KVH,
    D)`` (``table`` None) or a pool of blocks ``(num_blocks, block_size, KVH, D)`` with ``table``
    ``(slots, blocks)`` int32; the last dimension contiguous. ``rows``: ``(B,)`` integer, the cache
    row (slot) each query reads, or None: query b reads row b. ``softcap``: a float > 0 (each score
    ``s`` becomes ``softcap * tanh(s / softcap)``) or None. ``sinks``: fp32 ``(H,)`` or None;
    ``cascade``: a :class:`Cascade` or None (only with ``rows`` None)."""


# family -> the launchers its two implementations define
FAMILIES = {
    "token_logprobs": (logprobs_forward, logprobs_backward),
    "ppo_policy_loss": (num_programs, ppo_loss_forward),
    "gae": (gae,),
    "sample_tokens": (sample_forward,),
    "decode_attention": (decode_attention,),
}
