"""pytest-benchmark front end of the bench suite: ``pytest bench/`` times the quick shapes on this
machine's best device, ``pytest bench/ --full`` the full ones. ``fastppo bench`` runs the same cases
and prints the side-by-side tables; use it for reports, and this for pytest-benchmark's history
and comparisons (``--benchmark-autosave``, ``--benchmark-compare``).

Each ``bench/test_*.py`` names its op families in ``FAMILIES``; every (shape, contender, pass)
becomes one benchmark. Contenders that are not available here are skipped with their reason.
"""

import pytest
import torch

from fastppo.bench.runner import FAMILIES, make_call

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="full shapes (for a GPU) instead of --quick ones")


def pytest_generate_tests(metafunc):
    if "bench_case" not in metafunc.fixturenames:
        return
    quick = not metafunc.config.getoption("--full")
    params = []
    for op in metafunc.module.FAMILIES:
        for case in FAMILIES[op](DEVICE, quick):
            for mode in ("fwd", "fwd+bwd") if case.bytes_fwd_bwd else ("fwd",):
                for contender in case.contenders:
                    params.append(
                        pytest.param(
                            (case, contender, mode), id=f"{op}-{case.label}-{contender.name}-{mode}".replace(" ", "_")
                        )
                    )
    metafunc.parametrize("bench_case", params)


_inputs = {}  # the inputs of the case being timed: one case's at a time, so large shapes fit


@pytest.fixture
def run_bench_case(benchmark):
    def run(bench_case):
        case, contender, mode = bench_case
        if contender.fn is None:
            pytest.skip(contender.status)
        if _inputs.get("case") is not case:
            _inputs.clear()
            _inputs.update(case=case, inputs=case.make_inputs())
        call = make_call(contender.fn, _inputs["inputs"], mode, case.grad_inputs)

        def timed():
            call()
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()

        benchmark.extra_info.update(
            op=case.op,
            shape=case.label,
            contender=contender.name,
            mode=mode,
            bytes=case.bytes_fwd if mode == "fwd" else case.bytes_fwd_bwd,
        )
        benchmark.pedantic(timed, warmup_rounds=1, rounds=10, iterations=1)

    return run
