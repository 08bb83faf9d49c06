"""Inputs the ops' tests share: labels with ignored positions, the fused PPO loss's inputs and options."""

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_labels(lead, V, *, ignore_index=-100, device=None):
    """Random labels with 0 and V - 1 present and one ignored position when there are >= 3."""
    labels = torch.randint(0, V, lead, device=device)
    flat = labels.view(-1)
    flat[0] = 0
    flat[-1] = V - 1
    if flat.numel() >= 3:
        flat[1] = ignore_index
    return labels


OPTIONS = dict(
    clip_eps=0.2,
    clip_eps_high=0.3,
    dual_clip=3.0,
    kl_coef=0.05,
    kl_estimator="k3",
    entropy_coef=0.01,
    agg="seq-mean-token-mean",
)


def make_inputs(B=3, T=7, H=16, V=53, dtype=torch.float32):
    hidden = torch.randn(B, T, H).to(dtype)
    weight = (torch.randn(V, H) / H**0.5 * 2).to(dtype)
    mask = torch.rand(B, T) > 0.3
    mask[0, 0] = True
    labels = torch.randint(0, V, (B, T)).masked_fill(~mask, -1)  # padding ids outside [0, V)
    old = -torch.rand(B, T) * 4
    adv = torch.randn(B, T)
    ref = -torch.rand(B, T) * 4
    return hidden, weight, labels, old, adv, ref, mask
