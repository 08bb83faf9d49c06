"""PyTorch twin of ``fastppo.kernels.logprobs``: the CPU production path and the kernels' reference.

Same launcher signatures as the Triton kernels, so an op calls either without knowing which.
It walks the rows in chunks of about ``ROW_CHUNK_ELEMENTS`` logits, so it never holds an fp32
copy of the whole ``(N, V)`` logits, and vectorises within a chunk.
"""

import torch

# fp32 elements per chunk: 4 MiB per temporary keeps a chunk's working set in cache on a CPU.
ROW_CHUNK_ELEMENTS = 1 << 20


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


def _chunk(logits, temperature, inv_temperature, b0, b1, t0, t1):
    """fp32 scaled logits ``(n, V)`` of one box, its flat row range, and the per-row scale.

    A fresh tensor, which the caller may overwrite."""
    T = logits.shape[1]
    r0, r1 = b0 * T + t0, (b1 - 1) * T + t1
    z = logits[b0:b1, t0:t1].reshape(-1, logits.shape[2]).float()  # (n, V)
    scale = inv_temperature if temperature is None else (1.0 / temperature[r0:r1]).unsqueeze(1)
    return z * scale, r0, r1, scale


def _scaled(logits, temperature, inv_temperature, b0, b1, t0, t1):
    """Like ``_chunk``, for reading only: the logits themselves when they need no cast or scale."""
    if temperature is None and inv_temperature == 1.0 and logits.dtype == torch.float32:
        T = logits.shape[1]
        return logits[b0:b1, t0:t1].reshape(-1, logits.shape[2]), b0 * T + t0, (b1 - 1) * T + t1
    return _chunk(logits, temperature, inv_temperature, b0, b1, t0, t1)[:3]


def _label_masks(labels, V, ignore_index):
    in_range = (labels >= 0) & (labels < V)
    return in_range, labels == ignore_index, torch.where(in_range, labels, 0).long()


def logprobs_forward(logits, labels, temperature, inv_temperature, ignore_index, logp, entropy, lse, stats=None):
    """The launcher of ``launchers.py``. Per chunk, with ``d = z - max z``: ``lse = max + log s``
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


def logprobs_backward(
    logits, grad, labels, temperature, inv_temperature, ignore_index, lse, entropy, grad_logp, grad_entropy
):
    """The launcher of ``launchers.py``, a box of rows at a time."""
    B, T, V = logits.shape
    for b0, b1, t0, t1 in _row_chunks(B, T, V):
        z, r0, r1, scale = _chunk(logits, temperature, inv_temperature, b0, b1, t0, t1)
        in_range, ignored, safe = _label_masks(labels[r0:r1], V, ignore_index)
        g_lp = torch.where(in_range, grad_logp[r0:r1], float("nan")).masked_fill(ignored, 0.0)
        log_p = z.sub_(lse[r0:r1].unsqueeze(1))  # (n, V)
        p = log_p.exp()
        dz = p * -g_lp.unsqueeze(1)
        dz.scatter_add_(1, safe.unsqueeze(1), torch.where(in_range, g_lp, 0.0).unsqueeze(1))
        if grad_entropy is not None:
            g_ent = grad_entropy[r0:r1].masked_fill(ignored, 0.0).unsqueeze(1)
            term = p.mul_(log_p.add_(entropy[r0:r1].unsqueeze(1)))  # p * (log p + H), in place
            dz -= g_ent * term.masked_fill_(log_p == float("-inf"), 0.0)
        dz *= scale
        dz.masked_fill_(ignored.unsqueeze(1), 0.0)  # exactly 0 in an ignored row, whatever its logits hold
        grad[b0:b1, t0:t1] = dz.view(b1 - b0, t1 - t0, V)
