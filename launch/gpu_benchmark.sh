#!/usr/bin/env bash
# The GPU benchmark in one command, for a machine with one NVIDIA GPU whose Python has JAX with
# CUDA (and torch, for the FlashAttention-4 and QuACK glue) but maybe not our other packages.
#
#   launch/gpu_benchmark.sh [OUT_DIR] [tools/bench/gpu_benchmark.py flags...]
#
# 1. Wheels carried with the tree in .whl/ (make -f launch/wheels.mk, run beforehand on a machine
#    that reaches PyPI) are installed into /tmp/stencil-site, without the network, and put on
#    PYTHONPATH. No .whl/ folder: nothing is installed (the image must already have them).
# 2. tools/bench/gpu_benchmark.py: the kernel self-check, then every preset with each usable attention
#    backend, one table; every part under its own time limit, the whole run under 7.5 minutes
#    (--budget), and this script under a hard 8-minute limit on top of that.
# UNVERIFIED ON GPU: run on CPU only so far (tests/test_gpu_benchmark.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp/stencil-gpu-benchmark}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/stencil-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/stencil-site .whl/*.whl
    export PYTHONPATH="/tmp/stencil-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
mkdir -p "$out"
set -o pipefail
timeout -k 10 480 "$PY" tools/bench/gpu_benchmark.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
