#!/usr/bin/env bash
# The whole GPU check in one command, for a CUDA machine with torch, triton, transformers, pytest
# and pytest-benchmark already installed and no network: it installs only this repository (no
# dependencies, no downloads), prints the GPU, runs the kernel check (bench/kernel_check.py, in the
# order of what it settles: the copy bandwidth and DRAM latency the roofline model assumes, each
# kernel's share of a copy next to what `fastppo bench --sass` predicts on this machine, then the
# float64 oracles at full size, past 2**31 elements, misaligned and odd vocabularies, peaked rows
# and a chi-square of the sampler's draws, an occupancy sweep, the op from hidden states against
# its bare matmuls, the sampler's decode attention over the paged KV cache against the static one), the GPU tests and the op and kernel tests with the compiled kernels, and the
# full bench, and writes into OUT_DIR (default bench/results/), each file as soon as it is known:
#   gpu.txt            the GPU, driver and library versions
#   kernel_check.md    the kernel check's table, rewritten after each section (kernel_check.jsonl:
#                      one JSON line per check)
#   tests.log          the tests' output
#   results.json       every bench row and the machine
#   results.md         the bench tables, printed again last
# Peers: the GPU image has no Liger-Kernel or TRL and no network. bash bench/fetch_peer_wheels.sh,
# run beforehand where the index is reachable, leaves their wheels in bench/wheels/ (carry that
# folder to the GPU machine); they are installed into a temporary folder after the tests, so the
# bench measures them side by side, and their versions go into gpu.txt. Without the folder the
# peers' rows say "not installed".
# Usage: bash bench/gpu_check.sh [OUT_DIR]      Budget: its time limits add up to 9 minutes.
# A dry run without a GPU (the kernel check in the interpreter at toy shapes, the GPU tests skipped):
#   TRITON_INTERPRET=1 GPU_CHECK_DRY=1 GPU_CHECK_BENCH_ARGS="--device cpu --quick" bash bench/gpu_check.sh /tmp/out
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-bench/results}" && cd "${1:-bench/results}" && pwd)
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

$python -m pip install --no-deps --no-build-isolation --no-index -q -e . >"$out/install.log" 2>&1 \
  || { cat "$out/install.log"; echo "gpu_check: installing the repository failed"; exit 1; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $python -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.version.cuda)"
  $python -c "import importlib.metadata as m; print('flash-attn', m.version('flash-attn'))" 2>/dev/null \
    || echo "flash-attn not installed (the sampler decodes with SDPA; its flash tests skip)"
  git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /'
} 2>&1 | tee "$out/gpu.txt"

echo "== kernel check (bandwidth against a copy and the model, then float64 oracles at full size) =="
# Its sections skip themselves past its own 240 s budget; the timeout is the backstop.
if [ -n "${GPU_CHECK_DRY:-}" ]; then kernel_args=(--dry --budget-s 900); else kernel_args=(--budget-s 240); fi
TRITON_DEFAULT_FP_FUSION=1 timeout 270 $python bench/kernel_check.py "$out" "${kernel_args[@]}" >"$out/kernel_check.log" 2>&1
kernel_rc=$?
tail -n 1 "$out/kernel_check.log"
[ -f "$out/kernel_check.md" ] && cat "$out/kernel_check.md"

echo "== tests (compiled kernels) =="
# In a dry run the same tests run in the interpreter, which takes minutes on a small CPU.
op_tests_s=110; [ -n "${GPU_CHECK_DRY:-}" ] && op_tests_s=900
{
  timeout 60 $python -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1
  echo "gpu tests exit $?"
  timeout $op_tests_s $python -m pytest -q -p no:cacheprovider -x tests/ops tests/kernels 2>&1
  echo "op and kernel tests exit $?"
} | tee "$out/tests.log" | grep -E "passed|failed|skipped|error|exit" | tail -n 8
tests_rc=$(grep -c "tests exit [^0]" "$out/tests.log")

if compgen -G "bench/wheels/*.whl" >/dev/null; then
  peers=$(mktemp -d)
  if $python -m pip install -q --no-index --no-deps --no-compile --target "$peers" bench/wheels/*.whl >>"$out/install.log" 2>&1; then
    export PYTHONPATH="$peers${PYTHONPATH:+:$PYTHONPATH}"
    $python -c "import importlib.metadata as m; print('peers: liger-kernel', m.version('liger-kernel'), '| trl', m.version('trl'))" \
      2>&1 | tee -a "$out/gpu.txt"
  else
    echo "gpu_check: the carried peer wheels did not install (install.log)" | tee -a "$out/gpu.txt"
  fi
else
  echo "no peer wheels in bench/wheels (bash bench/fetch_peer_wheels.sh): Liger and TRL rows say not installed" \
    | tee -a "$out/gpu.txt"
fi

echo "== bench (full shapes) =="
# shellcheck disable=SC2086  (the arguments are meant to split)
timeout 90 $python -m fastppo bench ${GPU_CHECK_BENCH_ARGS:---device cuda --time-budget 70} \
  --json "$out/results.json" --markdown "$out/results.md" >"$out/bench.log" 2>&1
bench_rc=$?
if [ $bench_rc -eq 0 ]; then rm -f "$out/bench.log"; else tail -n 30 "$out/bench.log"; fi

[ -f "$out/results.md" ] && cat "$out/results.md"
echo "gpu_check: kernel check exit $kernel_rc, failed test runs $tests_rc, bench exit $bench_rc"
[ $kernel_rc -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ $bench_rc -eq 0 ]
