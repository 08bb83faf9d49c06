"""pytest-benchmark: linear_token_logprobs from hidden states and the LM head, beside naive PyTorch, torch.compile and peers."""

FAMILIES = ("linear_logprobs",)


def test_linear_logprobs(bench_case, run_bench_case):
    run_bench_case(bench_case)
