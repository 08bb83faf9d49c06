"""Memory layouts the kernels share with their PyTorch twins, in a module that imports no triton.

The twins run where triton is not installed (a CPU-only machine), so what both sides must agree
on lives here, once, and the kernels derive their constants from it.
"""

# The columns of the PPO loss's per-program partial sums, in the order both implementations
# store them: a (programs, len(PARTIALS)) fp32 tensor that ``fastppo.ops.ppo_loss`` sums.
PARTIALS = ("pg", "kl", "entropy", "clipped", "half_lr_sq", "ratio", "ratio_max", "dual_clipped", "count")
