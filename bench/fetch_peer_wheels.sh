#!/usr/bin/env bash
# Fetch the peers the GPU check measures fastppo against, for a GPU machine that cannot download:
# Liger-Kernel and TRL as pure-Python wheels (with the three of TRL's dependencies such an image
# usually lacks), for that machine's Python, into bench/wheels/ (ignored by git). Run it where
# the package index is reachable; bench/gpu_check.sh installs whatever it finds there with
# --no-index --no-deps before the bench. Usage: bash bench/fetch_peer_wheels.sh [PYTHON_VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
rm -rf bench/wheels
$python -m pip download -q --no-deps --only-binary=:all: --python-version "${1:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d bench/wheels \
  liger-kernel==0.8.5 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls bench/wheels
