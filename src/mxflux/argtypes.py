"""argparse value types shared by the command lines (torch-free): each rejects bad text with a
message naming what was expected, which argparse prints next to the option's name."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "positive_float", "positive_int"]


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def positive_int(text: str) -> int:
    v = _int(text)
    if v is None or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def non_negative_int(text: str) -> int:
    v = _int(text)
    if v is None or v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not v > 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v
