"""The machine's limits (``fastppo/bench/phase_limits.py``): measured rates, and the least time of a phase's work."""

import torch

from fastppo.bench import phase_limits
from fastppo.machine import cpu_name

from ..rollout.models import tiny


def test_the_rates_are_measured_and_the_cpu_named():
    measured = phase_limits.measure(torch.device("cpu"), read_bytes=1 << 20, matmul=64)
    assert set(measured.matmul_flops) == {"float32", "bfloat16"} and min(measured.matmul_flops.values()) > 0
    assert measured.read_bytes_per_s > 0 and measured.read_buffer == 1 << 20
    assert measured.machine == cpu_name() and "cores" in measured.machine
    assert f"This machine's limits: {measured.machine}" in phase_limits.markdown(measured)


def test_a_rollout_limit_is_its_bytes_or_its_flops_whichever_is_larger_plus_the_prefill():
    model = tiny("llama")  # 2 layers of hidden 32, 2 KV heads of 8; LM head 97 x 32
    params = 2 * (32 * 32 * 2 + 16 * 32 * 2 + 64 * 32 * 3) + 97 * 32
    assert phase_limits.matrix_parameters(model) == params
    kv = phase_limits.kv_bytes_per_position(model, torch.float32)
    assert kv == 2 * 2 * 16 * 4
    slow_read = phase_limits.MachineLimits("m", {"float32": 1e12}, read_bytes_per_s=1e3, read_buffer=0)
    # two rows of prompts 3 and 5, 4 and 2 tokens, in 8 slots: 4 steps, each row's keys read per step
    kv_read = kv * (3 * 4 + 6) + kv * (5 * 2 + 1)
    expected = (4 * params * 4 + kv_read) / 1e3 + 2 * params * 8 / 1e12
    assert abs(phase_limits.rollout_seconds(slow_read, model, torch.float32, [3, 5], [4, 2], 8, 8) - expected) < 1e-12
    slow_math = phase_limits.MachineLimits("m", {"float32": 1e3}, read_bytes_per_s=1e15, read_buffer=0)
    expected = 2 * params * 6 / 1e3 + 2 * params * 8 / 1e3
    assert abs(phase_limits.rollout_seconds(slow_math, model, torch.float32, [3, 5], [4, 2], 8, 8) - expected) < 1e-9
    # one slot: the rows' 6 tokens take 6 steps
    one_slot = phase_limits.rollout_seconds(slow_read, model, torch.float32, [3, 5], [4, 2], 1, 8)
    assert abs(one_slot - ((6 * params * 4 + kv_read) / 1e3 + 2 * params * 8 / 1e12)) < 1e-12
    assert phase_limits.update_seconds(slow_math, model, torch.float32, 10) == 6 * params * 10 / 1e3


def test_a_dtype_too_slow_here_is_timed_on_a_smaller_product_and_its_rate_kept_to_two_figures(monkeypatch):
    monkeypatch.setattr(phase_limits, "MATMUL_SECONDS", 0.0)  # every dtype too slow for a product past the probe
    measured = phase_limits.measure(torch.device("cpu"), read_bytes=1 << 20, matmul=phase_limits.MATMUL)
    assert measured.matmul_sizes == {"float32": phase_limits.MATMUL_PROBE, "bfloat16": phase_limits.MATMUL_PROBE}
    assert f"| float32 matmul ({phase_limits.MATMUL_PROBE}^3) |" in phase_limits.markdown(measured)
    monkeypatch.setattr(phase_limits, "MATMUL_SECONDS", 1e9)  # and fast enough for the largest asked for
    assert phase_limits.measure(torch.device("cpu"), read_bytes=1 << 20, matmul=512).matmul_sizes["float32"] == 512
    assert phase_limits.gflops(3.3e8) == "0.33 GFLOP/s" and phase_limits.gflops(1.25e11) == "125 GFLOP/s"
