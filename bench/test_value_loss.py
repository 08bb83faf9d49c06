"""pytest-benchmark: the clipped value loss, beside naive PyTorch, torch.compile and peers."""

FAMILIES = ("value_loss",)


def test_value_loss(bench_case, run_bench_case):
    run_bench_case(bench_case)
