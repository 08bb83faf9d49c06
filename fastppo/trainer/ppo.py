"""The PPO loop, top-down: rollout -> prepare -> update -> log.

``train`` runs iterations; an ``iteration`` is rollout -> prepare -> update -> log, each a call
with explicit inputs and outputs.

* **rollout** (``experience/rollouts.py``): the next prompts of the epoch order, sampled on the
  live weights (a bf16 copy on CUDA, refreshed in place) and scored by the rewards;
* **prepare** (``update/batch.py``): prompt + response rows laid out, no-grad passes for the
  reference log-probs, the values, and the old log-probs unless the update is exactly on-policy
  (then they are the update's own, detached), and the advantages of the estimator
  (``update/estimators.py``);
* **update**: ``ppo_epochs`` passes of minibatch steps, each minibatch's loss the fused PPO loss
  from hidden states plus the value loss (``update/loss.py``), the optimizer step guarded
  (``update/optimizers.py``);
* **log**: one metrics row (``run/log.py``), the held-out evaluation when due
  (``experience/evaluation.py``), checkpoints by count and by the clock (``run/checkpoint.py``).

The models, rewards and agent are built by ``build.py``; what changes between iterations is one
``TrainerState`` (``run/state.py``), which checkpoints save and load. The details that trip
trainers up are explicit: dropout is off in every model; the rollout temperature is used again
when log-probs are recomputed; the stop token is part of the response and its mask; pad and stop tokens are told
apart by the mask, not by their ids; old log-probs' mismatch with the sampler's is reported (and
optionally corrected by truncated importance weights); a step with a non-finite gradient is
skipped and counted, and a run whose every step was skipped fails.
"""

import time
import warnings
from pathlib import Path

import torch

from ..errors import UsageError
from ..rewards.loading import load_reward
from ..rewards.model import RewardModel
from .build import build_models, configured_agent, configured_rewards
from .configuration.config import TrainConfig
from .experience import evaluation
from .experience.rollouts import Rollouts
from .experience.sampled import Scored
from .experience.streaming import resume_in_flight
from .memory.plan import device_memory, fitting_microbatch, kv_memory
from .modeling.loading import context_length
from .parallel.distributed import Ranks
from .prompts import dataset
from .prompts.chat import read_chat_template
from .run import checkpoint, inputs
from .run import directory as run_directory
from .run.lock import RunLock
from .run.log import RunLog, iteration_metrics, postfix, progress, start_run_directory
from .run.signals import Signals, TrainingInterrupted, stop_on_signals
from .run.state import TrainerState, random_states
from .run.summaries import start_summary
from .update.batch import Batch, explained_variance, forward_parts, lay_out, loss_mask, prepare, warn_truncated
from .update.loss import minibatch_loss, step_normalisers, step_stats
from .update.optimizers import Optimizers
from .update.probe import check_shared_prefix


class PPOTrainer:
    def __init__(
        self, config: TrainConfig, policy=None, tokenizer=None, reward_fn=None, prompts=None, *, resuming: bool = False
    ):
        """``resuming`` is for :meth:`resume`: the run directory then holds the run being continued."""
        if not resuming:  # the paths as they are from here, whatever directory a resume runs in
            config = TrainConfig.from_flat(inputs.resolved(config.flat()))
        self.config = config
        config.check_device_here()
        torch.manual_seed(config.run.seed)
        self.ranks = Ranks(torch.device(config.device).type)
        # the tools and the environment, imported and checked before the model loads
        self.agent = configured_agent(config.tools) if config.episodes else None
        environment_rewards = self.agent is not None and self.agent.environment_rewards
        given = reward_fn is not None or config.reward.reward or config.reward.reward_model or environment_rewards
        if config.data.prompts and not given:
            raise UsageError(
                "--prompts needs --reward (or --reward-model, or an --environment with get_reward): the "
                "task's reward does not know your prompts"
            )
        # before any loading (a run that cannot write loses no time) and before touching the directory
        self.lock = self.ranks.on_main(lambda: run_directory.claim_run_directory(config.run, resuming))
        # what the user wrote, read before the model loads: a wrong file or reward costs no wait
        sources = dataset.sources(config, prompts)
        if reward_fn is None:
            for spec in config.reward.reward or ():
                load_reward(spec, config.reward.format_pattern)
        if not self.ranks.main:  # rank 0's loading and saving progress bars are enough
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
        self.models = models = build_models(config, self.ranks, policy, tokenizer)
        if self.agent is not None:
            template = read_chat_template(config.data.chat_template)
            self.agent.use(models.tokenizer, template, models.tokenizer.eos_token_id)
        schemas = self.agent and self.agent.schemas_of
        context = context_length(models.policy)
        prompts, self.eval_prompts = dataset.configured(config, models.tokenizer, context, sources, schemas)
        every = [p for p in (prompts, self.eval_prompts) if p is not None]
        fields = list(dict.fromkeys(k for p in every for k in p.field_names()))  # each reward call gets all
        rewards = configured_rewards(
            config,
            reward_fn,
            lambda path: RewardModel(path, models.device, models.precision.frozen),
            self.agent.environment.named_rewards() if environment_rewards else [],
        )
        for loaded in every:
            rewards.check_fields(loaded.fields, loaded.origins)
        self.longest_prompt = max(len(ids) for p in every for ids in p.ids)
        models.shared_prefix, models.padded_because = check_shared_prefix(
            models, config.model.shared_prefix, self.longest_prompt + config.response_tokens, self.ranks
        )
        if config.algo.max_tokens_per_microbatch is None and models.device.type == "cuda":  # what fits, if needed
            config.algo.max_tokens_per_microbatch = fitting_microbatch(
                config,
                models.policy.config,
                prompt_tokens=self.longest_prompt,
                device_type="cuda",
                available=device_memory("cuda"),
                world_size=self.ranks.world,
            )
        kv = kv_memory(
            config,
            models.policy.config,
            prompt_tokens=self.longest_prompt,
            device_type=models.device.type,
            available=device_memory(models.device.type),
            world_size=self.ranks.world,
        )
        self.rollouts = Rollouts(
            config, models, rewards, prompts, fields, self.ranks, self.longest_prompt, self.agent, kv_memory=kv
        )
        self.optimizers = Optimizers(models.policy, models.critic, config.optim, config.run.iterations)
        self.state = TrainerState(kl_coef=config.algo.kl_coef)
        self.evaluations = []  # {"iteration", held-out metrics} of each evaluation
        self.examples = []  # the last iteration's rows as text, for completions.jsonl

    # the models and the training prompts, by their usual names
    prompts = property(lambda self: self.rollouts.prompts)
    policy = property(lambda self: self.models.policy)
    critic = property(lambda self: self.models.critic)
    tokenizer = property(lambda self: self.models.tokenizer)
    device = property(lambda self: self.models.device)

    # the run -----------------------------------------------------------------------------------

    def train(self, start: int = 0) -> list:
        """Iterations ``start`` .. ``iterations - 1``; SIGINT or SIGTERM ends the current iteration,
        writes a checkpoint and raises :class:`TrainingInterrupted` saying how to resume. With
        several ranks, rank 0 alone writes. The run directory's lock is let go when it returns."""
        run, out, main = self.config.run, Path(self.config.run.out), self.ranks.main
        held = self.ranks.on_main(lambda: RunLock.acquire(out))  # again, for a trainer that trains twice
        try:
            if main:
                start_run_directory(out, self.config, start)
                lines = start_summary(self.config, self.models, self.rollouts, self.longest_prompt, self.ranks.world)
                print(*lines, sep="\n", flush=True)
            history, stop, saved_at = [], Signals(), time.monotonic()
            with stop_on_signals(stop), RunLog(out, main) as log, progress(start, run.iterations, main) as bar:
                for i in bar:
                    evaluated = self.evaluate(i) if evaluation.due(self.config.eval, i, self.eval_prompts) else {}
                    metrics = {**self.iteration(i), **evaluated}
                    history.append(metrics)
                    log.write(metrics)
                    log.write_examples(i, self.examples)
                    bar.set_postfix_str(postfix(metrics))
                    due = main and run.save_every_minutes and time.monotonic() - saved_at >= 60 * run.save_every_minutes
                    # any rank signalled: all stop together; rank 0's clock says when a save is due
                    flags = self.ranks.sum(torch.tensor([float(bool(stop)), float(due)], device=self.ranks.device()))
                    stopping, due = bool(flags[0]), bool(flags[1])
                    if stopping or due or i + 1 == run.iterations or (run.save_every and (i + 1) % run.save_every == 0):
                        self.checkpoint(out, i + 1)
                        saved_at = time.monotonic()
                    if stopping:
                        raise TrainingInterrupted(
                            f"stopped by {stop[0] if stop else 'a signal to another rank'} "
                            f"after iteration {i}; checkpoint-{i + 1} is saved; resume with: "
                            f"fastppo train --resume {out}"
                        )
                self.state.check_trained()
                if run.save:
                    self.save(out)
                if self.eval_prompts is not None:  # the trained policy, in a row of its own
                    # everything is saved: a signal now stops at once
                    saved = f"the trained policy and checkpoint-{run.iterations} are saved"
                    stop.at_once = f"stopped during the final held-out evaluation; {saved}"
                    log.write({"iteration": run.iterations, **self.evaluate(run.iterations)})
            log.plot()
            self.ranks.barrier()
            return history
        finally:
            for lock in (held, self.lock):
                if lock is not None:
                    lock.release()

    def iteration(self, iteration: int) -> dict:
        """One iteration: rollout -> prepare -> update -> the KL coefficient adapted; its metrics."""
        clock = [time.perf_counter()]
        lr, kl_coef = self.optimizers.lr, self.state.kl_coef  # this iteration's
        scored = self.rollout(iteration)
        clock.append(time.perf_counter())
        self.examples = self.rollouts.examples(scored, self.config.run.log_completions) if self.ranks.main else []
        batch = self.prepare(scored.rollout, scored.scores)
        clock.append(time.perf_counter())
        stats = self.update(batch, iteration)  # after it, old_logprobs are set either way
        if batch.ref_logprobs is not None:
            kl_sum = self.ranks.sum(((batch.old_logprobs - batch.ref_logprobs) * batch.mask).sum())
            rollout_kl = float(kl_sum / self.ranks.sum(batch.mask.sum()).clamp(min=1))
            a = self.config.algo
            self.state.adapt_kl(rollout_kl, batch.mask.shape[0] * self.ranks.world, a.kl_target, a.kl_horizon)
            stats.update(rollout_kl=rollout_kl, kl_coef=kl_coef)
        if batch.values is not None:
            stats["explained_variance"] = explained_variance(batch.values, batch.returns, batch.mask)
        self.optimizers.next_iteration()
        clock.append(time.perf_counter())
        return self.ranks.mean_of(
            iteration_metrics(iteration, scored, batch, stats, lr, clock, self.state, self.ranks.world)
        )

    def rollout(self, iteration: int) -> Scored:
        """This iteration's prompts, responses and scores (``rollouts.py``)."""
        return self.rollouts.next_batch(iteration, self.state)

    def prepare(self, rollout, scores: torch.Tensor) -> Batch:
        """The rollout laid out for the update, with old and reference log-probs, values and
        advantages (``batch.py``). With ``mask_truncated``, a response that hit max_new_tokens keeps
        its score in its group's baseline but has no token in the loss."""
        c = self.config
        mask, truncated = loss_mask(rollout, c.algo.mask_truncated)
        if truncated > 0.5 and not self.state.warned_truncated and self.ranks.main:
            self.state.warned_truncated = True
            warn_truncated(truncated, c.rollout.max_new_tokens)
        batch = lay_out(rollout, mask, self.tokenizer.pad_token_id, self.device)
        return prepare(batch, scores, self.models, c, self.state.kl_coef, self.ranks)

    def update(self, batch: Batch, iteration: int) -> dict:
        """``ppo_epochs`` passes of minibatch steps over ``batch``, the rollout of ``iteration``
        (which, with the run's seed, orders its minibatches); without old log-probs (the update is
        exactly on-policy) each minibatch's are its own forward's, written into ``batch``."""
        a, models = self.config.algo, self.models
        for model in models.trained():
            model.train()  # dropout is off; this is for gradient checkpointing, which needs it
        on_policy = batch.old_logprobs is None
        if on_policy:
            batch.old_logprobs = torch.zeros_like(batch.sampler_logprobs)
        logs = []  # one per optimizer step
        order = torch.Generator().manual_seed(self.config.run.seed * 100_003 + iteration)
        for _ in range(a.ppo_epochs):
            minibatches = batch.minibatches(a.minibatches, order)
            for first in range(0, len(minibatches), a.grad_accumulation):
                # the step's minibatches, each in micro-batches of at most max_tokens_per_microbatch
                indices = [
                    index[part]
                    for index in minibatches[first : first + a.grad_accumulation]
                    for part in forward_parts(batch.rows(index), models, self.config, self.ranks)
                ]
                group = [batch.rows(index) for index in indices]
                tokens, whole = step_normalisers(group, self.config, self.ranks)
                self.optimizers.zero_grad()
                parts = []
                for index, mb in zip(indices, group):
                    loss, stats = minibatch_loss(mb, models, self.config, self.state.kl_coef, tokens, on_policy, whole)
                    loss.backward()
                    if on_policy:
                        batch.old_logprobs[index] = mb.old_logprobs
                    parts.append(stats)
                logs.append(step_stats(parts, self.config.agg, self.ranks))
                if not models.sharded:  # FSDP's backward has reduce-scattered them
                    self.ranks.sum_gradients(self.optimizers.params())
                self.optimizers.step(self.state)
        for model in models.trained():
            model.eval()
        return {k: sum(log[k] for log in logs) / len(logs) for k in logs[0]}

    # evaluation and checkpoints ----------------------------------------------------------------

    def evaluate(self, iteration: int) -> dict:
        """The held-out metrics (``evaluation.py``) of the policy before ``iteration``, also kept in
        ``evaluations``, and the evaluation's wall time as ``time_eval``."""
        start = time.perf_counter()
        metrics = evaluation.evaluate(self.rollouts, self.eval_prompts, self.config.eval.eval_samples, iteration)
        self.evaluations.append({"iteration": iteration, **metrics})
        return {**metrics, "time_eval": time.perf_counter() - start}

    def checkpoint(self, out: Path, done: int) -> None:
        """``out/checkpoint-{done}`` from rank 0 (and every rank's shards), with every rank's random
        states; the oldest pruned beyond ``keep_checkpoints``."""
        rng = self.ranks.gather(random_states(self.device))
        streaming = self.rollouts.streaming
        in_flight = None if streaming is None else self.ranks.gather(streaming.state_dict())
        if self.models.sharded or self.ranks.main:  # sharded: every rank writes its shards
            writers = self.ranks if self.models.sharded else None
            run_directory.save_atomically(
                out / f"checkpoint-{done}", lambda d: self.save_checkpoint(d, done, rng, in_flight), writers
            )
        if self.ranks.main:
            run_directory.prune_checkpoints(out, self.config.run.keep_checkpoints)
        self.ranks.barrier()

    def save(self, out: Path) -> None:
        """The policy in ``save_dtype`` (with ``merge_lora`` also merged) and the critic, in Hugging
        Face format under ``out`` (``checkpoint.save_models``). Every rank calls it."""
        dtype = self.models.precision.save
        checkpoint.save_models(Path(out), self.models, self.ranks, dtype, self.config.lora.merge_lora)

    def save_checkpoint(self, directory: Path, next_iteration: int, rng: list = None, in_flight: list = None) -> None:
        """Models, optimizers, the trainer state and the rollouts in flight into ``directory``
        (``checkpoint.py``)."""
        rng = rng or [random_states(self.device)]
        if in_flight is None and self.rollouts.streaming is not None:
            in_flight = [self.rollouts.streaming.state_dict()]
        models, optimizers, state, ranks = self.models, self.optimizers, self.state, self.ranks
        checkpoint.save_state(directory, next_iteration, models, optimizers, state, ranks, rng, in_flight)

    def load_checkpoint(self, directory: Path) -> int:
        """Load what :meth:`save_checkpoint` wrote; return the iteration to continue at."""
        self.state, next_iteration, in_flight = checkpoint.load_state(
            directory, self.models, self.optimizers, self.ranks
        )
        resume_in_flight(in_flight, self.rollouts)
        return next_iteration

    @classmethod
    def resume(cls, run_dir, overrides: dict = None) -> tuple:
        """``(trainer, next iteration)`` from the newest verified checkpoint of ``run_dir``; see
        :func:`fastppo.trainer.run.checkpoint.resumable`."""
        config, checkpoints, inexact = checkpoint.resumable(run_dir, overrides)
        trainer = cls(config, resuming=True)
        for note in inexact:  # the changed values run: say what they change
            warnings.warn(note)
        return trainer, checkpoint.load_newest(checkpoints, trainer.load_checkpoint)
