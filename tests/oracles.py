"""float64 references the ops are checked against, written for clarity, not speed.

Each oracle takes the op's inputs upcast to float64 (so for bf16/fp16 inputs it sees exactly the
values the op saw) and is differentiable, so gradients are checked with autograd on the oracle.
"""

import math

import torch


def logprobs_oracle(logits, labels, temperature=1.0, ignore_index=-100):
    """float64 ``(logp, entropy)`` of ``labels`` under ``softmax(logits / temperature)``."""
    z = logits.double()
    if isinstance(temperature, torch.Tensor):
        z = z / temperature.double().unsqueeze(-1)
    else:
        z = z / temperature
    log_p = torch.log_softmax(z, dim=-1)
    V = logits.shape[-1]
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < V)
    logp = log_p.gather(-1, labels.clamp(0, V - 1).long().unsqueeze(-1)).squeeze(-1)
    logp = torch.where(in_range, logp, float("nan"))
    p = log_p.exp()
    # Select before multiplying: p * log p at a -inf logit is 0 * -inf, and its gradient NaN.
    entropy = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(ignored, zero, logp), torch.where(ignored, zero, entropy)


def logprobs_grad_oracle(logits, labels, grad_logp, grad_entropy, temperature=1.0, ignore_index=-100):
    """float64 closed-form gradient of ``sum(grad_logp * logp + grad_entropy * entropy)``.

    ``dlogp/dz = onehot - p`` and ``dH/dz = -p (log p + H)``. For a peaked row autograd through
    ``-sum p log p`` cancels ``1 - 1e-17`` even in float64 and returns 0; this form does not.
    """
    z = logits.double() / temperature
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    _, entropy = logprobs_oracle(logits, labels, temperature, ignore_index)
    keep = (labels != ignore_index).double().unsqueeze(-1)
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0).long(), logits.shape[-1]).double()
    d_logp = onehot - p
    d_entropy = -torch.where(p > 0, p * (log_p + entropy.unsqueeze(-1)), 0.0)
    dz = grad_logp.double().unsqueeze(-1) * d_logp + grad_entropy.double().unsqueeze(-1) * d_entropy
    return keep * dz / temperature


def logprobs_from_hidden_oracle(hidden, weight, labels, bias=None, temperature=1.0, ignore_index=-100):
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    return logprobs_oracle(logits, labels, temperature, ignore_index)


def relative_error(x, ref):
    """``||x - ref|| / ||ref||`` in float64 (0 when both are 0)."""
    x, ref = x.double(), ref.double()
    denom = ref.norm()
    return (x - ref).norm().item() / max(denom.item(), 1e-30)


# Tolerances from the numerics policy (DESIGN.md): fp32 inputs, then bf16/fp16 inputs compared with
# the oracle evaluated on the same upcast values.
LOGP_ATOL = {torch.float32: 2e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# What fp32 cannot resolve beyond the absolute tolerance, per unit of the row's largest |logit|.
LOGIT_SCALE_ATOL = 4e-7


def assert_values_close(actual, expected, dtype, logit_scale=0.0):
    """fp32 results match the float64 oracle; NaN only where the oracle has NaN."""
    assert actual.dtype == torch.float32
    atol = LOGP_ATOL[dtype] + LOGIT_SCALE_ATOL * float(logit_scale)
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=0, equal_nan=True)


def assert_grad_close(actual, expected, dtype, atol=0.0):
    """Gradient in its tensor's dtype, within the policy's relative error of the oracle's.

    ``atol`` adds an absolute allowance on the error's norm: with huge logits fp32 cannot resolve
    ``log p + H`` in the entropy's gradient better than ~4e-7 x the largest |logit| per unit of
    upstream entropy gradient (the same floor as for the values).
    """
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all(), "gradient has NaN or inf"
    error = (actual.double() - expected.double()).norm().item()
    bound = GRAD_RTOL[dtype] * expected.double().norm().item() + atol
    assert error <= bound, f"gradient error {error:.3g} > {bound:.3g} (relative {relative_error(actual, expected):.3g})"


def aggregate_oracle(x, mask, agg, num_tokens=None):
    """The aggregation modes, each written as its own definition (not as token weights)."""
    x = torch.where(mask, x, 0.0)
    m = mask.double()
    if agg == "token-mean":
        denom = float(num_tokens) if num_tokens is not None else max(m.sum().item(), 1.0)
        return x.sum() / denom
    if agg == "seq-mean-token-mean":
        rows = [x[b].sum() / m[b].sum() for b in range(x.shape[0]) if m[b].sum() > 0]
        return torch.stack(rows).mean() if rows else x.sum() * 0
    if agg == "seq-mean-token-sum":
        return x.sum(dim=1).mean()
    return x.sum() / x.numel()


def ppo_loss_oracle(
    logp,
    old,
    adv,
    mask,
    *,
    ref=None,
    entropy=None,
    clip_eps=0.2,
    clip_eps_high=None,
    dual_clip=None,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy_coef=0.0,
    agg="token-mean",
    num_tokens=None,
    is_weights=None,
):
    """float64 PPO policy loss and stats; differentiable w.r.t. ``logp`` and ``entropy``.
    ``is_weights`` multiplies each token's policy-gradient term (rollout importance sampling)."""
    mask = mask != 0

    def clean(x):
        return torch.where(mask, x.double(), 0.0)

    logp, old, adv = clean(logp), clean(old), clean(adv)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    lr = (logp - old).clamp(-20, 20)
    ratio = lr.exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1 - clip_eps, 1 + high)
    pg = torch.maximum(pg1, pg2)
    stats = {}
    count = max(mask.sum().item(), 1)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_on = (adv < 0) & (bound < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, bound), pg)
        stats["dual_clipfrac"] = (dual_on & mask).sum() / count
    if is_weights is not None:
        pg = pg * clean(is_weights)
    loss = aggregate_oracle(pg, mask, agg, num_tokens)
    stats["pg_loss"] = loss.detach().clone()
    if ref is not None:
        d = logp - clean(ref)
        kl = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d.clamp(-20, 20)) + d.clamp(-20, 20) - 1}[kl_estimator]
        kl_term = aggregate_oracle(kl, mask, agg, num_tokens)
        loss = loss + kl_coef * kl_term
        stats["kl"] = kl_term.detach()
    if entropy is not None:
        ent_term = aggregate_oracle(clean(entropy), mask, agg, num_tokens)
        loss = loss - entropy_coef * ent_term
        stats["entropy"] = ent_term.detach()
    stats["clipfrac"] = ((pg2 > pg1) & mask).sum() / count
    stats["approx_kl"] = torch.where(mask, 0.5 * lr * lr, 0.0).sum().detach() / count
    stats["ratio_mean"] = torch.where(mask, ratio, 0.0).sum().detach() / count
    stats["ratio_max"] = torch.where(mask, ratio, 0.0).max().detach() if mask.any() else torch.tensor(0.0)
    return loss, stats


def philox_uniform4(seed: int, offsets):
    """The fp32 uniforms Triton's ``tl.rand4x(seed, offsets)`` gives for int64 ``offsets``, in NumPy,
    stacked on a new last axis of 4.

    Philox-4x32 with 10 rounds (Salmon et al., SC'11), as Triton keys it: counter (offset low and
    high words, 0, 0), key (seed low and high words); each output word becomes a float by folding
    negative int32 values (``~x``) and scaling by just under 2**-31.
    """
    import numpy as np

    mask = np.uint64(0xFFFFFFFF)
    offsets = np.asarray(offsets, dtype=np.int64).astype(np.uint64)
    c0, c1 = offsets & mask, offsets >> np.uint64(32)
    c2 = c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        product_b, product_a = round_b * c2, round_a * c0  # exact: both factors < 2**32
        c0, c2 = (product_b >> np.uint64(32)) ^ c1 ^ k0, (product_a >> np.uint64(32)) ^ c3 ^ k1
        c1, c3 = product_b & mask, product_a & mask
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    x = np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32).view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def sequence_ppo_loss_oracle(
    logp, old, adv, mask, clip_low, clip_high, ref=None, kl_coef=0.0, entropy=None, entropy_coef=0.0
):
    """float64, a loop over sequences: the definitions of GSPO's paper."""
    terms, kls, entropies = [], [], []
    for b in range(logp.shape[0]):
        valid = mask[b].bool()
        n = int(valid.sum())
        if n == 0:
            continue
        s = torch.exp((logp[b][valid] - old[b][valid]).sum() / n)
        terms.append(-torch.minimum(adv[b] * s, adv[b] * s.clamp(1 - clip_low, 1 + clip_high)))
        if ref is not None:  # k3: exp(ref - logp) - (ref - logp) - 1
            d = ref[b][valid] - logp[b][valid]
            kls.append((torch.exp(d) - d - 1).sum() / n)
        if entropy is not None:
            entropies.append(entropy[b][valid].sum() / n)
    loss = torch.stack(terms).sum() / len(terms)
    if kls:
        loss = loss + kl_coef * torch.stack(kls).sum() / len(terms)
    if entropies:
        loss = loss - entropy_coef * torch.stack(entropies).sum() / len(terms)
    return loss


def gae_oracle(rewards, values, mask, gamma, lam):
    """The definition, literally: walk each row right to left over its valid positions."""
    rewards, values, mask = rewards.cpu(), values.cpu(), mask.cpu()
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64, device="cpu")
    ret = torch.zeros(B, T, dtype=torch.float64, device="cpu")
    for b in range(B):
        next_value = next_adv = 0.0
        for t in reversed(range(T)):
            if not mask[b, t]:
                continue
            r, v = float(rewards[b, t]), float(values[b, t])
            delta = r + gamma * next_value - v
            adv[b, t] = delta + gamma * lam * next_adv
            ret[b, t] = adv[b, t] + v
            next_value, next_adv = v, float(adv[b, t])
    device = torch.get_default_device()
    return adv.to(device), ret.to(device)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z = 3.09), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def decode_attention_oracle(
    q, k_cache, v_cache, lengths, scale, block_table=None, window=None, sinks=None, rows=None, softcap=None
):
    """float64 decode attention, query by query: query b's ``q[b]`` ``(H, D)`` over the positions
    ``[max(0, L - window), L)`` of its cache row (``rows[b]``, else b), read position by position
    (through ``block_table`` when paged), query head h on KV head ``h // (H // KVH)``, each score
    soft-capped (``softcap * tanh(s / softcap)``), each head's sink one more logit with no value."""
    B, H, D = q.shape
    KVH, page = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        L = int(lengths[b])
        first = 0 if window is None else max(0, L - window)
        s = b if rows is None else int(rows[b])
        at = [
            (int(block_table[s, p // page]), p % page) if block_table is not None else (s, p) for p in range(first, L)
        ]
        keys = torch.stack([k_cache[i, j] for i, j in at]).double()  # (n, KVH, D)
        values = torch.stack([v_cache[i, j] for i, j in at]).double()
        for h in range(H):
            kv = h // (H // KVH)
            scores = keys[:, kv] @ q[b, h].double() * scale  # (n,)
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat((scores, sinks[h].double().view(1)))
            weights = torch.softmax(scores, dim=0)[: len(at)]
            out[b, h] = weights @ values[:, kv]
    return out


def masked_attention_oracle(q, k, v, allowed, scale):
    """Attention written out in float64: ``q`` (N, H, L, D) over ``k``, ``v`` (N, KVH, L, D), query
    head h on KV head ``h // (H // KVH)``, where ``allowed`` (N, L, L) (query, key) lets it: (N, L, H, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    scores = (q.double() @ k.transpose(2, 3)) * scale  # (N, H, L, L)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(scores, dim=3) @ v).transpose(1, 2)
