"""Atomic, resumable checkpoints.

A checkpoint is written to a temporary file in the target directory, flushed to disk, then
renamed over the final name: a crash mid-write leaves the previous checkpoint intact, never a
truncated one. It holds everything a resumed run needs to continue bit for bit: weights,
optimizer state, step, data position and every RNG state.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = ["save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state", "LATEST"]

LATEST = "latest.pt"


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write `state` to `path` atomically (temp file + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / LATEST
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint: no such file {str(path)!r}")
    # Our own files hold RNG states (numpy/python objects), so full unpickling is needed.
    return torch.load(path, map_location=map_location, weights_only=False)
