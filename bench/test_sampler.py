"""pytest-benchmark: the KV-cached sampler beside Hugging Face generate(), and the token draw alone."""

FAMILIES = ("sampler", "sampling")


def test_sampler(bench_case, run_bench_case):
    run_bench_case(bench_case)
