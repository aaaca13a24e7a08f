"""Atomic, resumable checkpoints: one file (one process) or a sharded directory (many).

A run alone writes `latest.pt`: a `torch.save` file written to a temporary file in the target
directory, flushed to disk, then renamed over the final name. A run under torchrun writes
`latest.dcp/`: a `torch.distributed.checkpoint` directory in which every rank writes only its
own shards (no rank ever holds the whole model). It is written into the temporary sibling
`.latest.dcp.tmp/`; once every rank has finished, rank 0 moves the previous checkpoint aside
(`.latest.dcp.old/`), renames the new one into place and deletes the old one. A crash at any
point leaves a loadable checkpoint: before the rename the previous one is untouched; between
the two renames `resolve_checkpoint` falls back to `.latest.dcp.old/`.

Both formats hold everything a resumed run needs to continue bit for bit: weights, optimizer
state (keyed by parameter name, so either format loads onto any number of ranks), the LR
schedule, the data position, the config, the global RNG states and each rank's held column e_refs
(`precision.held_col_erefs`, `mxflux.train.held_erefs`). In a sharded directory
the non-tensor part is one pickled entry, `meta`, written by rank 0.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import shutil
import tempfile
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from .ema import plain_name

__all__ = ["save_checkpoint", "load_checkpoint", "save_sharded_checkpoint", "load_sharded_checkpoint",
           "read_checkpoint_meta", "resolve_checkpoint", "is_sharded_checkpoint", "rng_state",
           "set_rng_state", "model_optimizer_state", "load_model_optimizer_state", "LATEST", "LATEST_SHARDED", "CheckpointNotFoundError", "CheckpointCorruptError",
           "CheckpointWriteError", "CHECKPOINT_FORMAT", "check_format", "sharded_has"]

CHECKPOINT_FORMAT = 2  # tensors keyed by parameter name, the data position in global samples

LATEST = "latest.pt"
LATEST_SHARDED = "latest.dcp"
_META = "meta"  # the sharded checkpoint's entry holding the non-tensor state


class CheckpointNotFoundError(FileNotFoundError):
    """No checkpoint at the given path; the message says what was looked for."""


class CheckpointCorruptError(ValueError):
    """A checkpoint that exists but cannot be read (truncated, or not an mxflux checkpoint)."""


class CheckpointWriteError(OSError):
    """A sharded checkpoint write failed on some rank (raised on every rank); nothing was replaced."""


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


# --- weights and optimizer state by parameter name --------------------------------------------


def model_optimizer_state(model, optimizer, *, full: bool, world_size: int) -> dict:
    """{"model", "optimizer"} keyed by parameter name (the same keys alone, under DDP and under
    FSDP2): this rank's shards, or (`full`) whole tensors on the CPU of rank 0. A collective
    under FSDP2/DDP: call on every rank. A model with frozen parameters (a LoRA run's base) keeps
    only its trained ones: the base is rebuilt from the recipe, not stored in every checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=full and world_size > 1, cpu_offload=full and world_size > 1,
                            ignore_frozen_params=_has_frozen(model))
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer, options=opts)
    if fresh:  # get_state_dict initialised the optimizer state (a zero-lr step): undo that
        optimizer.state.clear()
    return {"model": model_state, "optimizer": optim_state}


def load_model_optimizer_state(model, optimizer, tensors: dict, *, full: bool, world_size: int) -> None:
    """Load `model_optimizer_state`'s dict: whole tensors (`full`, scattered to this world size)
    or this rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    frozen = _has_frozen(model)
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"],
                   options=StateDictOptions(full_state_dict=full and world_size > 1, ignore_frozen_params=frozen,
                                            strict=not frozen))
    if frozen:  # not strict, so that the frozen base may be absent; the trained parameters may not
        missing = [n for n, p in model.named_parameters() if p.requires_grad and plain_name(n) not in tensors["model"]]
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} trained parameter(s), e.g. {missing[0]}: "
                             f"it was written by another model or adapter layout")


def _has_frozen(model) -> bool:
    return any(not p.requires_grad for p in model.parameters())


# --- one file --------------------------------------------------------------------------------


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
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        full = _out_of_space(e, path, state)
        if full is not None:
            raise full from e
        raise
    return path


def _state_bytes(state) -> int:
    """The bytes of the tensors in a (nested) state: about what its checkpoint file takes."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _out_of_space(e: BaseException, path: Path, state) -> OSError | None:
    """An ENOSPC OSError naming `path` and the space the checkpoint needs, where `e` is a full disk: the
    OSError itself, or torch's zip writer's RuntimeError ("file write failed"), which hides the errno,
    when the disk has less free space than the checkpoint needs."""
    need = _state_bytes(state)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    is_full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or (
        isinstance(e, RuntimeError) and "write failed" in str(e) and free is not None and free < need)
    if not is_full:
        return None
    have = "" if free is None else f", {free / 1e9:.2f} GB free"
    return OSError(errno.ENOSPC, f"no space left on device: the checkpoint needs about {need / 1e9:.2f} GB{have}",
                   str(path))


def load_checkpoint(path: str | Path, map_location="cpu") -> dict:
    """The whole state of a checkpoint (file, sharded directory or run directory) in one process.

    A sharded directory is assembled into whole tensors on the CPU (through a temporary
    `torch.save` file, `dcp_to_torch_save`): fine for inspection and small models; a trainer
    resumes from one without that copy (`Trainer.resume`).
    """
    path = resolve_checkpoint(path)
    with _readable(path):
        if path.is_dir():
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

            _verify_manifest(path)
            with tempfile.TemporaryDirectory(prefix=".mxflux-ckpt-") as tmp:
                dcp_to_torch_save(path, Path(tmp) / "state.pt")
                state = torch.load(Path(tmp) / "state.pt", map_location=map_location, weights_only=False)
            state.update(_loads(state.pop(_META)))
            return state
        _verify_checksums(path)
        # Our own files hold RNG states (numpy/python objects), so full unpickling is needed.
        state = torch.load(path, map_location=map_location, weights_only=False)
    if not isinstance(state, dict) or "progress" not in state:
        raise CheckpointCorruptError(f"checkpoint {str(path)!r}: a torch file, but not an mxflux checkpoint "
                                     f"(no training progress in it)")
    return state


def _verify_checksums(path: Path) -> None:
    """Every record of a `torch.save` file against the CRC-32 its zip entry carries (torch.load does
    not check them: flipped bytes in a tensor load silently, and the run later fails on a non-finite
    loss that seems to blame the data). Reads the file once, at the disk's speed."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except zipfile.BadZipFile as e:
        raise CheckpointCorruptError(f"checkpoint {str(path)!r} cannot be read ({e}): it is truncated or damaged; "
                                     f"restore a copy, or start over with --overwrite") from None
    if bad is not None:
        raise CheckpointCorruptError(f"checkpoint {str(path)!r} is damaged: its record {bad!r} fails its CRC-32 "
                                     f"checksum (bytes changed after it was written); restore a copy, or start over "
                                     f"with --overwrite")


@contextlib.contextmanager
def _readable(path: Path):
    """Reading errors of a checkpoint as one error naming the file (a truncated write, a file
    that is not a checkpoint), instead of the unpickler's or zip reader's own."""
    try:
        yield
    except (CheckpointCorruptError, MemoryError, PermissionError):  # a permission problem is not a bad file
        raise
    except Exception as e:
        raise CheckpointCorruptError(f"checkpoint {str(path)!r} cannot be read ({type(e).__name__}: {e}); it is "
                                     f"truncated or not an mxflux checkpoint") from e


# --- sharded directories ---------------------------------------------------------------------


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(blob: bytes):
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)


def _siblings(path: Path) -> tuple[Path, Path]:
    """(temporary, previous) sibling directories of a sharded checkpoint `path`."""
    return path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_sharded_checkpoint(path: str | Path, tensors: dict, meta: dict, *, rank: int) -> Path:
    """Write a sharded checkpoint directory atomically. A collective: call on every rank.

    `tensors` is this rank's (sharded) state, e.g. {"model": ..., "optimizer": ...} from
    `get_state_dict`; `meta` is the non-tensor state, taken from rank 0. Every rank writes its
    shards into a temporary sibling directory; only after all of them have finished does rank 0
    rename it into place (the previous checkpoint stays intact until then). A failed write on
    any rank raises on every rank and leaves the previous checkpoint as it was.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    tmp, old = _siblings(path)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(tmp)  # leftovers of an interrupted write
    _barrier()
    state = dict(tensors)
    if rank == 0:
        state[_META] = _dumps(meta)
    try:
        # Collective: a failure on any rank is raised on every rank (CheckpointException).
        with warnings.catch_warnings():  # alone: "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            dcp.save(state, checkpoint_id=tmp)
    except BaseException as e:
        if rank == 0:
            _remove(tmp)
        if isinstance(e, CheckpointException):  # a BaseException: make it an ordinary error
            raise CheckpointWriteError(f"checkpoint {str(path)!r}: the write failed (the previous checkpoint "
                                       f"is kept): {e}") from e
        raise
    _barrier()  # every rank's shards are on disk (dcp.save has synced its files)
    _write_manifest(tmp, rank)
    if rank == 0:
        _fsync_dir(tmp)
        _remove(old)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        _remove(old)
    _barrier()  # nobody reads or rewrites the checkpoint before it is in place
    return path


def load_sharded_checkpoint(path: str | Path, tensors: dict) -> dict:
    """Load a sharded checkpoint directory into `tensors` (in place) and return its meta state.

    `tensors` holds this process's destination tensors (e.g. {"model": ..., "optimizer": ...}
    from `get_state_dict`): DTensors are read shard by shard, so the directory loads onto any
    number of ranks; in a process without a process group every tensor is read whole.
    """
    import torch.distributed.checkpoint as dcp

    _verify_manifest(Path(path))
    state = dict(tensors)
    state[_META] = b""
    # Without a process group dcp.load reads in this process alone (torch >= 2.11 at least).
    with warnings.catch_warnings(), _readable(Path(path)):  # "assuming ... load in a single process": it is
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        dcp.load(state, checkpoint_id=Path(path))
    for k in tensors:
        tensors[k] = state[k]
    return _loads(state[_META])


MANIFEST = "checksums.json"  # in a sharded checkpoint: {file name: CRC-32} of every file dcp wrote


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _ranks() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shared(mine: list):
    """Every rank's list concatenated (all ranks: a collective), or `mine` alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return mine
    lists = [None] * dist.get_world_size()
    dist.all_gather_object(lists, mine)
    return [x for part in lists for x in part]


def _write_manifest(directory: Path, rank: int) -> None:
    """The CRC-32 of every file of a just-written sharded checkpoint, in MANIFEST: each rank sums a share
    of the files (read back from the page cache), rank 0 writes them. A collective."""
    files = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    _, world = _ranks()
    sums = _shared([(name, _crc32(directory / name)) for i, name in enumerate(files) if i % world == rank])
    if rank == 0:
        with open(directory / MANIFEST, "w") as f:
            json.dump(dict(sorted(sums)), f, indent=0)
            f.flush()
            os.fsync(f.fileno())


def _verify_manifest(directory: Path) -> None:
    """Every file a sharded checkpoint's MANIFEST lists, against its CRC-32 (each rank a share, the
    verdict shared, so every rank refuses together); CheckpointCorruptError naming the first bad file.
    A checkpoint written before manifests (none there) is read unchecked."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return
    try:
        listed = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"checkpoint {str(directory)!r}: its {MANIFEST} cannot be read ({e}); restore "
                                     f"a copy, or start over with --overwrite") from None
    rank, world = _ranks()
    bad = []
    for i, (name, crc) in enumerate(sorted(listed.items())):
        if i % world != rank:
            continue
        file = directory / name
        if not file.is_file():
            bad.append(f"{name} is missing")
        elif _crc32(file) != crc:
            bad.append(f"{name} fails its CRC-32 checksum (bytes changed after it was written)")
    bad = _shared(bad)
    if bad:
        raise CheckpointCorruptError(f"checkpoint {str(directory)!r} is damaged: {bad[0]}"
                                     f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; restore a copy, "
                                     f"or start over with --overwrite")


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint that `path` names: a `latest.pt` file, a sharded directory, or a run
    directory holding either (the newer of the two if both are there; a sharded checkpoint
    interrupted between its two renames is found under its `.old` name)."""
    path = Path(path)
    if path.is_file() or is_sharded_checkpoint(path):
        return path
    if path.is_dir():
        found = [p for p in (path / LATEST, path / LATEST_SHARDED) if p.is_file() or is_sharded_checkpoint(p)]
        if not (path / LATEST_SHARDED).exists():
            old = _siblings(path / LATEST_SHARDED)[1]
            if is_sharded_checkpoint(old):
                found.append(old)
        if found:
            return max(found, key=lambda p: (p / ".metadata" if p.is_dir() else p).stat().st_mtime)
        raise CheckpointNotFoundError(f"checkpoint: no {LATEST} or {LATEST_SHARDED}/ in {str(path)!r}")
    if is_sharded_checkpoint(_siblings(path)[1]):
        return _siblings(path)[1]  # interrupted between the two renames of its last write
    if path.name == LATEST and is_sharded_checkpoint(path.with_name(LATEST_SHARDED)):
        return path.with_name(LATEST_SHARDED)  # the run was sharded: same checkpoint, other format
    raise CheckpointNotFoundError(f"checkpoint: no such file or checkpoint directory {str(path)!r}")


def read_checkpoint_meta(path: str | Path) -> dict:
    """The non-tensor state of a checkpoint (config, progress, ...), without its tensors when sharded."""
    path = resolve_checkpoint(path)
    if path.is_dir():
        return load_sharded_checkpoint(path, {})
    return load_checkpoint(path)


def sharded_has(path: Path, prefix: str) -> bool:
    """Whether a sharded checkpoint directory holds an entry whose key starts with `prefix`."""
    from torch.distributed.checkpoint import FileSystemReader

    return any(k.startswith(prefix) for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def check_format(state: dict) -> None:
    """Refuse a checkpoint of another format, naming both."""
    found = state.get("format", 1)
    if found != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint format {found}: this mxflux reads format {CHECKPOINT_FORMAT} "
                         f"(tensors keyed by parameter name)")
