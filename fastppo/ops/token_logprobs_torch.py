"""PyTorch twin of ``fastppo.kernels.token_logprobs``: the CPU production path and the kernels' reference.

Same launcher signatures as the Triton kernels, so an op calls either without knowing which.
It walks the rows in chunks of about ``ROW_CHUNK_ELEMENTS`` logits, so it never holds an fp32
copy of the whole ``(N, V)`` logits, and vectorises within a chunk.
"""

import torch

# fp32 elements per chunk: 4 MiB per temporary keeps a chunk's working set in cache on a CPU.
ROW_CHUNK_ELEMENTS = 1 << 20
# A log-prob below which exp is 0 in fp32 (its least subnormal is exp(-103.3)).
LOG_P_FLOOR = -128.0


def _row_chunks(B: int, T: int, V: int):
    """Yield ``(b0, b1, t0, t1)`` boxes of ``(B, T)`` rows, each about ROW_CHUNK_ELEMENTS logits.

    A box is either several whole sequences (``t0, t1 = 0, T``) or a run of one sequence, so its
    rows are consecutive in the flattened ``N = B * T`` order, starting at ``b0 * T + t0``.
    """
    rows = max(1, ROW_CHUNK_ELEMENTS // max(V, 1))
    if rows >= T:
        step = rows // max(T, 1)
        for b0 in range(0, B, step):
            yield b0, min(B, b0 + step), 0, T
    else:
        for b0 in range(B):
            for t0 in range(0, T, rows):
                yield b0, b0 + 1, t0, min(T, t0 + rows)


def _rows_and_scale(T: int, temperature, inv_temperature, b0, b1, t0, t1):
    """A box's flat row range ``r0, r1`` and its rows' logit scale: None where it is 1, else the
    scalar or, with per-row temperatures, ``(n, 1)``."""
    r0, r1 = b0 * T + t0, (b1 - 1) * T + t1
    if temperature is not None:
        return r0, r1, (1.0 / temperature[r0:r1]).unsqueeze(1)
    return r0, r1, None if inv_temperature == 1.0 else inv_temperature


def _scaled(logits, temperature, inv_temperature, b0, b1, t0, t1):
    """fp32 scaled logits ``(n, V)`` of one box and its flat row range, for reading only: the
    logits themselves when they need no cast or scale."""
    r0, r1, scale = _rows_and_scale(logits.shape[1], temperature, inv_temperature, b0, b1, t0, t1)
    z = logits[b0:b1, t0:t1].reshape(-1, logits.shape[2]).float()  # (n, V)
    return (z if scale is None else z * scale), r0, r1


def _label_masks(labels, V, ignore_index):
    in_range = (labels >= 0) & (labels < V)
    return in_range, labels == ignore_index, torch.where(in_range, labels, 0).long()


def logprobs_forward(logits, labels, temperature, inv_temperature, ignore_index, logp, entropy, lse, stats=None):
    """The launcher ``kernels/contract.py`` declares. Per chunk, with ``d = z - max z``: ``lse = max + log s``
    for ``s = sum exp(d)``, and ``entropy = log s - sum exp(d) d / s``, the kernel's
    cancellation-free form; without the entropy, one ``logsumexp``. Few passes over each chunk are
    what make this fast on a CPU.
    """
    B, T, V = logits.shape
    for box in _row_chunks(B, T, V):
        z, r0, r1 = _scaled(logits, temperature, inv_temperature, *box)  # (n, V)
        in_range, ignored, safe = _label_masks(labels[r0:r1], V, ignore_index)
        if entropy is None and stats is None:
            row_lse = torch.logsumexp(z, dim=1)  # (n,)
        else:
            top = z.amax(dim=1, keepdim=True)  # (n, 1); NaN stays NaN
            top = top.masked_fill(top == float("-inf"), 0.0)  # a row of -inf: no -inf - -inf
            # d >= the fp32 minimum, so exp(d) * d is 0, not 0 * -inf, at -inf logits
            d = torch.sub(z, top).clamp_(min=torch.finfo(torch.float32).min)  # (n, V)
            e = d.exp()
            sum_e = e.sum(dim=1)  # (n,)
            row_lse = top.squeeze(1) + sum_e.log()
        if entropy is not None:
            row_ent = sum_e.log() - torch.linalg.vecdot(e, d, dim=1) / sum_e
            entropy[r0:r1] = row_ent.masked_fill(ignored, 0.0)
        if stats is not None:
            row_stats = torch.stack(
                [
                    torch.logsumexp(2.0 * d, dim=1) - 2.0 * sum_e.log(),
                    z.sum(dim=1) / V,
                    ((z.argmax(dim=1) == safe) & in_range).float(),
                ],
                dim=1,
            )  # (n, 3)
            stats[r0:r1] = row_stats.masked_fill(ignored.unsqueeze(1), 0.0)  # argmax: the first maximum
        row_logp = z.gather(1, safe.unsqueeze(1)).squeeze(1) - row_lse
        logp[r0:r1] = torch.where(in_range, row_logp, float("nan")).masked_fill(ignored, 0.0)
        lse[r0:r1] = row_lse.masked_fill(ignored, 0.0)  # as the kernel, which never reads those rows


def _box(t, b0, b1, t0, t1):
    """``t``'s rows of one box as a ``(n, V)`` view, or None where they are not one (strided rows)."""
    rows = t[b0:b1, t0:t1]
    return rows.view(-1, t.shape[2]) if rows.is_contiguous() else None


def logprobs_backward(
    logits, grad, labels, temperature, inv_temperature, ignore_index, lse, entropy, grad_logp, grad_entropy
):
    """The launcher ``kernels/contract.py`` declares, a box of rows at a time: ``dz = scale x (g ([label] - p) -
    g_H p (log p + H))`` per row, ``g`` and ``g_H`` the upstream gradients of the log-prob and the
    entropy, ``p`` the softmax. Four passes over a box without the entropy, eight with it, in place
    in the box of ``grad`` where that is fp32 and its rows are one run (else in a box of their own,
    copied in), and one temporary the size of a box with the entropy. ``g ([label] - p)`` is summed
    before the entropy's term is added: at a peaked row's label ``p`` rounds to 1 and the sum to 0,
    and the entropy's tiny term (``p (log p + H)`` ~ 1e-17) must not be lost in ``g``'s rounding."""
    B, T, V = logits.shape
    for b0, b1, t0, t1 in _row_chunks(B, T, V):
        r0, r1, scale = _rows_and_scale(T, temperature, inv_temperature, b0, b1, t0, t1)
        in_range, ignored, safe = _label_masks(labels[r0:r1], V, ignore_index)
        g_lp = torch.where(in_range, grad_logp[r0:r1], float("nan")).masked_fill(ignored, 0.0).unsqueeze(1)
        z = logits[b0:b1, t0:t1].reshape(-1, V).float()  # (n, V); a half one is upcast, as the kernel's tiles
        out = _box(grad, b0, b1, t0, t1) if grad.dtype == torch.float32 else None
        dz = torch.empty(z.shape, dtype=torch.float32, device=z.device) if out is None else out
        if scale is None:
            torch.sub(z, lse[r0:r1].unsqueeze(1), out=dz)  # log p: (n, V)
        else:
            torch.mul(z, scale, out=dz).sub_(lse[r0:r1].unsqueeze(1))
        label = safe.unsqueeze(1)
        labelled = torch.where(in_range.unsqueeze(1), g_lp, 0.0)  # (n, 1)
        if grad_entropy is None:
            dz.exp_().mul_(-g_lp).scatter_add_(1, label, labelled)  # g ([label] - p)
        else:
            g_ent = grad_entropy[r0:r1].masked_fill(ignored, 0.0).unsqueeze(1)
            # below log p = -104 p is 0 in fp32: a clamp there keeps p (log p + H) 0, not 0 x -inf
            log_p = dz.clamp_(min=LOG_P_FLOOR)
            p = log_p.exp()  # (n, V)
            term = log_p.add_(entropy[r0:r1].unsqueeze(1)).mul_(p)  # p (log p + H), in dz
            p.mul_(-g_lp).scatter_add_(1, label, labelled)  # g ([label] - p)
            torch.addcmul(p, term, g_ent, value=-1.0, out=dz)
        if scale is not None:
            dz *= scale
        dz.masked_fill_(ignored.unsqueeze(1), 0.0)  # exactly 0 in an ignored row, whatever its logits hold
        if out is None:
            grad[b0:b1, t0:t1] = dz.view(b1 - b0, t1 - t0, V)
