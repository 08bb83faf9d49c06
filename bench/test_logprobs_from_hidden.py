"""pytest-benchmark: token_logprobs_from_hidden from hidden states and the LM head, beside naive PyTorch,
torch.compile and peers."""

FAMILIES = ("logprobs_from_hidden",)


def test_logprobs_from_hidden(bench_case, run_bench_case):
    run_bench_case(bench_case)
