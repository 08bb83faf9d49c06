"""pytest-benchmark: the KV-cached sampler beside Hugging Face generate()."""

FAMILIES = ("sampler",)


def test_sampler(bench_case, run_bench_case):
    run_bench_case(bench_case)
