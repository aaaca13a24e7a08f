#!/usr/bin/env bash
# The wheels `gpu_run.sh` installs on the device machine, which has no network and whose image (torch 2.11,
# CUDA 13, Triton 3.6, CPython 3.12) lacks this package's other dependencies: written to .whl/ (git-ignored,
# ~7 MiB; carry it). CuTe DSL comes apart, in three parts: benchmarks/cutedsl_carry.sh.
#
#   bash benchmarks/gpu_wheels.sh     # here (network, ~30 s)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip}
rm -rf .whl && mkdir -p .whl
fetch() { $PIP download -q --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl "$@"; }
fetch pydantic pyyaml rich safetensors  # with their dependencies (pydantic-core at the version pydantic pins)
fetch pytest-xdist  # (and execnet) the GPU suite on several workers: GPU_TESTS_WORKERS in gpu_run.sh
# without theirs: torch is the image's, and mlperf-logging's (numpy, pandas, scipy) are there or unused on the device
fetch --no-deps "torchao==0.18.0" mlperf-logging
du -sh .whl
