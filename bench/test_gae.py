"""pytest-benchmark: GAE and masked whitening, beside naive PyTorch, torch.compile and peers."""

FAMILIES = ("gae", "whiten")


def test_gae(bench_case, run_bench_case):
    run_bench_case(bench_case)
