"""pytest-benchmark: the PPO policy loss, from logits and from token log-probs, beside naive PyTorch,
torch.compile and peers."""

FAMILIES = ("ppo_loss", "ppo_loss_hidden", "ppo_loss_tokens")


def test_ppo_loss(bench_case, run_bench_case):
    run_bench_case(bench_case)
