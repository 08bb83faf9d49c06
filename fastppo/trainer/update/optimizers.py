"""The policy's and the critic's AdamW, their learning-rate schedule, and the optimizer step with
its guard: gradients clipped by their global norm, a step with a non-finite gradient skipped
and counted rather than let poison the weights, and a step that made them non-finite anyway the
end of the run."""

import math
import warnings

import torch

from ...errors import TrainingFailed


def adamw(params: list, lr: float) -> torch.optim.AdamW:
    """AdamW with torch's defaults, fused (one kernel over every tensor on CUDA and on the CPU;
    the per-tensor loop it replaces cost 0.6 s of a 135M model's step on a 2-core CPU) when
    every parameter is fp32 and on one device type, as the master weights are."""
    fused = len({p.device.type for p in params}) == 1 and all(p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(params, lr=lr, fused=fused)


def lr_factor(iteration: int, optim, iterations: int) -> float:
    """Linear warm-up, then constant or cosine decay to 0 at the last iteration."""
    if iteration < optim.warmup_iterations:
        return (iteration + 1) / optim.warmup_iterations
    if optim.lr_schedule == "constant":
        return 1.0
    progress = (iteration - optim.warmup_iterations) / max(iterations - optim.warmup_iterations, 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


class Optimizers:
    """The policy's trainable parameters' AdamW and, with a critic, the critic's, each with the
    schedule of ``optim`` over ``iterations``."""

    def __init__(self, policy, critic, optim, iterations: int):
        self.optim = optim
        self.policy = adamw([p for p in policy.parameters() if p.requires_grad], optim.lr)
        self.critic = adamw(list(critic.parameters()), optim.critic_lr) if critic is not None else None
        self.schedules = [
            torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, optim, iterations)) for opt in self.each()
        ]

    def each(self) -> list:
        return [o for o in (self.policy, self.critic) if o is not None]

    def params(self) -> list:
        return [p for opt in self.each() for group in opt.param_groups for p in group["params"]]

    @property
    def lr(self) -> float:
        """The policy's current learning rate."""
        return self.policy.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        for opt in self.each():
            opt.zero_grad(set_to_none=True)

    def step(self, state) -> None:
        """Clip the gradients to ``max_grad_norm`` and step, counting it in ``state``; skip (and
        count, and warn) a step whose gradient is not finite. A step that leaves a weight
        non-finite (a finite gradient times an absurd learning rate) ends the run: its weights
        are never saved, and the checkpoints before it stand. That check is one more pass over
        the weights per step, a reduction, beside AdamW's several."""
        params = self.params()
        norm = _total_norm([p.grad for p in params if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_(params, self.optim.max_grad_norm, norm)
        state.steps += 1
        if not torch.isfinite(norm):
            state.skipped_steps += 1
            warnings.warn(
                f"optimizer step {state.steps} skipped: the gradient is not finite "
                f"({state.skipped_steps} skipped so far)"
            )
            return
        for opt in self.each():
            opt.step()
        if not torch.isfinite(_total_norm(params)):
            raise TrainingFailed(
                f"optimizer step {state.steps} made the weights non-finite (policy learning rate "
                f"{self.lr:.3g}); nothing from it is saved"
            )

    def next_iteration(self) -> None:
        """Move the learning rates on to the next iteration's."""
        for schedule in self.schedules:
            schedule.step()

    def restore_schedules(self, states: list) -> None:
        """Load the schedules' saved states; the current rate is recomputed, since a resumed run
        that trains longer stretches a cosine schedule."""
        for schedule, saved in zip(self.schedules, states):
            schedule.load_state_dict(saved)
            for group, base, factor in zip(schedule.optimizer.param_groups, schedule.base_lrs, schedule.lr_lambdas):
                group["lr"] = base * factor(schedule.last_epoch)


def _total_norm(tensors: list) -> torch.Tensor:
    """The 2-norm of ``tensors`` together, 0-dim; over every rank's shard for sharded ones."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm(tensors)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm  # the squares summed over ranks
