"""The on-disk dataset format (docs/DATA_FORMAT.md): its description, a writer and a reader.

A dataset is a directory:

    meta.json                      what is where: splits, sample counts, shards, tensor specs, VAE facts
    empty_encodings.safetensors    t5_empty [L_txt, D_t5], clip_empty [D_clip]
    train/shard-00000.safetensors  samples 0..n0-1 of the split, each tensor stacked: t5 [n0, L_txt, D_t5], ...
    train/captions.jsonl           optional: one JSON string per sample, in sample order
    eval/shard-00000.safetensors   eval shards additionally hold timestep_index [n] (int64, 0..7)

`DatasetWriter` writes one into a hidden staging directory next to the target and renames it into
place only when complete (meta.json last), so a reader never sees a half-written dataset and the
writer never replaces an existing one. `LatentDataset` validates meta.json and every shard header
when it is opened, then reads samples from memory-mapped shards (`map_safetensors`: nothing is
read until a sample is touched, and then only its bytes).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = [
    "DTYPES", "EMPTY_FILE", "FLUX_VAE_SCALE", "FLUX_VAE_SHIFT", "FORMAT", "FORMAT_VERSION", "META_FILE", "SPLITS",
    "DataError", "DatasetExistsError", "DatasetFormatError", "DatasetMeta", "DatasetNotFoundError", "DatasetWriter",
    "LatentDataset", "SplitMeta", "TensorSpec", "check_output_dir", "empty_encoding_specs", "format_json",
    "load_empty_encodings", "map_safetensors", "read_meta", "sample_specs",
]

FORMAT = "mxflux-latents"
FORMAT_VERSION = 1
META_FILE = "meta.json"
EMPTY_FILE = "empty_encodings.safetensors"
SPLITS = ("train", "eval")

# The Flux VAE's latent statistics (its diffusers config: shift_factor, scaling_factor). The trainer
# normalises sampled latents as (z - shift) * scale; each dataset records the values that fit it.
FLUX_VAE_SHIFT = 0.1159
FLUX_VAE_SCALE = 0.3611

# dtype names used in meta.json, and safetensors' own names for them.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int64": torch.int64,
}
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64"}

# Bytes per shard the writer aims at when not told a sample count (MLPerf: ~2.1 MB a sample).
_TARGET_SHARD_BYTES = 1 << 30


class DataError(Exception):
    """Base of the errors this package raises for bad datasets or bad inputs (the CLI reports them)."""


class DatasetFormatError(DataError, ValueError):
    """A dataset on disk (or a batch handed to the writer) does not match the format."""


class DatasetExistsError(DataError, FileExistsError):
    """The writer's target already holds something; it never overwrites."""


class DatasetNotFoundError(DataError, FileNotFoundError):
    """There is no dataset directory where one was expected."""


# ---------------------------------------------------------------------------------------------
# Describing the tensors


@dataclass(frozen=True)
class TensorSpec:
    """Per-sample shape (without the leading sample axis) and dtype name of one stored tensor."""

    shape: tuple[int, ...]
    dtype: str  # a key of DTYPES

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in DTYPES:
            raise DatasetFormatError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}


def sample_specs(split: str, *, l_txt: int, d_t5: int, d_clip: int, latent_channels: int = 16,
                 latent_hw: int = 32) -> dict[str, TensorSpec]:
    """The tensors every sample of `split` holds (the eval split adds its fixed timestep index)."""
    latent = (latent_channels, latent_hw, latent_hw)
    specs = {
        "vae_mean": TensorSpec(latent, "bfloat16"),
        "vae_logvar": TensorSpec(latent, "bfloat16"),
        "t5": TensorSpec((l_txt, d_t5), "bfloat16"),
        "clip": TensorSpec((d_clip,), "bfloat16"),
    }
    if split == "eval":
        specs["timestep_index"] = TensorSpec((), "int64")  # t = k/8, k in 0..7
    return specs


def empty_encoding_specs(*, l_txt: int, d_t5: int, d_clip: int) -> dict[str, TensorSpec]:
    """The tensors of empty_encodings.safetensors: the empty prompt's encodings, for CFG dropout."""
    return {"t5_empty": TensorSpec((l_txt, d_t5), "bfloat16"), "clip_empty": TensorSpec((d_clip,), "bfloat16")}


# ---------------------------------------------------------------------------------------------
# meta.json


@dataclass(frozen=True)
class SplitMeta:
    num_samples: int
    tensors: dict[str, TensorSpec]
    shards: tuple[tuple[str, int], ...]  # (path relative to the root, samples in it), in order
    captions: str | None  # relative path of the optional captions.jsonl


@dataclass(frozen=True)
class DatasetMeta:
    """meta.json, parsed and checked (`read_meta`)."""

    root: Path
    latent_shift: float
    latent_scale: float
    splits: dict[str, SplitMeta]
    empty_file: str
    empty_tensors: dict[str, TensorSpec]
    source: dict  # free-form: how the dataset was made (synthetic, prepared, demo) and with what
    raw: dict  # the JSON as read


def _require(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise DatasetFormatError(f"{where}: {message}")


def _parse_specs(obj, where: str) -> dict[str, TensorSpec]:
    _require(isinstance(obj, dict) and obj, where, f"expected a non-empty object of tensor specs, got {obj!r}")
    specs = {}
    for name, s in obj.items():
        w = f"{where}.{name}"
        _require(isinstance(s, dict) and set(s) >= {"shape", "dtype"}, w,
                 f"expected {{'shape': [...], 'dtype': ...}}, got {s!r}")
        _require(isinstance(s["shape"], list) and all(isinstance(d, int) and d > 0 for d in s["shape"]),
                 w, f"shape must be a list of positive integers, got {s['shape']!r}")
        _require(s["dtype"] in DTYPES, w, f"dtype {s['dtype']!r} is not one of {sorted(DTYPES)}")
        specs[name] = TensorSpec(tuple(s["shape"]), s["dtype"])
    return specs


def read_meta(root: str | os.PathLike) -> DatasetMeta:
    """Read and check `root/meta.json` (not the shards: `LatentDataset` checks those)."""
    root = Path(root)
    path = root / META_FILE
    if root.exists() and not root.is_dir():
        raise DatasetNotFoundError(f"dataset directory {root} is a file, expected a directory (docs/DATA_FORMAT.md)")
    if not root.is_dir():
        raise DatasetNotFoundError(f"dataset directory {root} does not exist")
    if not path.is_file():
        raise DatasetFormatError(f"{root} has no {META_FILE}: it is not an mxflux dataset, or its "
                                 f"writing never finished (docs/DATA_FORMAT.md)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DatasetFormatError(f"{path}: not valid JSON ({e})") from None
    w = str(path)
    _require(isinstance(raw, dict), w, "expected a JSON object")
    _require(raw.get("format") == FORMAT, w, f"format is {raw.get('format')!r}, expected {FORMAT!r}")
    version = raw.get("format_version")
    _require(isinstance(version, int), w, f"format_version is {version!r}, expected an integer")
    _require(version <= FORMAT_VERSION, w, f"format_version {version} is newer than this mxflux "
                                           f"reads ({FORMAT_VERSION}): upgrade mxflux")
    latent = raw.get("latent")
    _require(isinstance(latent, dict), w, "missing object 'latent' with 'shift' and 'scale'")
    for key in ("shift", "scale"):
        _require(isinstance(latent.get(key), (int, float)), f"{w}: latent.{key}",
                 f"expected a number, got {latent.get(key)!r}")
    splits_raw = raw.get("splits")
    _require(isinstance(splits_raw, dict) and splits_raw, w, "missing object 'splits'")

    splits = {}
    for name, s in splits_raw.items():
        ws = f"{w}: splits.{name}"
        _require(isinstance(s, dict), ws, "expected an object")
        n = s.get("num_samples")
        _require(isinstance(n, int) and n >= 0, ws, f"num_samples is {n!r}, expected an integer >= 0")
        tensors = _parse_specs(s.get("tensors"), f"{ws}.tensors")
        required = set(sample_specs(name, l_txt=1, d_t5=1, d_clip=1))
        missing = sorted(required - set(tensors))
        _require(not missing, f"{ws}.tensors", f"missing tensor(s) {missing}; a {name} sample holds "
                                               f"{sorted(required)}")
        shards = s.get("shards")
        _require(isinstance(shards, list), ws, "'shards' must be a list")
        parsed = []
        for i, sh in enumerate(shards):
            _require(isinstance(sh, dict) and isinstance(sh.get("file"), str)
                     and isinstance(sh.get("num_samples"), int) and sh["num_samples"] > 0,
                     f"{ws}.shards[{i}]", f"expected {{'file': str, 'num_samples': int > 0}}, got {sh!r}")
            parsed.append((sh["file"], sh["num_samples"]))
        total = sum(c for _, c in parsed)
        _require(total == n, ws, f"shards hold {total} samples but num_samples is {n}")
        captions = s.get("captions")
        _require(captions is None or isinstance(captions, str), ws, "'captions' must be a file name")
        splits[name] = SplitMeta(n, tensors, tuple(parsed), captions)

    empty = raw.get("empty_encodings")
    _require(isinstance(empty, dict) and isinstance(empty.get("file"), str), w,
             "missing object 'empty_encodings' with 'file' and 'tensors'")
    empty_tensors = _parse_specs(empty.get("tensors"), f"{w}: empty_encodings.tensors")
    missing = sorted({"t5_empty", "clip_empty"} - set(empty_tensors))
    _require(not missing, f"{w}: empty_encodings.tensors", f"missing tensor(s) {missing}")
    return DatasetMeta(root=root, latent_shift=float(latent["shift"]), latent_scale=float(latent["scale"]),
                       splits=splits, empty_file=empty["file"], empty_tensors=empty_tensors,
                       source=raw.get("source", {}), raw=raw)


def _check_header(path: Path, expected: Mapping[str, TensorSpec], num_samples: int | None) -> None:
    """Check that safetensors file `path` holds exactly `expected` (stacked over `num_samples`)."""
    if not path.is_file():
        raise DatasetFormatError(f"{path}: file is missing (listed in {META_FILE})")
    try:
        with safe_open(str(path), framework="pt") as f:
            found = {name: (f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()) for name in f.keys()}
    except Exception as e:  # a truncated or foreign file: safetensors' own error names the problem
        raise DatasetFormatError(f"{path}: not a readable safetensors file ({e})") from None
    for name, spec in expected.items():
        if name not in found:
            raise DatasetFormatError(f"{path}: tensor {name!r} is missing ({META_FILE} lists it)")
        shape, st_dtype = found[name]
        want = ([num_samples] if num_samples is not None else []) + list(spec.shape)
        if list(shape) != want:
            per = f" ({num_samples} samples of {list(spec.shape)})" if num_samples is not None else ""
            raise DatasetFormatError(f"{path}: tensor {name!r} has shape {list(shape)}, expected {want}{per}")
        dtype = _SAFETENSORS_DTYPES.get(st_dtype, st_dtype)
        if dtype != spec.dtype:
            raise DatasetFormatError(f"{path}: tensor {name!r} has dtype {dtype}, expected {spec.dtype}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise DatasetFormatError(f"{path}: unexpected tensor(s) {extra}; {META_FILE} lists {sorted(expected)}")


# ---------------------------------------------------------------------------------------------
# Reading


def load_empty_encodings(root: str | os.PathLike, device: torch.device | str | None = None,
                         dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t5_empty [L_txt, D_t5], clip_empty [D_clip]): the empty prompt's encodings, for CFG dropout.

    Load them once at setup, on the training device and in the compute dtype (a per-step
    host-to-device copy would break CUDA-graph capture).
    """
    meta = read_meta(root)
    path = meta.root / meta.empty_file
    _check_header(path, meta.empty_tensors, None)
    tensors = map_safetensors(path)
    t5, clip = tensors["t5_empty"].clone(), tensors["clip_empty"].clone()
    return t5.to(device=device, dtype=dtype), clip.to(device=device, dtype=dtype)


class LatentDataset:
    """One split of a dataset, map-style: `ds[i]` is sample i as a dict of tensors.

    Opening checks meta.json and every shard's header (names, shapes, dtypes) and fails with an
    error naming the file, tensor and expectation. Shards are memory-mapped lazily, per process
    (DataLoader workers map their own). `gather(indices)` reads a whole batch with one copy per
    tensor row; the loader uses it.
    """

    def __init__(self, root: str | os.PathLike, split: str = "train"):
        self.meta = read_meta(root)
        self.root = self.meta.root
        if split not in self.meta.splits:
            raise DatasetFormatError(f"{self.root}: no split {split!r}; it has {sorted(self.meta.splits)}")
        self.split = split
        self._split = self.meta.splits[split]
        self.specs: dict[str, TensorSpec] = self._split.tensors
        for file, count in self._split.shards:
            _check_header(self.root / file, self.specs, count)
        self._starts = [0]  # first sample index of each shard, plus the total at the end
        for _, count in self._split.shards:
            self._starts.append(self._starts[-1] + count)
        self._mapped: dict[int, dict[str, torch.Tensor]] = {}  # shard -> tensors, per process
        if self._split.captions is not None:  # a short file would pair later samples with no caption
            self._check_caption_count()

    # --- facts -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._split.num_samples

    @property
    def latent_shift(self) -> float:
        return self.meta.latent_shift

    @property
    def latent_scale(self) -> float:
        return self.meta.latent_scale

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return self.specs["vae_mean"].shape  # type: ignore[return-value]

    @property
    def t5_shape(self) -> tuple[int, int]:
        return self.specs["t5"].shape  # type: ignore[return-value]

    @property
    def clip_dim(self) -> int:
        return self.specs["clip"].shape[0]

    @property
    def bytes_per_sample(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def _check_caption_count(self) -> None:
        path = self.root / self._split.captions
        if not path.is_file():
            raise DatasetFormatError(f"{path}: file is missing (listed in {META_FILE})")
        lines, last = 0, b""
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
        lines += last not in (b"", b"\n")  # a last line without its newline
        if lines != len(self):
            raise DatasetFormatError(f"{path}: {lines} captions for {len(self)} {self.split} samples; expected one "
                                     f"JSON string per sample, in sample order (docs/DATA_FORMAT.md)")

    def captions(self) -> list[str] | None:
        """The split's captions in sample order, or None where the dataset stores none."""
        if self._split.captions is None:
            return None
        with open(self.root / self._split.captions, encoding="utf-8") as f:
            captions = [json.loads(line) for line in f]
        if len(captions) != len(self):
            raise DatasetFormatError(f"{self.root / self._split.captions}: {len(captions)} captions "
                                     f"for {len(self)} samples")
        return captions

    # --- reading -----------------------------------------------------------------------------

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is out of range for the {self.split} split of "
                             f"{len(self)} samples")
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def _shard(self, shard: int) -> dict[str, torch.Tensor]:
        tensors = self._mapped.get(shard)
        if tensors is None:
            tensors = map_safetensors(self.root / self._split.shards[shard][0])
            self._mapped[shard] = tensors
        return tensors

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        shard, row = self._locate(int(index))
        sample = {name: t[row].clone() for name, t in self._shard(shard).items()}
        sample["index"] = torch.tensor(int(index), dtype=torch.int64)
        return sample

    def gather(self, indices: Sequence[int], *, shared_memory: bool = False) -> dict[str, torch.Tensor]:
        """Samples `indices` stacked into one batch dict (plus 'index' [B], the sample indices).

        `shared_memory=True` allocates the batch in shared memory, as a DataLoader worker should:
        the batch then crosses to the main process without another copy.
        """
        rows = [self._locate(int(i)) for i in indices]
        batch = {name: _empty((len(rows), *spec.shape), spec.torch_dtype, shared_memory)
                 for name, spec in self.specs.items()}
        for j, (shard, row) in enumerate(rows):
            for name, t in self._shard(shard).items():
                batch[name][j].copy_(t[row])
        batch["index"] = torch.tensor([int(i) for i in indices], dtype=torch.int64)
        return batch

    def __getstate__(self) -> dict:  # a spawned worker maps the shards itself
        state = self.__dict__.copy()
        state["_mapped"] = {}
        return state

    def __repr__(self) -> str:
        return (f"LatentDataset({str(self.root)!r}, {self.split!r}: {len(self)} samples in "
                f"{len(self._split.shards)} shards, t5 {list(self.t5_shape)}, clip {self.clip_dim}, "
                f"latent {list(self.latent_shape)})")


def map_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as views of one private memory map of the file.

    Nothing is read until a tensor's bytes are touched, and then only those pages, through the
    page cache; the tensors keep the mapping alive. (safetensors' own `get_tensor` maps lazily
    only from version 0.8 on; earlier versions copy the whole tensor: 2-7 s and a private copy
    per DataLoader worker for a 1 GiB shard. The file layout is stable: an 8-byte little-endian
    header length, a JSON header with each tensor's dtype, shape and byte range, then the bytes.)
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)  # MAP_PRIVATE
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise DatasetFormatError(f"{path}: tensor {name!r} has dtype {info['dtype']}; the format "
                                     f"stores only {sorted(DTYPES)}")
        dtype = DTYPES[_SAFETENSORS_DTYPES[info["dtype"]]]
        start, end = (base + o for o in info["data_offsets"])
        if end > size or start % dtype.itemsize or end - start != math.prod(info["shape"]) * dtype.itemsize:
            raise DatasetFormatError(f"{path}: tensor {name!r} has a bad or unaligned byte range "
                                     f"{info['data_offsets']} for {info['dtype']} {info['shape']}")
        view = torch.empty((0,), dtype=dtype).set_(storage, start // dtype.itemsize, tuple(info["shape"]))
        tensors[name] = view
    return tensors


def _empty(shape: tuple[int, ...], dtype: torch.dtype, shared_memory: bool) -> torch.Tensor:
    if not shared_memory:
        return torch.empty(shape, dtype=dtype)
    # Allocate straight in shared memory (as torch's default_collate does in workers): unlike
    # `.share_memory_()` this does not copy the fresh tensor once more.
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty((0,), dtype=dtype).set_(storage).view(shape)


# ---------------------------------------------------------------------------------------------
# Writing


class DatasetWriter:
    """Write a dataset: `write(split, batch)` any number of times, `write_empty_encodings`, `commit`.

    Batches are dicts of tensors with a leading sample axis, as `sample_specs` describes them
    (floating tensors are cast to the stored dtype; shapes must match exactly). Everything goes to
    a hidden staging directory beside `out`; `commit()` writes meta.json and renames the staging
    directory to `out` in one step. Used as a context manager, an exception discards the staging
    directory. `out` must not exist or be an empty directory: a writer never replaces a dataset.
    """

    def __init__(self, out: str | os.PathLike, *, l_txt: int, d_t5: int, d_clip: int,
                 latent_channels: int = 16, latent_hw: int = 32,
                 latent_shift: float = FLUX_VAE_SHIFT, latent_scale: float = FLUX_VAE_SCALE,
                 splits: Sequence[str] = SPLITS, samples_per_shard: int | None = None,
                 source: Mapping | None = None):
        self.out = Path(out)
        check_output_dir(self.out)
        self.specs = {split: sample_specs(split, l_txt=l_txt, d_t5=d_t5, d_clip=d_clip,
                                          latent_channels=latent_channels, latent_hw=latent_hw)
                      for split in splits}
        self.empty_specs = empty_encoding_specs(l_txt=l_txt, d_t5=d_t5, d_clip=d_clip)
        sample_bytes = max(sum(s.nbytes for s in sp.values()) for sp in self.specs.values())
        if samples_per_shard is None:
            samples_per_shard = max(1, _TARGET_SHARD_BYTES // sample_bytes)
        if samples_per_shard <= 0:
            raise ValueError(f"samples_per_shard must be positive, got {samples_per_shard}")
        self.samples_per_shard = samples_per_shard
        self.latent_shift, self.latent_scale = float(latent_shift), float(latent_scale)
        self.source = dict(source or {})

        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self.out.parent / f".{self.out.name}.partial-{uuid.uuid4().hex[:8]}"
        self.staging.mkdir()
        for split in splits:
            (self.staging / split).mkdir()
        self._pending: dict[str, list[dict[str, torch.Tensor]]] = {s: [] for s in splits}
        self._pending_count = {s: 0 for s in splits}
        self._shards: dict[str, list[tuple[str, int]]] = {s: [] for s in splits}
        self._counts = {s: 0 for s in splits}
        self._captions: dict[str, list[str] | None] = {s: None for s in splits}
        self._empty_written = False
        self._closed = False

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.commit()

    def write(self, split: str, batch: Mapping[str, torch.Tensor], captions: Sequence[str] | None = None) -> None:
        """Append the samples of `batch` to `split` (in order), with their captions if given."""
        self._check_open()
        if split not in self.specs:
            raise DatasetFormatError(f"no split {split!r} in this writer; it writes {sorted(self.specs)}")
        batch = _conform(batch, self.specs[split], where=f"{split} batch")
        n = next(iter(batch.values())).shape[0]
        if captions is not None and len(captions) != n:
            raise DatasetFormatError(f"{split} batch: {len(captions)} captions for {n} samples")
        first = self._counts[split] + self._pending_count[split] == 0
        if first and captions is not None:
            self._captions[split] = []
        if (captions is None) != (self._captions[split] is None):
            raise DatasetFormatError(f"{split} batch: give captions with every batch or with none")
        if captions is not None:
            self._captions[split].extend(str(c) for c in captions)
        self._pending[split].append(batch)
        self._pending_count[split] += n
        while self._pending_count[split] >= self.samples_per_shard:
            self._flush(split, self.samples_per_shard)

    def write_empty_encodings(self, t5_empty: torch.Tensor, clip_empty: torch.Tensor) -> None:
        self._check_open()
        tensors = {"t5_empty": t5_empty, "clip_empty": clip_empty}
        for name, spec in self.empty_specs.items():
            t = tensors[name]
            if tuple(t.shape) != spec.shape:
                raise DatasetFormatError(f"empty encodings: tensor {name!r} has shape {list(t.shape)}, "
                                         f"expected {list(spec.shape)}")
            tensors[name] = _cast(t, spec, f"empty encodings: tensor {name!r}").contiguous()
        _save(tensors, self.staging / EMPTY_FILE)
        self._empty_written = True

    def commit(self) -> Path:
        """Write the last shards and meta.json, then move the dataset into place; returns `out`."""
        self._check_open()
        for split in self.specs:
            if self._pending_count[split]:
                self._flush(split, self._pending_count[split])
        if not self._empty_written:
            raise DatasetFormatError("the empty-prompt encodings were never written "
                                     "(call write_empty_encodings before commit)")
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "latent": {"shift": self.latent_shift, "scale": self.latent_scale},
            "splits": {},
            "empty_encodings": {"file": EMPTY_FILE,
                                "tensors": {k: s.to_json() for k, s in self.empty_specs.items()}},
            "source": self.source,
        }
        for split, specs in self.specs.items():
            entry = {
                "num_samples": self._counts[split],
                "tensors": {k: s.to_json() for k, s in specs.items()},
                "shards": [{"file": f, "num_samples": c} for f, c in self._shards[split]],
            }
            if self._captions[split] is not None:
                entry["captions"] = f"{split}/captions.jsonl"
                with open(self.staging / entry["captions"], "w", encoding="utf-8") as f:
                    f.writelines(json.dumps(c, ensure_ascii=False) + "\n" for c in self._captions[split])
            meta["splits"][split] = entry
        (self.staging / META_FILE).write_text(format_json(meta) + "\n")
        self._closed = True
        try:
            check_output_dir(self.out)
            os.rename(self.staging, self.out)  # atomic; replaces `out` only if it is an empty directory
        except (OSError, DatasetExistsError):
            raise DatasetExistsError(f"{self.out} appeared while the dataset was being written; the "
                                     f"complete dataset is kept in {self.staging}") from None
        return self.out

    def abort(self) -> None:
        """Discard everything written so far (the target directory was never touched)."""
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.staging, ignore_errors=True)

    # --- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DatasetWriter was already committed or aborted")

    def _flush(self, split: str, count: int) -> None:
        """Write the first `count` pending samples of `split` as the next shard."""
        pending = self._pending[split]
        merged = {name: torch.cat([b[name] for b in pending]) for name in pending[0]}
        shard = {name: t[:count].contiguous() for name, t in merged.items()}
        rest = {name: t[count:] for name, t in merged.items()}
        file = f"{split}/shard-{len(self._shards[split]):05d}.safetensors"
        _save(shard, self.staging / file,
              metadata={"format": FORMAT, "split": split, "first_index": str(self._counts[split])})
        self._shards[split].append((file, count))
        self._counts[split] += count
        self._pending_count[split] -= count
        self._pending[split] = [rest] if self._pending_count[split] else []


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)  # safetensors creates files private (0600); give them the usual mode
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def format_json(obj, indent: str = "") -> str:
    """JSON with one item per line, except objects and lists short enough to stay on one line."""
    flat = json.dumps(obj, ensure_ascii=False)
    if len(flat) + len(indent) <= 100 or not isinstance(obj, (dict, list)) or not obj:
        return flat
    inner = indent + "  "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {format_json(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    items = [f"{inner}{format_json(v, inner)}" for v in obj]
    return "[\n" + ",\n".join(items) + f"\n{indent}]"


def check_output_dir(out: str | os.PathLike) -> None:
    """Raise DatasetExistsError unless `out` is free for a new dataset (absent or an empty directory)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "a dataset" if (out / META_FILE).exists() else "files"
        raise DatasetExistsError(f"{out} already exists and holds {what}; a dataset writer never "
                                 f"overwrites: remove it or choose another directory")


def _cast(t: torch.Tensor, spec: TensorSpec, where: str) -> torch.Tensor:
    want = spec.torch_dtype
    if t.dtype == want:
        return t
    if want.is_floating_point and t.dtype.is_floating_point:
        return t.to(want)
    if not want.is_floating_point and not t.dtype.is_floating_point and t.dtype != torch.bool:
        return t.to(want)
    raise DatasetFormatError(f"{where} has dtype {str(t.dtype).removeprefix('torch.')}, expected {spec.dtype}")


def _conform(batch: Mapping[str, torch.Tensor], specs: Mapping[str, TensorSpec], where: str) -> dict:
    """Check a batch against the split's specs; returns it cast to the stored dtypes, on the CPU."""
    missing, extra = sorted(set(specs) - set(batch)), sorted(set(batch) - set(specs))
    if missing or extra:
        raise DatasetFormatError(f"{where}: tensors {sorted(batch)} do not match the split's "
                                 f"{sorted(specs)} (missing {missing}, unexpected {extra})")
    sizes = {name: t.shape[0] if t.dim() else None for name, t in batch.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise DatasetFormatError(f"{where}: tensors disagree on the number of samples: {sizes}")
    out = {}
    for name, spec in specs.items():
        t = batch[name]
        if tuple(t.shape[1:]) != spec.shape:
            raise DatasetFormatError(f"{where}: tensor {name!r} has per-sample shape {list(t.shape[1:])}, "
                                     f"expected {list(spec.shape)}")
        t = _cast(t.detach().cpu(), spec, f"{where}: tensor {name!r}")
        if name == "timestep_index" and t.numel() and not bool(((t >= 0) & (t <= 7)).all()):
            raise DatasetFormatError(f"{where}: timestep_index must lie in 0..7 (t = k/8), got "
                                     f"{t.min().item()}..{t.max().item()}")
        out[name] = t
    return out
