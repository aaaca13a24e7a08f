#!/usr/bin/env bash
# One device call that checks and times the GPU path: the CUDA tests, then the layer benchmarks.
#   PYTHONPATH=src bash benchmarks/gpu_check.sh            (on the H200; writes to $OUT if set)
# A torchao wheel in .whl/ (if present) is installed to /tmp/site for the peer comparison.
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -m pytest -q -s --tb=short ${GPU_TESTS:-tests/gpu} -p no:cacheprovider 2>&1 | grep -v "^W11" | tee "$OUT/gpu_tests.log"
python3 benchmarks/bench_layers.py --json "$OUT/bench_layers.json" "$@" 2>&1 | tee "$OUT/bench_layers.log"
