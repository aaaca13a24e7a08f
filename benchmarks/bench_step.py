"""The precision comparison on the throughput proxy: bf16, torchao float8 (tensorwise, rowwise)
and MXFP6 side by side, each in its own process.

    PYTHONPATH=src python benchmarks/bench_step.py [--mbs 16] [--bare-loop] [--profile-steps 1]
        [--settings bf16,fp8-tensorwise,fp8-rowwise,mxfp6] [--json out.json] [any `mxflux bench step` option]

The same as `mxflux bench step --proxy ...` (the flux-12b width with 2 double + 4 single blocks,
compiled, synthetic 256 + 256 tokens); with `--recipe NAME` it benchmarks that recipe instead of
the proxy. Every option of `mxflux bench step` applies (`mxflux bench step --help`).
"""

from __future__ import annotations

import sys

from mxflux.cli import main as mxflux_main


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--recipe" not in argv and not any(a.startswith("--recipe=") for a in argv) and "--proxy" not in argv:
        argv.insert(0, "--proxy")
    return mxflux_main(["bench", "step", *argv])


if __name__ == "__main__":
    sys.exit(main())
