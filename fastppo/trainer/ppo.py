"""The PPO loop: rollouts, scores, advantages, clipped updates; fastppo's own ops at every step.

One iteration: the next prompts of the epoch order -> ``Sampler`` rollouts on the live weights (a
bf16 copy on CUDA, refreshed in place) -> scores (``rollouts.py``) -> no-grad passes for the
reference log-probs and the values, and for the old log-probs unless the update is exactly
on-policy (then they are the update's own, detached) -> advantages as the estimator table says
(``estimators.py``) -> ``ppo_epochs`` passes of minibatch updates with ``ppo_loss_from_hidden``
(or GSPO's sequence loss) and ``value_loss`` -> metrics, and the held-out evaluation when it is
due (``evaluation.py``). Log-probs come from hidden states with the fused ops from hidden states, never full
logits. Precision (fp32 masters, bf16 compute) is ``precision.py``'s; prompts are ``data.py``'s.

The details that trip trainers up are explicit here: dropout is off in every model; the
rollout temperature is used again when log-probs are recomputed; the stop token is part of the
response and its mask; pad and stop tokens are told apart by the mask, not by their ids; old
log-probs' mismatch with the sampler's is reported (and optionally corrected by truncated
importance weights); steps with a
non-finite gradient are skipped, counted and warned about, and a run whose every step was
skipped fails. Checkpoints, resume and the run directory's rules live in ``checkpoint.py``.
"""

import contextlib
import json
import math
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from ..ops import (gae, group_advantages, token_logprobs_from_hidden, masked_whiten, ppo_loss_from_hidden,
                   rollout_is_weights, sequence_ppo_loss, token_rewards, value_loss)
from ..ops.aggregation import denominator
from ..rollout import Sampler
from . import checkpoint, data, evaluation, host_memory, inputs, plot, rollouts, sharding, tasks
from .config import TrainConfig
from .distributed import Ranks
from .errors import UsageError
from .kl_control import KLController
from .lora import LoRA
from .models import (Critic, RewardModel, cast_parameters, check_causal, context_length, disable_dropout,
                     enable_checkpointing, frozen_copy, load_policy, save_model)
from .precision import Precision, stored_dtype
from .rollout_weights import RolloutWeights
from .run_lock import RunLock

IGNORE = -100


@dataclass
class Batch:
    """One rollout laid out for the updates: prompt + response per row, right-padded."""

    input_ids: Tensor  # (B, L)
    attention_mask: Tensor  # (B, L)
    positions: Tensor  # (B, R): the position whose hidden state predicts each response token
    response_ids: Tensor  # (B, R)
    mask: Tensor  # (B, R) bool
    sampler_logprobs: Tensor  # (B, R) fp32, from the rollout
    old_logprobs: Optional[Tensor] = None  # (B, R); None until the update computes them
    ref_logprobs: Optional[Tensor] = None
    values: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    returns: Optional[Tensor] = None

    def rows(self, index: Tensor) -> "Batch":
        return Batch(**{k: None if v is None else v[index] for k, v in self.__dict__.items()})


def layout(rollout, pad_id: int, device) -> tuple:
    """``(input_ids, attention_mask, positions)`` for prompt + response rows, right-padded."""
    lens = rollout.response_lens.tolist()
    rows = [list(p) + rollout.response_ids[i, :n].tolist() for i, (p, n) in enumerate(zip(rollout.prompt_ids, lens))]
    L = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), L), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, :len(row)] = torch.tensor(row, device=device)
        attention_mask[i, :len(row)] = 1
    R = rollout.response_ids.shape[1]
    prompt_lens = torch.tensor([len(p) for p in rollout.prompt_ids], device=device)
    positions = (prompt_lens[:, None] - 1 + torch.arange(R, device=device)).clamp(max=L - 1)  # (B, R)
    return input_ids, attention_mask, positions


def response_hidden(model, batch: Batch) -> Tensor:
    """Last hidden states at the positions that predict the response tokens: (B, R, H), in the
    autocast dtype under autocast (the fused ops accumulate in fp32 whatever it is)."""
    hidden = sharding.last_hidden_state(model, batch.input_ids, batch.attention_mask)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # the final norm hands back fp32: the LM head computes in bf16 too
        hidden = hidden.to(torch.get_autocast_dtype(device))
    return hidden.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def response_values(critic, batch: Batch) -> Tensor:
    """The critic's values at the positions that predict the response tokens: (B, R) fp32."""
    return critic(batch.input_ids, batch.attention_mask).gather(1, batch.positions).float()


def head_params(model, like: Tensor) -> tuple:
    """The LM head's weight and bias in the dtype of the hidden states (bf16 under autocast)."""
    head = model.get_output_embeddings()
    bias = None if head.bias is None else head.bias.to(like.dtype)
    return head.weight.to(like.dtype), bias


def response_labels(batch: Batch) -> Tensor:
    """The response tokens as labels, ``IGNORE`` where masked: (B, R)."""
    return batch.response_ids.masked_fill(~batch.mask, IGNORE)


def response_logprobs(model, batch: Batch, temperature: float) -> Tensor:
    hidden = response_hidden(model, batch)
    weight, bias = head_params(model, hidden)
    return token_logprobs_from_hidden(hidden, weight, response_labels(batch), bias=bias, temperature=temperature)


def _tensorboard(out: Path):
    """A TensorBoard writer under ``out/tensorboard`` when tensorboard is installed, else None."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out / "tensorboard"))


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over valid tokens: how much the critic explains."""
    valid = mask.bool()
    returns, residual = returns[valid].double(), (returns - values)[valid].double()
    if returns.numel() < 2 or returns.var() == 0:
        return float("nan")
    return float(1 - residual.var() / returns.var())


def adamw(params: list, lr: float) -> torch.optim.AdamW:
    """AdamW with torch's defaults, fused (one kernel over every tensor on CUDA and on the CPU;
    the per-tensor loop it replaces cost 0.6 s of a 135M model's step on a 2-core CPU) when
    every parameter is fp32 and on one device type, as the master weights are."""
    fused = len({p.device.type for p in params}) == 1 and all(p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(params, lr=lr, fused=fused)


class TrainingFailed(RuntimeError):
    """The run ended without training: every optimizer step had a non-finite gradient."""


class PPOTrainer:
    def __init__(self, config: TrainConfig, policy=None, tokenizer=None, reward_fn=None, prompts=None, *,
                 resuming: bool = False):
        """``resuming`` is for :meth:`resume`: the run directory then holds the run being continued."""
        if not resuming:  # the paths as they are from here, whatever directory a resume runs in
            config = TrainConfig.from_flat(inputs.resolved(config.flat()))
        self.config = config
        config.check_device_here()
        torch.manual_seed(config.run.seed)
        device = config.device
        self.ranks = Ranks(torch.device(device).type)
        if config.data.prompts and reward_fn is None and not (config.reward.reward or config.reward.reward_model):
            raise UsageError("--prompts needs --reward (or --reward-model): the task's reward does not know your "
                             "prompts")
        # before any loading (a run that cannot write loses no time) and before touching the directory
        self.lock = self.ranks.on_main(lambda: self._claim_run_directory(Path(config.run.out), resuming))
        # what the user wrote, read before the model loads: a wrong file or reward costs no wait
        sources = data.sources(config, prompts)
        if reward_fn is None:
            for spec in config.reward.reward or ():
                tasks.load_reward(spec, config.reward.format_pattern)
        if not self.ranks.main:  # rank 0's loading and saving progress bars are enough
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        if torch.device(device).type == "cpu" and config.releases_cpu_memory:
            host_memory.release_freed_memory()  # before the model loads: every tensor of the run is served so
        if self.ranks.world > 1 and torch.device(device).type == "cuda":
            device = f"cuda:{self.ranks.local_rank}"
        if policy is None:
            policy, tokenizer = load_policy(config.model.model)
            policy.to(device)
        self.policy, self.tokenizer = policy, tokenizer
        self.precision = Precision.of(config.optim.autocast, config.rollout.rollout_dtype, config.run.save_dtype,
                                      torch.device(device).type, stored_dtype(policy.config))
        cast_parameters(policy, torch.float32)  # the master weights, whatever the checkpoint's dtype
        disable_dropout(policy)
        check_causal(policy, config.model.model or "(the default model)")
        self.device = next(policy.parameters()).device
        self.prompts, self.eval_prompts = data.configured(config, self.tokenizer, context_length(policy), sources)
        every = [p for p in (self.prompts, self.eval_prompts) if p is not None]
        self.fields = list(dict.fromkeys(k for p in every for k in p.field_names()))  # each reward call gets all
        self.rewards = tasks.configured_rewards(
            config, reward_fn, lambda path: RewardModel(path, self.device, self.precision.frozen))
        for loaded in every:
            self.rewards.check_fields(loaded.fields, loaded.origins)
        self.order = data.EpochOrder(len(self.prompts), config.run.seed)
        self.prompts_drawn = 0  # the position in the epoch order, which a checkpoint keeps
        self.kl = KLController(config.algo.kl_coef, config.algo.kl_target, config.algo.kl_horizon)
        self.critic = None
        if config.uses_critic:  # from the full policy, before any LoRA wrapping: the critic trains in full
            from_rm = config.model.critic_init == "reward_model"
            critic = Critic.from_reward_model(config.reward.reward_model, policy) if from_rm else Critic.from_policy(policy)
            disable_dropout(critic)
            cast_parameters(critic, torch.float32)
            self.critic = critic.to(self.device)
        lora = config.lora
        self.lora = None if lora.lora_rank is None else LoRA(policy, lora.lora_rank, lora.lora_alpha,
                                                             lora.lora_target_modules, self.precision.rollout)
        self.policy = policy = policy if self.lora is None else self.lora.model
        # The reference: a frozen copy in the compute dtype, or for LoRA the base (adapters off).
        self.reference = None
        if config.algo.kl_coef > 0:
            self.reference = policy if self.lora is not None else frozen_copy(policy, self.precision.frozen)
        if config.model.gradient_checkpointing:
            for model in (policy, self.critic and self.critic.backbone):
                if model is not None:
                    enable_checkpointing(model)
        r = config.rollout
        self.sharded = config.sharding.fsdp
        # LoRA's frozen base is already in the rollout dtype: decode through the wrapped layers.
        self.rollout_weights = RolloutWeights(policy, None if self.lora is not None else self.precision.rollout,
                                              gathered=self.sharded)  # made whole, before sharding
        if self.sharded:
            self._shard()
        self.sampler = Sampler(self.rollout_weights.model, max_batch_size=config.sampler_slots,
                               max_seq_len=self.longest_prompt + r.max_new_tokens,
                               cuda_graphs=not self.sharded)
        o = config.optim
        self.optimizer = adamw([p for p in policy.parameters() if p.requires_grad], o.lr)
        self.critic_optimizer = adamw(list(self.critic.parameters()), o.critic_lr) if self.critic else None
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(opt, self._lr_factor)
                          for opt in (self.optimizer, self.critic_optimizer) if opt is not None]
        self.skipped_steps = 0
        self.steps = 0  # optimizer steps attempted, skipped ones included
        self.evaluations = []  # {"iteration", held-out metrics} of each evaluation
        self.warned_truncated = False  # most of a batch masked out by mask_truncated, said once
        self.examples = []  # the last iteration's rows as text (rollouts.examples), for completions.jsonl

    @property
    def longest_prompt(self) -> int:
        """The most tokens of any training or held-out prompt."""
        return max(len(ids) for p in (self.prompts, self.eval_prompts) if p is not None for ids in p.ids)

    def _claim_run_directory(self, out: Path, resuming: bool) -> RunLock:
        """Hold ``out`` for this run (``run_lock.py``), check that a new run may start there, and
        clear what interrupted saves left."""
        lock = RunLock.acquire(out)
        try:
            if not resuming:
                checkpoint.check_run_directory(out, self.config.run.overwrite)
            checkpoint.clear_leftovers(out)
        except BaseException:
            lock.release()
            raise
        return lock

    def _shard(self) -> None:
        """The policy, critic and reference sharded over the ranks (``sharding.py``)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ranks.world == 1:
            raise UsageError("--fsdp shards over the ranks torchrun starts, and this is one process: launch with "
                             "torchrun --nproc_per_node=N (N >= 2)")
        s = self.config.sharding
        mesh = init_device_mesh(self.device.type, (self.ranks.world,))
        models = [(self.policy, True), (self.critic, False)]
        if self.reference is not None and self.reference is not self.policy:
            models.append((self.reference, True))
        for model, hidden_states in models:
            if model is not None:
                sharding.shard(model, mesh=mesh, compute_dtype=self.precision.compute,
                               reshard_after_forward=s.fsdp_reshard_after_forward, offload=s.fsdp_offload,
                               hidden_states=hidden_states)

    # one iteration ---------------------------------------------------------------------------

    def sample(self, prompt_ids: list, temperature: float, n: int, seed: int, on_rows_ended=None):
        """``n`` responses per prompt with the run's sampling options (``rollouts.sample``)."""
        return rollouts.sample(self, prompt_ids, temperature, n, seed, on_rows_ended)

    def rollout(self, iteration: int) -> rollouts.Scored:
        """This iteration's prompts, responses and scores (``rollouts.rollout``)."""
        return rollouts.rollout(self, iteration)

    @torch.no_grad()
    def prepare(self, rollout, scores: Tensor) -> Batch:
        """The rollout laid out for the update, with old and reference log-probs, values and
        advantages as the estimator (``estimators.py``) defines them. With ``mask_truncated``, a
        response that hit max_new_tokens keeps its score in its group's baseline but has no token
        in the loss."""
        c, estimator = self.config, self.config.estimator
        input_ids, attention_mask, positions = layout(rollout, self.tokenizer.pad_token_id, self.device)
        mask = rollout.response_mask.to(self.device)
        if c.algo.mask_truncated:
            truncated = torch.tensor([f == "length" for f in rollout.finish_reason], device=self.device)
            mask = mask & ~truncated[:, None]
            share = float(truncated.float().mean())
            if share > 0.5 and not self.warned_truncated and self.ranks.main:
                self.warned_truncated = True
                warnings.warn(f"{share:.0%} of a batch's responses hit max_new_tokens={c.rollout.max_new_tokens} and "
                              "are left out of the loss (--mask-truncated), so the update learns from the rest only; "
                              "raise --max-new-tokens (said once per run; stop_rate logs it every iteration)")
        batch = Batch(input_ids, attention_mask, positions, rollout.response_ids.to(self.device), mask,
                      rollout.logprobs.to(self.device))
        with self.precision.autocast():
            if not c.old_logprobs_from_update:
                batch.old_logprobs = response_logprobs(self.policy, batch, c.rollout.temperature)
            if self.reference is not None:
                with self.lora.adapters_off() if self.lora is not None else contextlib.nullcontext():
                    batch.ref_logprobs = response_logprobs(self.reference, batch, c.rollout.temperature)
            if self.critic is not None:
                batch.values = response_values(self.critic, batch) * mask
        for model in (self.policy, self.reference, self.critic):
            sharding.reshard(model)  # no backward follows these passes to free the gathered roots
        if estimator.kl_in_reward:
            # Without old log-probs here the KL weight is 0 (old_logprobs_from_update): any will do.
            behaviour = batch.old_logprobs if batch.old_logprobs is not None else batch.sampler_logprobs
            ref = batch.ref_logprobs if batch.ref_logprobs is not None else behaviour
            rewards = token_rewards(scores, behaviour, ref, mask, kl_coef=self.kl.coef, kl_estimator="k1")
            if batch.values is not None:
                advantages, batch.returns = gae(rewards, batch.values, mask, gamma=c.algo.gamma, lam=c.algo.lam)
            else:  # REINFORCE++: the discounted reward-to-go, which is GAE with zero values and lambda 1
                advantages, batch.returns = gae(rewards, torch.zeros_like(rewards), mask, gamma=c.algo.gamma, lam=1.0)
        else:
            per_row = group_advantages(scores, c.rollout.samples_per_prompt, estimator=estimator.baseline)
            advantages = per_row.unsqueeze(1).expand_as(mask).float() * mask
        batch.advantages = masked_whiten(advantages, mask, group=self.ranks.group) if estimator.whiten else advantages
        return batch

    def _lr_factor(self, iteration: int) -> float:
        """Linear warm-up, then constant or cosine decay to 0 at the last iteration."""
        o, total = self.config.optim, self.config.run.iterations
        if iteration < o.warmup_iterations:
            return (iteration + 1) / o.warmup_iterations
        if o.lr_schedule == "constant":
            return 1.0
        progress = (iteration - o.warmup_iterations) / max(total - o.warmup_iterations, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    def update(self, batch: Batch) -> dict:
        """``ppo_epochs`` passes of minibatch steps over ``batch``; without old log-probs (the
        update is exactly on-policy) each minibatch's are its own forward's, written into ``batch``."""
        c = self.config
        models = [m for m in (self.policy, self.critic) if m is not None]
        for model in models:
            model.train()  # dropout is off; this is for gradient checkpointing, which needs it
        kl_in_loss = not c.estimator.kl_in_reward and batch.ref_logprobs is not None
        on_policy = batch.old_logprobs is None
        if on_policy:
            batch.old_logprobs = torch.zeros_like(batch.sampler_logprobs)
        logs = []  # one per optimizer step
        B = batch.mask.shape[0]
        for _ in range(c.algo.ppo_epochs):
            minibatches = torch.randperm(B, device=self.device).chunk(c.algo.minibatches)
            for first in range(0, len(minibatches), c.algo.grad_accumulation):
                indices = minibatches[first:first + c.algo.grad_accumulation]
                group = [batch.rows(index) for index in indices]
                # each loss is normalised over the whole step, on every rank: by its tokens (the
                # value loss, and token-mean), or by its rows (the seq-mean modes)
                tokens = self.ranks.sum(sum(mb.mask.sum() for mb in group))
                whole = tokens if c.agg == "token-mean" else self.ranks.sum(
                    sum(denominator(mb.mask, c.agg, c.rollout.max_new_tokens) for mb in group))
                self._zero_grad()
                parts = []
                for index, mb in zip(indices, group):
                    loss, stats = self._loss(mb, kl_in_loss, tokens, on_policy, whole)
                    loss.backward()
                    if on_policy:
                        batch.old_logprobs[index] = mb.old_logprobs
                    parts.append(stats)
                logs.append(self._step_stats(parts))
                if not self.sharded:  # FSDP's backward has reduce-scattered them
                    self.ranks.sum_gradients(p for opt in self._optimizers() for g in opt.param_groups
                                             for p in g["params"])
                self._step()
        for model in models:
            model.eval()
        return {k: sum(log[k] for log in logs) / len(logs) for k in logs[0]}

    def _step_stats(self, parts: list) -> dict:
        """One optimizer step's statistics from its minibatches' (``parts``, on every rank). A loss
        term normalised by the step's tokens (the value loss always; the policy's pg_loss, kl and
        entropy under token-mean) comes as each minibatch's share of the step's mean, so those are
        summed over minibatches and ranks; the others (fractions, ratios) are each minibatch's own
        means, averaged."""
        shares = ["vf_loss"] + (["pg_loss", "kl", "entropy"] if self.config.agg == "token-mean" else [])
        shares = [k for k in shares if k in parts[0]]
        summed = self.ranks.sum(torch.stack([sum(part[k] for part in parts).float() for k in shares])) \
            if shares else []
        means = {k: float(sum(part[k] for part in parts)) / len(parts) for k in parts[0] if k not in shares}
        return {**means, **{k: float(v) for k, v in zip(shares, summed)}}

    def _loss(self, mb: Batch, kl_in_loss: bool, tokens: Tensor, on_policy: bool, whole: Tensor = None) -> tuple:
        """The minibatch's loss and stats. ``tokens``: the step's valid tokens (over every minibatch
        and rank); ``whole``: the step's :func:`~fastppo.ops.aggregation.denominator` of ``agg``
        (default: ``tokens`` for token-mean, else the minibatch's own), the policy loss being
        rescaled from the minibatch's own to it. ``on_policy``: its old log-probs are this
        forward's own, detached (set on ``mb``), so no separate pass computed them. With
        ``rollout_is_cap`` the loss weights each token by the truncated importance weight of old
        over sampler log-probs."""
        c, agg = self.config, self.config.agg
        if whole is None:
            whole = tokens if agg == "token-mean" else denominator(mb.mask, agg, c.rollout.max_new_tokens)
        with self.precision.autocast():
            hidden = response_hidden(self.policy, mb)
        if c.algo.sequence_ratio and not on_policy:
            loss, stats = self._sequence_loss(mb, hidden, kl_in_loss)
        else:
            loss, stats = self._token_loss(mb, hidden, kl_in_loss, on_policy, whole if agg == "token-mean" else None)
        if agg != "token-mean":  # from the minibatch's own normaliser to the step's
            loss = loss * (denominator(mb.mask, agg).clamp(min=1.0) / whole.clamp(min=1.0))
        if self.critic is not None:
            with self.precision.autocast():
                values = response_values(self.critic, mb)
            vf, vf_stats = value_loss(values, mb.values, mb.returns, mb.mask, clip_eps=c.algo.vf_clip,
                                      num_tokens=tokens)
            loss = loss + c.algo.vf_coef * vf
            stats.update(vf_stats)
        return loss, stats

    def _token_loss(self, mb: Batch, hidden: Tensor, kl_in_loss: bool, on_policy: bool, num_tokens) -> tuple:
        """The fused per-token PPO loss, aggregated over the minibatch as ``agg`` says, token-mean
        over ``num_tokens`` (the step's: each token then weighs 1/N, as on one rank); on-policy,
        GSPO's too (every sequence ratio is then 1: its loss is this one with seq-mean-token-mean)."""
        c = self.config
        weight, bias = head_params(self.policy, hidden)
        cap = c.rollout.rollout_is_cap
        loss, stats, old = ppo_loss_from_hidden(
            hidden, weight, mb.response_ids, None if on_policy else mb.old_logprobs, mb.advantages, mb.mask,
            bias=bias, temperature=c.rollout.temperature, clip_eps=c.algo.clip_eps, clip_eps_high=c.algo.clip_eps_high,
            dual_clip=c.algo.dual_clip, entropy_coef=c.algo.entropy_coef,
            ref_logprobs=mb.ref_logprobs if kl_in_loss else None, kl_coef=self.kl.coef if kl_in_loss else 0.0,
            kl_estimator=c.algo.kl_estimator, agg=c.agg, num_tokens=num_tokens, return_logprobs=True,
            sampler_logprobs=None if cap is None else mb.sampler_logprobs, rollout_is_cap=cap)
        if on_policy:
            mb.old_logprobs = old
        if cap is not None:  # the weights the loss applied, for the logs
            weights = rollout_is_weights(mb.old_logprobs, mb.sampler_logprobs, mb.mask, cap)
            count = mb.mask.sum().clamp(min=1)
            stats.update(rollout_is_weight=weights.sum() / count,
                         rollout_is_capped=((weights >= cap) & mb.mask).sum() / count)
        return loss, stats

    def _sequence_loss(self, mb: Batch, hidden: Tensor, kl_in_loss: bool) -> tuple:
        """GSPO's loss off-policy: each response's token log-probs from the fused op from hidden states, then
        :func:`~fastppo.ops.sequence_ppo_loss` over them, a mean over the minibatch's responses."""
        c = self.config
        weight, bias = head_params(self.policy, hidden)
        logp, entropy = token_logprobs_from_hidden(hidden, weight, response_labels(mb), bias=bias,
                                              temperature=c.rollout.temperature, return_entropy=True)
        per_row = mb.advantages.sum(1) / mb.mask.sum(1).clamp(min=1)  # the group advantage each token holds
        return sequence_ppo_loss(logp, mb.old_logprobs, per_row, mb.mask, clip_eps=c.algo.clip_eps,
                                 clip_eps_high=c.algo.clip_eps_high,
                                 ref_logprobs=mb.ref_logprobs if kl_in_loss else None,
                                 kl_coef=self.kl.coef if kl_in_loss else 0.0, kl_estimator=c.algo.kl_estimator,
                                 entropy=entropy, entropy_coef=c.algo.entropy_coef)

    def _optimizers(self) -> list:
        return [o for o in (self.optimizer, self.critic_optimizer) if o is not None]

    def _zero_grad(self) -> None:
        for opt in self._optimizers():
            opt.zero_grad(set_to_none=True)

    def _step(self) -> None:
        from torch.distributed.tensor import DTensor

        params = [p for opt in self._optimizers() for group in opt.param_groups for p in group["params"]]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):  # sharded gradients: the norm's square is summed over ranks
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, self.config.optim.max_grad_norm, norm)
        self.steps += 1
        if not torch.isfinite(norm):
            self.skipped_steps += 1  # a non-finite gradient would poison the weights: skip the step
            warnings.warn(f"optimizer step {self.steps} skipped: the gradient is not finite "
                          f"({self.skipped_steps} skipped so far)")
            return
        for opt in self._optimizers():
            opt.step()

    def iteration(self, iteration: int) -> dict:
        start = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # this iteration's, before the schedule moves on
        scored = self.rollout(iteration)
        rolled = time.perf_counter()
        self.examples = rollouts.examples(self, scored, self.config.run.log_completions) if self.ranks.main else []
        batch = self.prepare(scored.rollout, scored.scores)
        prepared = time.perf_counter()
        kl_coef = self.kl.coef  # the coefficient this iteration used
        stats = self.update(batch)  # after it, old_logprobs are set either way
        if batch.ref_logprobs is not None:
            kl_sum = self.ranks.sum(((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum())
            rollout_kl = float(kl_sum / self.ranks.sum(batch.mask.sum()).clamp(min=1))
            self.kl.update(rollout_kl, batch.mask.shape[0] * self.ranks.world)
            stats.update(rollout_kl=rollout_kl, kl_coef=kl_coef)
        if batch.values is not None:
            stats["explained_variance"] = explained_variance(batch.values, batch.returns, batch.mask)
        for schedule in self.schedules:
            schedule.step()
        done = time.perf_counter()
        mask, sampler_logprobs, raw = batch.mask, batch.sampler_logprobs, scored.raw
        tokens = int(mask.sum())
        return self.ranks.mean_of({
            "iteration": iteration, "reward_mean": float(raw.mean()), "reward_std": float(raw.std()),
            **{f"reward/{name}": float(values.mean()) for name, values in scored.each_reward.items()},
            **scored.stats, "score_mean": float(scored.scores.mean()),
            "response_length": float(scored.rollout.response_lens.float().mean()),
            "stop_rate": float(1 - scored.no_stop.float().mean()),
            "logprob_mismatch": float(((sampler_logprobs - batch.old_logprobs).abs() * mask).sum() / max(tokens, 1)),
            **stats, "skipped_steps": self.skipped_steps, "lr": lr,
            "time_rollout": rolled - start,
            "time_forward": prepared - rolled, "time_update": done - prepared,
            # per second of the whole iteration: every token sampled, and those the loss kept
            "tokens_per_s_generated": float(scored.rollout.response_lens.sum()) * self.ranks.world / (done - start),
            "tokens_per_s_trained": tokens * self.ranks.world / (done - start),
        })

    # the run -----------------------------------------------------------------------------------

    def train(self, start: int = 0) -> list:
        """Iterations ``start`` .. ``iterations - 1``; SIGINT or SIGTERM ends the current iteration,
        writes a checkpoint and raises :class:`TrainingInterrupted` saying how to resume. With
        several ranks, rank 0 alone writes. The run directory's lock is let go when it returns."""
        # held since start-up, and again here for a trainer that trains twice
        held = self.ranks.on_main(lambda: RunLock.acquire(self.config.run.out))
        try:
            return self._train(start)
        finally:
            for lock in (held, self.lock):
                if lock is not None:
                    lock.release()

    def _train(self, start: int) -> list:
        from tqdm import tqdm

        out, main = Path(self.config.run.out), self.ranks.main
        if main:
            if start == 0 and self.config.run.overwrite and out.is_dir():
                checkpoint.check_run_directory(out, overwrite=True)  # still a run directory, as at start-up
                checkpoint.clear_run_directory(out)
            out.mkdir(parents=True, exist_ok=True)
            checkpoint.write_text_atomically(out / "config.json", json.dumps(self.config.flat(), indent=1))
            if start == 0:
                checkpoint.write_text_atomically(out / inputs.INPUTS_FILE, inputs.pinned(self.config.flat()))
            if start:  # drop rows past the checkpoint, from a run that went on after it
                for log in ("metrics.jsonl", "completions.jsonl"):
                    if log == "metrics.jsonl" or (out / log).is_file():
                        kept = checkpoint.metrics_before(out / log, start)
                        checkpoint.write_text_atomically(out / log, "".join(line + "\n" for line in kept))
        if main:
            print("\n".join(self.summary()), flush=True)
        history, stop, saved_at = [], Signals(), time.monotonic()
        board = _tensorboard(out) if main else None
        log = open(out / "metrics.jsonl", "a") if main else contextlib.nullcontext()
        with _stop_on_signals(stop), log, tqdm(range(start, self.config.run.iterations), desc="ppo", initial=start,
                                               total=self.config.run.iterations, disable=not main) as bar:
            def write(metrics):
                if main:
                    log.write(json.dumps(metrics) + "\n")
                    log.flush()
                if board is not None:
                    for key, value in metrics.items():
                        board.add_scalar(key, value, metrics["iteration"])

            def write_examples(iteration, examples):
                with open(out / "completions.jsonl", "a") as f:
                    f.writelines(json.dumps({"iteration": iteration, **row}) + "\n" for row in examples)
                if board is not None:
                    board.add_text("completions", "\n\n".join(
                        f"**score {row['score']:.3f}** {row['prompt']!r} -> {row['completion']!r}" for row in examples),
                        iteration)

            for i in bar:
                evaluated = self._timed_evaluation(i) if self._evaluates_before(i) else {}
                metrics = {**self.iteration(i), **evaluated}
                history.append(metrics)
                write(metrics)
                if main and self.examples:
                    write_examples(i, self.examples)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['approx_kl']:.4f}",
                                tok_s=f"{metrics['tokens_per_s_generated']:.0f}")
                run, done = self.config.run, i + 1
                due = main and run.save_every_minutes and time.monotonic() - saved_at >= 60 * run.save_every_minutes
                # any rank signalled: all stop together; rank 0's clock says when a save is due
                stopping, due = (bool(flag) for flag in self.ranks.sum(
                    torch.tensor([float(bool(stop)), float(due)], device=self.ranks.device())))
                if stopping or due or done == run.iterations or (run.save_every and done % run.save_every == 0):
                    self.checkpoint(out, done)
                    saved_at = time.monotonic()
                if stopping:
                    raise TrainingInterrupted(f"stopped by {stop[0] if stop else 'a signal to another rank'} after "
                                              f"iteration {i}; checkpoint-{done} is saved; "
                                              f"resume with: fastppo train --resume {out}")
            if self.steps and self.skipped_steps == self.steps:
                raise TrainingFailed(f"all {self.steps} optimizer steps were skipped for non-finite gradients: the "
                                     "policy never changed (look at the rewards, the learning rate and the loss "
                                     "coefficients)")
            if self.config.run.save:
                self.save(out)  # each part atomically, by rank 0
            if self.eval_prompts is not None:  # the trained policy, in a row of its own
                # everything is saved: a signal now stops the evaluation at once
                stop.at_once = (f"stopped during the final held-out evaluation; the trained policy and "
                                f"checkpoint-{self.config.run.iterations} are saved")
                write({"iteration": self.config.run.iterations, **self._timed_evaluation(self.config.run.iterations)})
        if board is not None:
            board.close()
        if main and plot.available():
            plot.plot_run(out)
        self.ranks.barrier()
        return history

    def summary(self) -> list:
        """What this run is, said before it starts: the model, the rewards, an iteration's shape, the
        first prompt as the sampler sees it, and the memory plan's total for one device."""
        from .models import DEFAULT_MODEL
        from .plan import GiB, memory_plan

        c, r = self.config, self.config.rollout
        trainable = sum(p.numel() for p in self.policy.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.policy.parameters())
        rewards = ", ".join(f"{name} x {weight:g}" for (name, _), weight in zip(self.rewards.named,
                                                                                 self.rewards.weights))
        plan = memory_plan(c, self.policy.config, prompt_tokens=self.longest_prompt, device_type=self.device.type,
                           world_size=self.ranks.world)
        return [f"model: {c.model.model or DEFAULT_MODEL}, {total:,} parameters ({trainable:,} trained); "
                f"{c.algo.estimator}, lr {c.optim.lr:g}; rewards: {rewards}",
                f"each iteration: {r.prompts_per_iteration} prompts x {r.samples_per_prompt} samples"
                + (f" x {self.ranks.world} ranks" if self.ranks.world > 1 else "")
                + f", up to {r.max_new_tokens} new tokens each, of {len(self.prompts)} prompts; the first, as the "
                f"sampler sees it: {self.prompts.texts[0]!r}",
                f"memory plan for one {self.device.type} device: "
                f"{sum(line.bytes for line in plan) / GiB:.2f} GiB (the lines: fastppo train --plan)"] + self._toy_defaults()

    def _toy_defaults(self) -> list:
        """A note when a run of a model of one's own keeps defaults chosen for the shipped toy task."""
        def tuned(config):
            return {"lr": config.optim.lr, "max_new_tokens": config.rollout.max_new_tokens}

        defaults = tuned(TrainConfig())
        kept = [f"{name} {value:g}" for name, value in tuned(self.config).items() if value == defaults[name]]
        if self.config.model.model is None or not kept:
            return []
        return [f"note: {' and '.join(kept)} are the defaults for the shipped tiny model's task; a pretrained model "
                "usually wants an lr near 1e-6 and room for hundreds of new tokens (--lr, --max-new-tokens)"]

    def _evaluates_before(self, iteration: int) -> bool:
        every = self.config.eval.eval_every
        return self.eval_prompts is not None and (iteration == 0 or (every and iteration % every == 0))

    def _timed_evaluation(self, iteration: int) -> dict:
        """:meth:`evaluate` with its wall time as ``time_eval``."""
        start = time.perf_counter()
        return {**self.evaluate(iteration), "time_eval": time.perf_counter() - start}

    def evaluate(self, iteration: int) -> dict:
        """The held-out metrics (``evaluation.py``) of the policy before ``iteration``, also kept in
        ``evaluations``."""
        metrics = evaluation.evaluate(self, self.eval_prompts, self.config.eval.eval_samples, iteration)
        self.evaluations.append({"iteration": iteration, **metrics})
        return metrics

    def checkpoint(self, out: Path, done: int) -> None:
        """``out/checkpoint-{done}`` from rank 0 (and every rank's shards), with every rank's random states."""
        rng = self.ranks.gather(checkpoint.rng_state(self))
        if self.sharded or self.ranks.main:  # sharded: every rank writes its shards
            checkpoint.save_atomically(out / f"checkpoint-{done}", lambda d: self.save_checkpoint(d, done, rng),
                                       self.ranks if self.sharded else None)
        if self.ranks.main:
            checkpoint.prune_checkpoints(out, self.config.run.keep_checkpoints)
        self.ranks.barrier()

    def save(self, out: Path, masters: bool = False) -> None:
        """The policy (and tokenizer) in Hugging Face format under ``out/policy``, the critic beside it;
        each written atomically. The policy's weights are in ``save_dtype``, or fp32 with ``masters``
        (a checkpoint). With LoRA ``policy/`` is the adapter in PEFT format, and with ``merge_lora``
        (not for a checkpoint) ``policy-merged/`` the model with the adapter merged in. Every rank
        calls it: a sharded model is gathered whole to rank 0, which alone writes."""
        dtype = torch.float32 if masters else self.precision.save
        gathered = {name: sharding.full_state_dict(model) if self.sharded else None
                    for name, model in (("policy", self.policy), ("critic", self.critic)) if model is not None}
        if not self.ranks.main:
            return

        def with_tokenizer(save):
            def write(directory):
                save(directory)
                self.tokenizer.save_pretrained(directory)
            return write

        if self.lora is None:
            checkpoint.save_atomically(Path(out) / "policy",
                                       with_tokenizer(lambda d: save_model(self.policy, d, dtype, gathered["policy"])))
        else:
            checkpoint.save_atomically(Path(out) / "policy",
                                       with_tokenizer(lambda d: self.lora.save_adapter(d, gathered["policy"])))
            if self.config.lora.merge_lora and not masters:
                checkpoint.save_atomically(Path(out) / "policy-merged",
                                           with_tokenizer(lambda d: self.lora.save_merged(d, dtype, gathered["policy"])))
        if self.critic is not None:
            checkpoint.save_atomically(Path(out) / "critic", lambda d: self.critic.save_pretrained(d, gathered["critic"]))

    # checkpoints and resume (the details: checkpoint.py) ---------------------------------------

    def save_checkpoint(self, directory: Path, next_iteration: int, rng: list = None) -> None:
        """Models and every state the next iteration depends on, into ``directory``."""
        checkpoint.save_state(self, directory, next_iteration, rng)

    def load_checkpoint(self, directory: Path) -> int:
        """Load what :meth:`save_checkpoint` wrote; return the iteration to continue at."""
        return checkpoint.load_state(self, directory)

    @classmethod
    def resume(cls, run_dir, overrides: dict = None) -> tuple:
        """``(trainer, next iteration)`` from the newest verified checkpoint of ``run_dir``; see
        :func:`fastppo.trainer.checkpoint.resume`."""
        return checkpoint.resume(cls, run_dir, overrides)


class TrainingInterrupted(SystemExit):
    """Raised after a SIGINT or SIGTERM once the current iteration is checkpointed; exits non-zero."""


class StoppedAtOnce(KeyboardInterrupt):
    """A signal the run could not wait for: it stops where it is."""


class Signals(list):
    """The names of the SIGINTs and SIGTERMs a run received. Normally the run finishes its
    iteration and checkpoints; a second signal, or any once ``at_once`` says why nothing is left
    to save, stops it at once (a reward function that hangs must not need kill -9)."""

    at_once = None  # the message to stop at once with


@contextlib.contextmanager
def _stop_on_signals(stop: Signals):
    """While active, SIGINT and SIGTERM append their name to ``stop`` instead of killing the run,
    or stop it at once (see :class:`Signals`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(number, _frame):
        stop.append(signal.Signals(number).name)
        if stop.at_once:
            raise StoppedAtOnce(f"{stop.at_once} ({stop[-1]})")
        if len(stop) > 1:
            raise StoppedAtOnce(f"stopped at once by a second signal ({' then '.join(stop)}), without a checkpoint; "
                                "the newest checkpoint is intact")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
