"""The on-disk dataset format: writer -> reader round trips and the errors for broken datasets."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mxflux.data.shards import (
    META_FILE,
    DatasetExistsError,
    DatasetFormatError,
    DatasetNotFoundError,
    DatasetWriter,
    LatentDataset,
    load_empty_encodings,
    read_meta,
)

DIMS = dict(l_txt=5, d_t5=12, d_clip=6, latent_channels=16, latent_hw=4)


def random_batch(n: int, gen: torch.Generator, *, eval_split: bool = False, start: int = 0) -> dict:
    c, hw = DIMS["latent_channels"], DIMS["latent_hw"]
    batch = {
        "vae_mean": torch.randn((n, c, hw, hw), generator=gen),
        "vae_logvar": torch.rand((n, c, hw, hw), generator=gen) * 4 - 6,
        "t5": torch.randn((n, DIMS["l_txt"], DIMS["d_t5"]), generator=gen),
        "clip": torch.randn((n, DIMS["d_clip"]), generator=gen).bfloat16(),  # already stored dtype
    }
    if eval_split:
        batch["timestep_index"] = torch.randint(0, 8, (n,), generator=gen)
    return batch


def write_dataset(root, gen, *, train_sizes=(3, 7, 1, 6), eval_sizes=(4, 5), samples_per_shard=5,
                  captions=True):
    """A dataset written in uneven batches that straddle shard boundaries; returns what went in."""
    written = {"train": [], "eval": []}
    caps = {"train": [], "eval": []}
    with DatasetWriter(root, **DIMS, samples_per_shard=samples_per_shard, latent_shift=0.25,
                       latent_scale=2.0, source={"kind": "test"}) as w:
        for split, sizes in (("train", train_sizes), ("eval", eval_sizes)):
            for n in sizes:
                b = random_batch(n, gen, eval_split=split == "eval")
                c = [f"caption {len(caps[split]) + i} \u00e9\n\"quoted\"" for i in range(n)] if captions else None
                w.write(split, b, captions=c)
                written[split].append(b)
                caps[split] += c or []
        t5_empty = torch.randn((DIMS["l_txt"], DIMS["d_t5"]), generator=gen)
        clip_empty = torch.randn((DIMS["d_clip"],), generator=gen)
        w.write_empty_encodings(t5_empty, clip_empty)
    stacked = {split: {k: torch.cat([b[k] for b in bs]) for k in bs[0]} for split, bs in written.items()}
    return stacked, caps, (t5_empty, clip_empty)


def stored(t: torch.Tensor) -> torch.Tensor:
    """What the writer stores for an input tensor: floats in bf16, integers in int64."""
    return t.bfloat16() if t.is_floating_point() else t.long()


def test_round_trip_is_bit_exact(tmp_path, gen):
    root = tmp_path / "ds"
    data, caps, (t5_empty, clip_empty) = write_dataset(root, gen)
    for split in ("train", "eval"):
        ds = LatentDataset(root, split)
        n = len(data[split]["t5"])
        assert len(ds) == n
        assert ds.captions() == caps[split]
        for i in range(n):
            sample = ds[i]
            assert set(sample) == set(data[split]) | {"index"}
            assert sample["index"].item() == i
            for k, v in data[split].items():
                assert sample[k].dtype == stored(v).dtype
                assert torch.equal(sample[k], stored(v[i])), (split, i, k)
        order = torch.randperm(n, generator=gen).tolist()
        batch = ds.gather(order)
        assert batch["index"].tolist() == order
        for k, v in data[split].items():
            assert torch.equal(batch[k], stored(v)[order]), (split, k)
    t5, clip = load_empty_encodings(root)
    assert torch.equal(t5, t5_empty.bfloat16()) and torch.equal(clip, clip_empty.bfloat16())
    t5, clip = load_empty_encodings(root, dtype=torch.float32)
    assert t5.dtype == torch.float32 and torch.equal(t5, t5_empty.bfloat16().float())


def test_meta_records_shards_specs_and_latent_facts(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    meta = read_meta(root)
    assert (meta.latent_shift, meta.latent_scale) == (0.25, 2.0)
    train = meta.splits["train"]
    assert train.num_samples == 17 and [c for _, c in train.shards] == [5, 5, 5, 2]
    assert train.tensors["t5"].shape == (5, 12) and train.tensors["t5"].dtype == "bfloat16"
    assert "timestep_index" not in train.tensors
    assert meta.splits["eval"].tensors["timestep_index"].shape == ()
    assert meta.splits["eval"].tensors["timestep_index"].dtype == "int64"
    assert meta.source == {"kind": "test"}
    ds = LatentDataset(root, "train")
    assert ds.latent_shape == (16, 4, 4) and ds.t5_shape == (5, 12) and ds.clip_dim == 6
    assert (ds.latent_shift, ds.latent_scale) == (0.25, 2.0)
    # Shards are plain safetensors files, stacked per tensor.
    shard = load_file(root / train.shards[0][0])
    assert shard["t5"].shape == (5, 5, 12) and shard["t5"].dtype == torch.bfloat16


def test_loader_without_captions(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen, captions=False)
    assert LatentDataset(root, "train").captions() is None


# --- the writer never loses or overwrites data ----------------------------------------------


def test_writer_refuses_a_non_empty_target(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    before = (root / META_FILE).read_text()
    with pytest.raises(DatasetExistsError, match="never overwrites"):
        DatasetWriter(root, **DIMS)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(DatasetExistsError, match="holds files"):
        DatasetWriter(tmp_path / "other", **DIMS)
    assert (root / META_FILE).read_text() == before
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_writer_accepts_an_empty_directory(tmp_path, gen):
    root = tmp_path / "empty"
    root.mkdir()
    write_dataset(root, gen)
    assert len(LatentDataset(root, "train")) == 17


def test_failed_write_leaves_nothing_behind(tmp_path, gen):
    root = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="encoder crashed"):
        with DatasetWriter(root, **DIMS, samples_per_shard=2) as w:
            w.write("train", random_batch(5, gen))  # two shards already on disk (in staging)
            raise RuntimeError("encoder crashed")
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone too


def test_nothing_is_visible_before_commit(tmp_path, gen):
    root = tmp_path / "ds"
    w = DatasetWriter(root, **DIMS, samples_per_shard=2)
    w.write("train", random_batch(5, gen))
    assert not root.exists()
    w.write("eval", random_batch(3, gen, eval_split=True))
    w.write_empty_encodings(torch.zeros(5, 12), torch.zeros(6))
    assert w.commit() == root
    assert len(LatentDataset(root, "train")) == 5 and not w.staging.exists()
    with pytest.raises(RuntimeError, match="already committed"):
        w.write("train", random_batch(1, gen))


def test_commit_needs_the_empty_encodings(tmp_path, gen):
    with pytest.raises(DatasetFormatError, match="empty-prompt encodings"):
        with DatasetWriter(tmp_path / "ds", **DIMS) as w:
            w.write("train", random_batch(2, gen))


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop("clip"), r"missing \['clip'\]"),
    (lambda b: b.update(extra=torch.zeros(3)), r"unexpected \['extra'\]"),
    (lambda b: b.update(t5=torch.zeros(3, 5, 13)), r"tensor 't5' has per-sample shape \[5, 13\], expected \[5, 12\]"),
    (lambda b: b.update(clip=torch.zeros(2, 6)), "disagree on the number of samples"),
    (lambda b: b.update(vae_mean=torch.zeros(3, 16, 4, 4, dtype=torch.int64)),
     "tensor 'vae_mean' has dtype int64, expected bfloat16"),
])
def test_writer_names_the_bad_tensor(tmp_path, gen, change, message):
    batch = random_batch(3, gen)
    change(batch)
    w = DatasetWriter(tmp_path / "ds", **DIMS)
    with pytest.raises(DatasetFormatError, match=message):
        w.write("train", batch)
    w.abort()


def test_writer_checks_timestep_index_range(tmp_path, gen):
    batch = random_batch(3, gen, eval_split=True)
    batch["timestep_index"] = torch.tensor([0, 8, 2])
    w = DatasetWriter(tmp_path / "ds", **DIMS)
    with pytest.raises(DatasetFormatError, match="timestep_index must lie in 0..7"):
        w.write("eval", batch)
    with pytest.raises(DatasetFormatError, match="3 captions for 2 samples"):
        w.write("train", random_batch(2, gen), captions=["a", "b", "c"])
    w.abort()


# --- the reader's checks ---------------------------------------------------------------------


def test_missing_directory_and_meta(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        LatentDataset(tmp_path / "nowhere", "train")
    (tmp_path / "bare").mkdir()
    with pytest.raises(DatasetFormatError, match="has no meta.json"):
        LatentDataset(tmp_path / "bare", "train")


def test_unknown_split(tmp_path, gen):
    write_dataset(tmp_path / "ds", gen)
    with pytest.raises(DatasetFormatError, match=r"no split 'val'; it has \['eval', 'train'\]"):
        LatentDataset(tmp_path / "ds", "val")


def test_missing_shard_is_named(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    (root / "train" / "shard-00002.safetensors").unlink()
    with pytest.raises(DatasetFormatError, match=r"train/shard-00002.safetensors: file is missing"):
        LatentDataset(root, "train")
    LatentDataset(root, "eval")  # the other split is intact


def _rewrite_shard(path, **changes):
    tensors = load_file(path)
    tensors.update(changes)
    save_file({k: v for k, v in tensors.items() if v is not None}, path)


def test_shard_shape_mismatch_names_tensor_and_expectation(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    _rewrite_shard(root / "train" / "shard-00001.safetensors", t5=torch.zeros(5, 5, 11, dtype=torch.bfloat16))
    with pytest.raises(DatasetFormatError, match=r"shard-00001.safetensors: tensor 't5' has shape \[5, 5, 11\], "
                                                 r"expected \[5, 5, 12\]"):
        LatentDataset(root, "train")


def test_shard_sample_count_mismatch(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    _rewrite_shard(root / "eval" / "shard-00000.safetensors", clip=torch.zeros(4, 6, dtype=torch.bfloat16))
    with pytest.raises(DatasetFormatError, match=r"tensor 'clip' has shape \[4, 6\], expected \[5, 6\]"):
        LatentDataset(root, "eval")


def test_shard_dtype_mismatch_names_tensor_and_expectation(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    _rewrite_shard(root / "train" / "shard-00000.safetensors", vae_logvar=torch.zeros(5, 16, 4, 4))
    with pytest.raises(DatasetFormatError, match="tensor 'vae_logvar' has dtype float32, expected bfloat16"):
        LatentDataset(root, "train")


def test_shard_missing_or_extra_tensor(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    path = root / "train" / "shard-00000.safetensors"
    original = load_file(path)
    _rewrite_shard(path, clip=None)
    with pytest.raises(DatasetFormatError, match="tensor 'clip' is missing"):
        LatentDataset(root, "train")
    save_file({**original, "mask": torch.zeros(5)}, path)
    with pytest.raises(DatasetFormatError, match=r"unexpected tensor\(s\) \['mask'\]"):
        LatentDataset(root, "train")


def test_truncated_shard(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    path = root / "train" / "shard-00000.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DatasetFormatError, match="not a readable safetensors file"):
        LatentDataset(root, "train")


def _edit_meta(root, edit):
    meta = json.loads((root / META_FILE).read_text())
    edit(meta)
    (root / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format="webdataset"), "format is 'webdataset', expected 'mxflux-latents'"),
    (lambda m: m.update(format_version=99), "format_version 99 is newer"),
    (lambda m: m["latent"].pop("scale"), r"latent.scale: expected a number"),
    (lambda m: m["splits"]["train"].update(num_samples=18), "shards hold 17 samples but num_samples is 18"),
    (lambda m: m["splits"]["eval"]["tensors"].pop("timestep_index"), r"missing tensor\(s\) \['timestep_index'\]"),
    (lambda m: m["splits"]["train"]["tensors"]["t5"].update(dtype="bf16"), "dtype 'bf16' is not one of"),
    (lambda m: m["empty_encodings"]["tensors"].pop("clip_empty"), r"missing tensor\(s\) \['clip_empty'\]"),
])
def test_meta_errors_name_the_field(tmp_path, gen, edit, message):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    _edit_meta(root, edit)
    with pytest.raises(DatasetFormatError, match=message):
        read_meta(root)


def test_meta_spec_disagreeing_with_shards(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    _edit_meta(root, lambda m: m["splits"]["train"]["tensors"]["clip"].update(shape=[7]))
    with pytest.raises(DatasetFormatError, match=r"tensor 'clip' has shape \[5, 6\], expected \[5, 7\]"):
        LatentDataset(root, "train")


def test_empty_encodings_checked(tmp_path, gen):
    root = tmp_path / "ds"
    write_dataset(root, gen)
    bad = {"t5_empty": torch.zeros(5, 12, dtype=torch.bfloat16), "clip_empty": torch.zeros(7, dtype=torch.bfloat16)}
    save_file(bad, root / "empty_encodings.safetensors")
    with pytest.raises(DatasetFormatError, match=r"tensor 'clip_empty' has shape \[7\], expected \[6\]"):
        load_empty_encodings(root)


def test_index_out_of_range(tmp_path, gen):
    write_dataset(tmp_path / "ds", gen)
    ds = LatentDataset(tmp_path / "ds", "eval")
    with pytest.raises(IndexError, match="sample 9 is out of range"):
        ds[9]


def test_map_safetensors_equals_load_file_for_mixed_dtypes(tmp_path, gen):
    from mxflux.data.shards import map_safetensors

    tensors = {  # odd sizes: the int64 and fp32 tensors must still land aligned
        "a": torch.randn((3, 5), generator=gen).bfloat16(),
        "b": torch.randint(0, 9, (7,), generator=gen),
        "c": torch.randn((1,), generator=gen),
        "d": torch.randn((5,), generator=gen).half(),
        "e": torch.randn((), generator=gen).bfloat16(),
    }
    save_file(tensors, tmp_path / "x.safetensors", metadata={"k": "v"})
    mapped = map_safetensors(tmp_path / "x.safetensors")
    assert mapped.keys() == tensors.keys()
    for k, v in tensors.items():
        assert mapped[k].dtype == v.dtype and torch.equal(mapped[k], v), k


def test_shards_are_memory_mapped_not_read(tmp_path, gen):
    # A memory map shows what is in the file when a sample is read, not when the shard was opened.
    root = tmp_path / "ds"
    write_dataset(root, gen)
    ds = LatentDataset(root, "train")
    before = ds[6]["clip"]  # maps shard 1; sample 6 is its row 1
    path = root / "train" / "shard-00001.safetensors"
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    clip_start = json.loads(raw[8:8 + header_len])["clip"]["data_offsets"][0]
    new = torch.randn(6, generator=gen).bfloat16()
    with open(path, "r+b") as f:
        f.seek(8 + header_len + clip_start + 1 * 6 * 2)
        f.write(new.view(torch.uint8).numpy().tobytes())
    assert not torch.equal(new, before)
    assert torch.equal(ds[6]["clip"], new)
