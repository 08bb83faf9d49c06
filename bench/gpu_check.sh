#!/usr/bin/env bash
# The whole GPU check in one command, for a CUDA machine with torch, triton, transformers, pytest
# and pytest-benchmark already installed and no network: it installs only this repository (no
# dependencies, no downloads), prints the GPU, runs the test suite with the compiled Triton
# kernels, runs the full bench, and writes into OUT_DIR (default bench/results/):
#   gpu.txt      the GPU, driver and library versions
#   tests.log    the test suite's output
#   results.json every bench row and the machine
#   results.md   the bench tables, printed again last
# Peers: the GPU image has no Liger-Kernel or TRL and no network. bash bench/fetch_peer_wheels.sh,
# run beforehand where the index is reachable, leaves their wheels in bench/wheels/ (carry that
# folder to the GPU machine); they are installed into a temporary folder after the tests, so the
# bench measures them side by side, and their versions go into gpu.txt. Without the folder the
# peers' rows say "not installed".
# Usage: bash bench/gpu_check.sh [OUT_DIR]      Budget: well inside 8 minutes on an H200.
# A dry run without a GPU: GPU_CHECK_BENCH_ARGS="--device cpu --quick" bash bench/gpu_check.sh /tmp/out
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

echo "== tests (compiled kernels) =="
timeout 240 $python -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/tests.log" | tail -n 25
tests_rc=${PIPESTATUS[0]}

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
timeout 200 $python -m fastppo bench ${GPU_CHECK_BENCH_ARGS:---device cuda --time-budget 160} \
  --json "$out/results.json" --markdown "$out/results.md" >"$out/bench.log" 2>&1
bench_rc=$?
if [ $bench_rc -eq 0 ]; then rm -f "$out/bench.log"; else tail -n 30 "$out/bench.log"; fi

[ -f "$out/results.md" ] && cat "$out/results.md"
echo "gpu_check: tests exit $tests_rc, bench exit $bench_rc"
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ]
