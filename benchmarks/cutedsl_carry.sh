#!/usr/bin/env bash
# CuTe DSL (nvidia-cutlass-dsl) for the device machine, which has no network, in two parts that each fit
# one call's 64 MiB carry: its CUDA-13 compiler library alone is ~92 MB as a wheel.
#
#   bash benchmarks/cutedsl_carry.sh            # here (network): writes .cutedsl/a and .cutedsl/b (git-ignored)
#   # device, call 1, carry [".whl", ".cutedsl/a"]:  bash benchmarks/gpu_run.sh cutedsl
#   # device, call 2 at once (the machine stays warm ~30 s), carry [".cutedsl/b"]:  bash benchmarks/gpu_run.sh cutedsl ...
#
# .cutedsl/a: the small wheels (nvidia-cutlass-dsl, -libs-base, -libs-core, cuda-bindings, cuda-pathfinder,
# protobuf) for CPython 3.12 on x86-64; .cutedsl/b: nvidia-cutlass-dsl-libs-cu13's files as one xz tarball
# (~61 MiB). `gpu_run.sh cutedsl` installs whichever part is there into /tmp/site-cute.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${CUTEDSL_VERSION:-4.8.1}
PIP=${PIP:-python3 -m pip}
grep -qx ".cutedsl" .git/info/exclude 2>/dev/null || echo ".cutedsl" >> .git/info/exclude
rm -rf .cutedsl && mkdir -p .cutedsl/a .cutedsl/b .cutedsl/tmp
fetch() { $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$1" "${@:2}"; }
fetch .cutedsl/a "nvidia-cutlass-dsl==$VERSION" "nvidia-cutlass-dsl-libs-base==$VERSION" \
    "nvidia-cutlass-dsl-libs-core==$VERSION" "cuda-bindings>=13,<14" "cuda-pathfinder>=1.4.2" "protobuf>=4.21.12"
fetch .cutedsl/tmp "nvidia-cutlass-dsl-libs-cu13==$VERSION"
mkdir .cutedsl/tmp/x && python3 -m zipfile -e .cutedsl/tmp/*.whl .cutedsl/tmp/x
tar -cf - -C .cutedsl/tmp/x . | xz -9 -T0 > .cutedsl/b/libs-cu13.tar.xz
rm -rf .cutedsl/tmp
du -sh .cutedsl/a .cutedsl/b
