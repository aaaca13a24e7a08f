"""Benchmarks and numerics reports: `mxflux numerics` (`numerics`) and `mxflux bench step`
(`step`: training-step throughput, MFU, memory; its parser is `cli`).

Submodules import torch (except `cli`); this package itself does not, so the CLI stays quick to start.
"""
