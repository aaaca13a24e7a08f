"""Benchmarks and numerics reports (`mxflux numerics`, later `mxflux bench`).

Submodules import torch; this package itself does not, so the CLI stays quick to start.
"""
