"""OpenRLHF's PPO helpers with OpenRLHF's signatures and semantics, backed by fastppo's kernels.

Follows every OpenRLHF release in ``OPENRLHF`` (0.8.0 to 0.11.2, post releases included), the
installed one (see ``fastppo.integrations.peers``; without OpenRLHF, the newest). Mirrors
``openrlhf.models.utils`` (``log_probs_from_logits``, ``compute_approx_kl``, ``compute_entropy``,
``masked_mean``), ``openrlhf.models.loss`` (``PolicyLoss``, ``ValueLoss``) and the experience
maker's ``get_advantages_and_returns``. ``patch()`` swaps them into the installed OpenRLHF, the
experience maker's method included (build the trainer after it: losses already constructed stay
OpenRLHF's). Importing this module does not import OpenRLHF.

What each release changed, the semantics of OpenRLHF's that these reproduce where they differ from
fastppo's own ops, and where they deviate from OpenRLHF on purpose: ``docs/integrations.md``
("OpenRLHF, release by release").
"""

import torch
from torch import Tensor, nn

from ..ops.gae import gae
from ..ops.ppo_policy_loss import ppo_policy_loss
from ..ops.token_logprobs import token_logprobs
from ..ops.value_loss import value_loss
from ._nan import live_entries, nan_gradient, nan_unless
from .patching import Patch
from .peers import ConstructorSignature, Peer, parameters

OPENRLHF = Peer(
    "openrlhf",
    {
        "0.8.0": (),
        "0.8.0.post1": (),
        "0.8.1": (),
        "0.8.1.post1": (),
        "0.8.2": ("clip-range-low-high",),
        "0.8.3": ("returns-clip-ratio",),
        "0.8.4": (),
        "0.8.5": (),
        "0.8.6": ("dual-clip", "kl-clamped"),
        "0.8.7": (),
        "0.8.8": ("policy-loss-type", "returns-ppo-kl"),
        "0.8.9": ("vllm-is-cap", "returns-vllm-kl"),
        "0.8.9.post1": (),
        "0.8.10": ("vllm-is-switch",),
        "0.8.11": (),
        "0.9.0": (),
        "0.9.1": ("vllm-is-band",),
        "0.9.1.post1": (),
        "0.9.2": (),
        "0.9.3": ("vllm-is-correction-type",),
        "0.9.4": ("seq-mask-tis",),
        "0.9.5": (),
        "0.9.6": (),
        "0.9.7": (),
        "0.9.8": (),
        "0.9.9": ("kl-estimator-checked",),
        "0.9.10": (),
        "0.10.0": (),
        "0.10.1": (),
        "0.10.1.post1": (),
        "0.10.1.post2": (),
        "0.10.2": (),
        "0.10.3": ("global-batch", "policy-ratio-clamped", "ppo-kl-of-the-policy"),
        "0.10.4": (),
        "0.11.0": (),
        "0.11.1": ("kl-unbiased-gradient", "icepop-where"),
        "0.11.2": ("is-correction", "returns-filter-ratio"),
    },
)
_ESTIMATORS = ("k1", "k2", "k3")
_KL_WEIGHT_CAP = 10.0  # OpenRLHF's cap on the importance weight of the unbiased KL gradient
_GLOBAL_BATCH = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None)


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)[labels]`` in the logits' dtype, computed in fp32."""
    return token_logprobs(logits, labels, temperature=temperature).to(logits.dtype)


def compute_entropy(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, in the logits' dtype, computed in fp32."""
    zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs(logits, zeros, return_entropy=True)[1].to(logits.dtype)


def masked_mean(tensor: Tensor, mask, dim=None) -> Tensor:
    """OpenRLHF's ``(tensor * mask).sum(dim) / mask.sum(dim)``: NaN where nothing is valid, in the
    value and in the gradient of that group's entries; elsewhere whatever sits at masked positions
    is dropped. The plain mean when ``mask`` is None."""
    if mask is None:
        return tensor.mean(dim=dim)
    counts = mask.sum() if dim is None else mask.sum(dim=dim, keepdim=True)  # broadcast to tensor's entries
    total = (torch.where(mask.bool(), tensor, 0.0) * mask).sum(dim=dim)
    mean = total / (counts if dim is None else counts.squeeze(dim))
    return mean + nan_gradient(tensor, counts == 0)


@OPENRLHF.follows(
    {
        "0.8.0": parameters("log_probs", "log_probs_base", kl_estimator="k1"),
        "0.11.1": parameters(
            "log_probs", "log_probs_base", log_probs_old=None, kl_estimator="k1", unbiased_gradient=False
        ),
    }
)
def compute_approx_kl(
    log_probs: Tensor, log_probs_base: Tensor, kl_estimator: str, log_probs_old=None, unbiased_gradient: bool = False
) -> Tensor:
    """OpenRLHF's per-token KL estimate (k1, k2 or k3), fp32; clamped to [-10, 10] from 0.8.6.

    Elementwise PyTorch in OpenRLHF's own order of operations, so the values are OpenRLHF's to the
    bit (its tests compare them so)."""
    if kl_estimator not in _ESTIMATORS:
        raise ValueError(f"Unknown kl_estimator: {kl_estimator}")
    d = log_probs.float() - log_probs_base.float()
    clamped = OPENRLHF.has("kl-clamped")
    if kl_estimator == "k1":
        value = d
    elif kl_estimator == "k2":
        value = d**2 / 2.0
    else:  # below -10 k3 is past the clamp anyway; bounding it there keeps its gradient finite
        bounded = d.clamp(min=-10.0) if clamped else d
        value = (-bounded).exp() - 1 + bounded
    if clamped:
        value = value.clamp(min=-10.0, max=10.0)
    if not unbiased_gradient:
        return value
    weight = 1.0
    if log_probs_old is not None:
        weight = (log_probs.float() - log_probs_old.float()).exp().clamp(max=_KL_WEIGHT_CAP).detach()
    surrogate = weight * (d**2 / 2.0)  # k2's gradient, times the importance weight
    return value.detach() + surrogate - surrogate.detach()


def get_advantages_and_returns(
    values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float, lambd: float
) -> tuple:
    """OpenRLHF's GAE: ``(advantages, returns)``, ``(B, T)`` fp32, one kernel launch."""
    with torch.no_grad():
        if action_mask is not None:
            values, rewards = action_mask * values, action_mask * rewards
        every_step = torch.ones(values.shape, dtype=torch.bool, device=values.device)
        return gae(rewards, values, every_step, gamma=float(gamma), lam=float(lambd))


def _aggregation(mask: Tensor, token_level_loss: bool, dp_size, batch_num_tokens, global_batch_size) -> tuple:
    """OpenRLHF's reduction as ``(agg, scale, poison, nan_at)``: fastppo's ``agg`` times ``scale``,
    plus ``poison`` (0, or NaN where OpenRLHF divides 0 by 0), with a NaN gradient at the entries
    ``nan_at`` holds (broadcast to (B, T); or None), where that division reaches the gradient
    (:func:`_followed`), for the release followed. ``scale`` is a tensor wherever a given count
    enters it, so a count of 0 gives OpenRLHF's inf or NaN."""
    valid = mask.bool()
    tokens, rows = valid.sum(), (valid.sum(dim=-1) > 0).sum()
    if token_level_loss:
        if batch_num_tokens is None:  # the mean over every token
            return "token-mean", 1.0, nan_unless(tokens > 0), tokens == 0
        return "token-mean", tokens.clamp(min=1) * dp_size / batch_num_tokens, 0.0, None
    if not OPENRLHF.has("global-batch"):  # the mean over every row of its mean
        empty = ~valid.any(dim=-1, keepdim=True)  # (B, 1)
        return (
            "seq-mean-token-mean",
            rows / valid.shape[0],
            nan_unless(~empty.any()),
            empty,
        )  # fastppo's: rows with a token
    if global_batch_size is None:  # the mean over the rows with a token
        return "seq-mean-token-mean", 1.0, nan_unless(rows > 0), rows == 0
    return "seq-mean-token-mean", rows.clamp(min=1) * dp_size / global_batch_size, 0.0, None


def _followed(loss: Tensor, scale, poison, nan_at, x: Tensor, live) -> Tensor:
    """OpenRLHF's result from fastppo's ``loss`` and :func:`_aggregation`'s terms. A given count of
    0 (an infinite ``scale``) gives OpenRLHF's inf or NaN value, and a gradient that is not finite
    wherever its terms are live; ``nan_at`` poisons the gradient of ``x`` where ``live()`` holds
    (:func:`~fastppo.integrations._nan.nan_gradient`), as OpenRLHF's own division does."""
    if isinstance(scale, Tensor):
        finite = scale.isfinite()
        safe = torch.where(finite, scale, 0.0)
        nan_at = ~finite if nan_at is None else nan_at | ~finite
        loss, scale = loss * safe + (loss * scale - loss * safe).detach(), 1.0
    return loss * scale + poison + nan_gradient(x, nan_at, live)


def _mask(action_mask, like: Tensor, token_level_loss: bool, batch_info: dict) -> Tensor:
    """The loss's mask: ``action_mask``, or every token when it is None, where the release allows
    None (from 0.10.3 only the plain token mean does, as OpenRLHF's aggregation reads the mask)."""
    if action_mask is not None:
        return action_mask
    if OPENRLHF.has("global-batch") and not (token_level_loss and batch_info.get("batch_num_tokens") is None):
        raise TypeError(
            f"OpenRLHF {OPENRLHF.release}'s loss aggregation needs action_mask for "
            f"{'batch_num_tokens' if token_level_loss else 'the sequence mean'}"
        )
    return torch.ones_like(like, dtype=torch.bool)


def _binary_kl(p: Tensor, q: Tensor) -> Tensor:
    return p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()


class _Correction:
    """The rollout-vs-train importance correction a ``PolicyLoss`` applies, as the followed release
    configures it: ``weights(...)`` gives each token's coefficient and the share of units filtered."""

    def __init__(self, options: dict):
        self.kind = self._kind(options)
        self.options = options

    @staticmethod
    def _kind(o: dict):
        if OPENRLHF.has("is-correction"):
            level, mode, gating = o["is_correction_level"], o["is_correction_mode"], o["is_correction_gating"]
            for name, value, allowed in (
                ("is_correction_level", level, ("off", "token", "seq")),
                ("is_correction_mode", mode, ("mask", "clip")),
                ("is_correction_gating", gating, ("ratio", "binary_kl", "tv")),
            ):
                if value not in allowed:
                    raise ValueError(f"{name} must be {'/'.join(allowed)}, got {value}")
            if mode == "clip" and (level == "seq" or gating != "ratio"):
                raise ValueError(
                    "is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio"
                )
            if gating != "ratio" and level != "off" and o["is_correction_threshold"][0] > 0:
                raise ValueError(f"is_correction_gating={gating} takes an upper bound only (a single delta)")
            return None if level == "off" else "gate"
        if OPENRLHF.has("vllm-is-correction-type"):
            types = ("tis", "icepop", "seq-mask-tis" if OPENRLHF.has("seq-mask-tis") else "mis")
            if o["vllm_is_correction_type"] not in types:
                raise ValueError(
                    f"Invalid vllm_is_correction_type: {o['vllm_is_correction_type']}, must be one of {'/'.join(types)}"
                )
        if not OPENRLHF.has("vllm-is-cap"):
            return None
        if not (
            o["enable_vllm_is_correction"]
            if OPENRLHF.has("vllm-is-switch")
            else o["vllm_is_truncated_threshold"] is not None
        ):
            return None
        if not OPENRLHF.has("vllm-is-band"):
            return "cap"
        if not OPENRLHF.has("vllm-is-correction-type"):
            return "icepop" if o["use_icepop"] else "tis"
        return "seq-mask-tis" if o["vllm_is_correction_type"] == "mis" else o["vllm_is_correction_type"]

    def weights(self, old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> tuple:
        """``(coefficients (B, T), filtered share or None)`` for the loss of each token."""
        log_ratio = (old_log_probs - rollout_log_probs).detach().float()  # log(pi_train / pi_rollout)
        weights = torch.exp(log_ratio)
        if self.kind == "gate":
            return self._gate(log_ratio, weights, old_log_probs, rollout_log_probs, mask)
        if self.kind == "cap":
            return weights.clamp(max=self.options["vllm_is_truncated_threshold"]), None
        low, high = self.options["vllm_is_truncated_threshold"]
        if self.kind == "tis":
            return weights.clamp(min=low, max=high), None
        if self.kind == "icepop":
            inside = (weights >= low) & (weights <= high)
            return (torch.where(inside, weights, 0.0) if OPENRLHF.has("icepop-where") else weights * inside), None
        sequence = torch.exp(masked_mean(log_ratio, mask, dim=-1))  # seq-mask-tis: (B,) geometric means
        return weights * ((sequence >= low) & (sequence <= high)).unsqueeze(-1), None

    def _gate(self, log_ratio, weights, old_log_probs, rollout_log_probs, mask) -> tuple:
        o = self.options
        low, high = o["is_correction_threshold"]
        sequence_level = o["is_correction_level"] == "seq"
        if o["is_correction_gating"] == "ratio":
            statistic = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1) if sequence_level else log_ratio
            statistic = statistic.exp()  # (B, 1) or (B, T)
        else:
            p = rollout_log_probs.detach().float().exp().clamp(1e-6, 1 - 1e-6)
            q = old_log_probs.detach().float().exp().clamp(1e-6, 1 - 1e-6)
            statistic = _binary_kl(p, q) if o["is_correction_gating"] == "binary_kl" else (p - q).abs()
            if sequence_level:
                statistic = masked_mean(statistic, mask, dim=-1).unsqueeze(-1)
        if o["is_correction_mode"] == "clip":
            coefficients, filtered = statistic.clamp(min=low, max=high), (statistic < low) | (statistic > high)
        else:
            keep = (statistic >= low) & (statistic <= high)
            coefficients, filtered = torch.where(keep, weights, 0.0), ~keep
        share = filtered.float().mean() if sequence_level else masked_mean(filtered.float(), mask)
        return coefficients.expand_as(weights), share


# PolicyLoss's constructor parameters with their defaults, and each release's, in its order.
_POLICY_DEFAULTS = dict(
    clip_eps=0.2,
    clip_eps_low=0.2,
    clip_eps_high=0.2,
    dual_clip=None,
    token_level_loss=True,
    policy_loss_type="ppo",
    enable_vllm_is_correction=False,
    vllm_is_truncated_threshold=None,
    use_icepop=False,
    vllm_is_correction_type="tis",
    is_correction_level="off",
    is_correction_mode="mask",
    is_correction_gating="ratio",
    is_correction_threshold=(0.5, 5.0),
)
_CLIP = ("clip_eps_low", "clip_eps_high")
_TYPED = (*_CLIP, "dual_clip", "token_level_loss", "policy_loss_type")
_POLICY_LOSS = {
    "0.8.0": ("clip_eps", "token_level_loss"),
    "0.8.2": (*_CLIP, "token_level_loss"),
    "0.8.6": (*_CLIP, "dual_clip", "token_level_loss"),
    "0.8.8": _TYPED,
    "0.8.9": (*_TYPED, "vllm_is_truncated_threshold"),
    "0.8.10": (*_TYPED, "enable_vllm_is_correction", "vllm_is_truncated_threshold"),
    "0.9.1": (*_TYPED, "enable_vllm_is_correction", "vllm_is_truncated_threshold", "use_icepop"),
    "0.9.3": (*_TYPED, "enable_vllm_is_correction", "vllm_is_truncated_threshold", "vllm_is_correction_type"),
    "0.11.2": (*_TYPED, "is_correction_level", "is_correction_mode", "is_correction_gating", "is_correction_threshold"),
}
_POLICY_FORWARD = ("self", "log_probs", "old_log_probs", "advantages")


def _openrlhf_policy_loss():
    """OpenRLHF's own ``PolicyLoss`` class, for the policy-loss types fastppo does not reproduce."""
    try:
        return _PATCH.original(_LOSS, "PolicyLoss")
    except ImportError as error:
        raise ValueError(
            "fastppo reproduces policy_loss_type='ppo'; another type runs OpenRLHF's own PolicyLoss, "
            "which needs OpenRLHF installed"
        ) from error


class PolicyLoss(nn.Module):
    """OpenRLHF's PPO policy loss (``policy_loss_type="ppo"``) on fastppo's fused kernel; another
    ``policy_loss_type`` constructs OpenRLHF's own ``PolicyLoss``.

    Constructed and called with the followed release's parameters; ``forward`` returns what that
    release returns (see the module docstring).
    """

    __signature__ = ConstructorSignature()

    def __new__(cls, *args, **kwargs):
        try:
            options = cls.__init__.bind(None, *args, **kwargs)
        except TypeError:
            return super().__new__(cls)  # __init__ raises it, as OpenRLHF's would
        if options.get("policy_loss_type", "ppo") != "ppo":
            return _openrlhf_policy_loss()(*args, **kwargs)
        return super().__new__(cls)

    @OPENRLHF.follows(
        {
            release: parameters("self", **{name: _POLICY_DEFAULTS[name] for name in names})
            for release, names in _POLICY_LOSS.items()
        }
    )
    def __init__(self, **options) -> None:
        super().__init__()
        if options.get("dual_clip") is not None and options["dual_clip"] <= 1.0:
            raise ValueError(f"dual_clip must be > 1.0, got {options['dual_clip']}")
        if "clip_eps" in options:  # one clip range before 0.8.2
            options["clip_eps_low"] = options["clip_eps_high"] = options.pop("clip_eps")
        self.clip_eps_low, self.clip_eps_high = options["clip_eps_low"], options["clip_eps_high"]
        self.dual_clip, self.token_level_loss = options.get("dual_clip"), options["token_level_loss"]
        self.correction = _Correction(options)

    @OPENRLHF.follows(
        {
            "0.8.0": parameters(*_POLICY_FORWARD, action_mask=None),
            "0.8.9": parameters(*_POLICY_FORWARD, action_mask=None, rollout_log_probs=None),
            "0.10.3": parameters(*_POLICY_FORWARD, action_mask=None, rollout_log_probs=None, **_GLOBAL_BATCH),
        }
    )
    def forward(
        self,
        log_probs: Tensor,
        old_log_probs: Tensor,
        advantages: Tensor,
        action_mask: Tensor = None,
        rollout_log_probs: Tensor = None,
        **batch_info,
    ):
        mask = _mask(action_mask, log_probs, self.token_level_loss, batch_info)
        agg, scale, poison, nan_at = _aggregation(mask, self.token_level_loss, **{**_GLOBAL_BATCH, **batch_info})
        weighted, filtered, negative = advantages, None, None
        if self.correction.kind is not None:
            coefficients, filtered = self.correction.weights(old_log_probs, rollout_log_probs, mask)
            weighted = advantages * coefficients  # >= 0 commutes with the clipping; < 0 poisons the loss
            negative = ((coefficients < 0) & mask.bool()).any()  # and its gradient, everywhere
            poison, nan_at = poison + nan_unless(~negative), negative if nan_at is None else nan_at | negative

        def objective(log_probs: Tensor, mask: Tensor, agg: str = "token-mean", advantages=weighted) -> Tensor:
            return ppo_policy_loss(
                log_probs,
                old_log_probs,
                advantages,
                mask,
                clip_eps=self.clip_eps_low,
                clip_eps_high=self.clip_eps_high,
                dual_clip=self.dual_clip,
                agg=agg,
            )[0]

        every = torch.ones_like(mask, dtype=torch.bool)

        def live() -> Tensor:
            """Where OpenRLHF's per-token graph reaches ``log_probs``: the clipping of its terms decides
            (the correction multiplies them after), and a negative weight poisons every entry."""
            terms = live_entries(lambda x: objective(x, every, advantages=advantages), log_probs)
            return terms if negative is None else terms | negative

        loss = _followed(objective(log_probs, mask, agg), scale, poison, nan_at, log_probs, live)
        if not OPENRLHF.has("returns-clip-ratio"):
            return loss
        log_ratio = (log_probs - old_log_probs).detach().float()
        ratio = (log_ratio.clamp(-20.0, 20.0) if OPENRLHF.has("policy-ratio-clamped") else log_ratio).exp()
        advantages = advantages.detach().float()
        clipped = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages < ratio * advantages
        result = (loss, masked_mean(clipped.float(), action_mask))
        if OPENRLHF.has("returns-ppo-kl"):
            reported = log_ratio
            if (
                self.correction.kind is not None
                and OPENRLHF.has("vllm-is-correction-type")
                and not OPENRLHF.has("ppo-kl-of-the-policy")
            ):
                reported = (old_log_probs - rollout_log_probs).detach().float()  # that release's log_ratio, reused
            result += (masked_mean(-reported, action_mask),)
        if OPENRLHF.has("returns-vllm-kl"):
            corrected = self.correction.kind is not None
            result += (
                masked_mean((rollout_log_probs - old_log_probs).detach().float(), action_mask) if corrected else None,
            )
        if OPENRLHF.has("returns-filter-ratio"):
            result += (filtered,)
        return result


_VALUE_FORWARD = ("self", "values", "old_values", "returns")


class ValueLoss(nn.Module):
    """OpenRLHF's clipped value loss on fastppo's ``value_loss``, called with the followed
    release's ``forward`` parameters (the global-batch ones from 0.10.3)."""

    def __init__(self, clip_eps: float = None, token_level_loss: bool = True) -> None:
        super().__init__()
        self.clip_eps, self.token_level_loss = clip_eps, token_level_loss

    @OPENRLHF.follows(
        {
            "0.8.0": parameters(*_VALUE_FORWARD, action_mask=None),
            "0.10.3": parameters(*_VALUE_FORWARD, action_mask=None, **_GLOBAL_BATCH),
        }
    )
    def forward(
        self, values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor = None, **batch_info
    ) -> Tensor:
        mask = _mask(action_mask, values, self.token_level_loss, batch_info)
        agg, scale, poison, nan_at = _aggregation(mask, self.token_level_loss, **{**_GLOBAL_BATCH, **batch_info})

        def objective(values: Tensor, mask: Tensor, agg: str = "token-mean") -> Tensor:
            return value_loss(values, old_values, returns, mask, clip_eps=self.clip_eps, agg=agg)[0]

        every = torch.ones_like(mask, dtype=torch.bool)
        live = lambda: live_entries(lambda x: objective(x, every), values)  # noqa: E731
        return _followed(objective(values, mask, agg), scale, poison, nan_at, values, live)


_UTILS, _LOSS = "openrlhf.models.utils", "openrlhf.models.loss"
_PATCH = Patch(
    "openrlhf",
    {
        **{(_UTILS, f.__name__): f for f in (log_probs_from_logits, compute_approx_kl, compute_entropy, masked_mean)},
        (_LOSS, "PolicyLoss"): PolicyLoss,
        (_LOSS, "ValueLoss"): ValueLoss,
        (
            "openrlhf.trainer.ppo_utils.experience_maker",
            "RemoteExperienceMaker.get_advantages_and_returns",
        ): get_advantages_and_returns,
    },
    caller="fastppo.integrations.openrlhf.patch()",
    install_hint="pip install openrlhf",
)


def patch() -> Patch:
    """Make the installed OpenRLHF use fastppo: every ``openrlhf`` module holding one of these
    gets fastppo's. Returns a context manager that unpatches on exit."""
    return _PATCH.install(OPENRLHF)


def unpatch() -> None:
    """Restore OpenRLHF's in every ``openrlhf`` module, including those imported while patched."""
    _PATCH.remove()
