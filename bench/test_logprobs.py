"""pytest-benchmark: token_logprobs from logits, beside naive PyTorch, torch.compile and peers."""

FAMILIES = ("logprobs",)


def test_logprobs(bench_case, run_bench_case):
    run_bench_case(bench_case)
