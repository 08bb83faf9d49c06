"""pytest-benchmark: the phases of one PPO iteration of the shipped tiny model."""

FAMILIES = ("trainer",)


def test_trainer(bench_case, run_bench_case):
    run_bench_case(bench_case)
