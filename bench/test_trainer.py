"""pytest-benchmark: the phases of one PPO iteration, and whole iterations under each trainer option."""

FAMILIES = ("trainer", "trainer_options")


def test_trainer(bench_case, run_bench_case):
    run_bench_case(bench_case)
