#!/usr/bin/env bash
# CuTe DSL (nvidia-cutlass-dsl) for the device machine, which has no network, in three parts carried by two
# calls, each within a call's 64 MiB (the working tree, ~4 MiB, counts too): its CUDA-13 library alone is a
# 92 MB wheel.
#
#   bash benchmarks/cutedsl_carry.sh     # here (network, ~3 min): writes .cutedsl/a, b, c (git-ignored)
#   # device, two calls back to back (the machine stays warm ~30 s after each; a later call finds a fresh one):
#   #   carry [".whl", ".cutedsl/a", ".cutedsl/c"]: bash benchmarks/gpu_run.sh cutedsl ...   (~51 MiB)
#   #   carry [".cutedsl/b"]:                       bash benchmarks/gpu_run.sh cutedsl cuterow ...
#   # (.whl without bench_lora's wheels, which go in .whl-lora: gpu_run.sh installs both folders)
#
# .cutedsl/a: the small wheels (nvidia-cutlass-dsl, -libs-base, -libs-core, cuda-bindings, cuda-pathfinder,
# protobuf; apache-tvm-ffi for the TVM-FFI calling convention; quack-kernels, einops and torch-c-dlpack-ext for
# probe_quack_gemm.py) for CPython 3.12 on x86-64, 17 MiB; b: nvidia-cutlass-dsl-libs-cu13's compiler library as an xz
# tarball, 48 MiB; c: the rest of that wheel (its runtime library, which the JIT's execution engine loads),
# 13 MiB. `gpu_run.sh cutedsl` installs whichever parts are there into /tmp/site-cute.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${CUTEDSL_VERSION:-4.8.1}
PIP=${PIP:-python3 -m pip}
grep -qx ".cutedsl" .git/info/exclude 2>/dev/null || echo ".cutedsl" >> .git/info/exclude
rm -rf .cutedsl && mkdir -p .cutedsl/a .cutedsl/b .cutedsl/c .cutedsl/tmp
fetch() { $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$1" "${@:2}"; }
fetch .cutedsl/a "nvidia-cutlass-dsl==$VERSION" "nvidia-cutlass-dsl-libs-base==$VERSION" \
    "nvidia-cutlass-dsl-libs-core==$VERSION" "cuda-bindings>=13,<14" "cuda-pathfinder>=1.4.2" "protobuf>=4.21.12" \
    "apache-tvm-ffi>=0.1.15,<0.2" "quack-kernels==0.6.5" einops torch-c-dlpack-ext
fetch .cutedsl/tmp "nvidia-cutlass-dsl-libs-cu13==$VERSION"
mkdir .cutedsl/tmp/x && python3 -m zipfile -e .cutedsl/tmp/*.whl .cutedsl/tmp/x
(cd .cutedsl/tmp/x && find . -name "_cutlass_ir*.so" > ../ir.list && find . -type f ! -name "_cutlass_ir*.so" > ../rest.list)
tar -cf - -C .cutedsl/tmp/x -T .cutedsl/tmp/ir.list | xz -9 -T0 > .cutedsl/b/libs-cu13-ir.tar.xz
tar -cf - -C .cutedsl/tmp/x -T .cutedsl/tmp/rest.list | xz -9 -T0 > .cutedsl/c/libs-cu13-rest.tar.xz
rm -rf .cutedsl/tmp
du -sh .cutedsl/a .cutedsl/b .cutedsl/c
