"""The launcher contract of each kernel family, declared once: the functions that a family's Triton
module (``kernels/<family>.py``) and its PyTorch twin (``fastppo/ops/<family>_torch.py``) both
define, each with this one signature, so an op calls whichever ``dispatch.implementation`` hands it.

Launchers take tensors and write outputs: no autograd, no checks, no policy about shapes or dtypes
(the ops do that). A Triton launcher may add keyword-only tuning arguments with defaults (tile
sizes, splits), which tests and the sm_90 compile study pass and the ops never do; nothing else may
differ. ``tests/ops/test_launchers.py`` holds both modules of every family to this file.
"""


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


def ppo_loss_forward(
    logprobs,
    old_logprobs,
    advantages,
    weights,
    valid,
    ref_logprobs,
    entropy,
    clip_low,
    clip_high,
    dual_clip,
    kl_coef,
    kl_estimator,
    grad,
    partials,
):
    """Write d(loss)/d(logprobs) into ``grad`` and each program's sums of ``PARTIALS`` into the
    zeroed fp32 ``partials`` ``(num_programs(N), len(PARTIALS))``. Token tensors are contiguous
    ``(N,)``: ``weights`` and ``grad`` fp32, ``valid`` bool, ``ref_logprobs`` and ``entropy``
    optional. ``dual_clip`` is 0 when off; ``kl_estimator`` is 1, 2 or 3 (k1, k2, k3)."""


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
    ``cascade``: a ``layout.Cascade`` or None (only with ``rows`` None)."""


# family -> the launchers its two implementations define
FAMILIES = {
    "logprobs": (logprobs_forward, logprobs_backward),
    "ppo_loss": (num_programs, ppo_loss_forward),
    "gae": (gae,),
    "sampling": (sample_forward,),
    "decode_attention": (decode_attention,),
}
