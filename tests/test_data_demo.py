"""The built-in demo dataset: exact pixel 'VAE', hashed text encoders, files in the format, reuse."""

from __future__ import annotations

import json

import pytest
import torch

from mxflux.data.demo import (
    BACKGROUND,
    DEMO_CLIP_DIM,
    DEMO_LATENT_SCALE,
    DEMO_LATENT_SHIFT,
    DEMO_LOGVAR,
    DEMO_T5_DIM,
    DEMO_T5_LEN,
    Shape,
    build_demo_dataset,
    decode_demo_latents,
    demo_caption,
    encode_demo_images,
    encode_demo_prompts,
    ensure_demo_dataset,
    render_demo_images,
    sample_demo_scenes,
)
from mxflux.data.shards import META_FILE, DatasetExistsError, DatasetFormatError, LatentDataset, load_empty_encodings


def random_codes_image(gen: torch.Generator, b: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (b, 3, 32, 32), generator=gen).float() / 255


def test_vae_round_trip_is_exact_for_any_image(gen):
    images = random_codes_image(gen)
    z = encode_demo_images(images)
    assert z.shape == (3, 16, 16, 16)
    assert torch.equal(z.bfloat16().float(), z)  # exactly representable in the stored dtype
    assert torch.equal(decode_demo_latents(z.bfloat16()), images)


def test_vae_round_trip_is_exact_for_rendered_scenes(gen):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    images = render_demo_images(sample_demo_scenes(8, seed))
    assert images.shape == (8, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    assert torch.equal((images * 255).round() / 255, images)  # whole pixel codes
    assert torch.equal(decode_demo_latents(encode_demo_images(images).bfloat16()), images)


def test_decode_clamps_and_rounds_generated_latents(gen):
    z = 3 * torch.randn((2, 16, 16, 16), generator=gen)
    images = decode_demo_latents(z)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    assert torch.equal(decode_demo_latents(encode_demo_images(images)), images)


def test_vae_rejects_bad_input():
    with pytest.raises(ValueError, match="expected images"):
        encode_demo_images(torch.zeros(1, 4, 32, 32))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        encode_demo_images(torch.full((1, 3, 32, 32), 1.5))
    with pytest.raises(ValueError, match="expected latents"):
        decode_demo_latents(torch.zeros(1, 4, 16, 16))


def test_scenes_and_captions_vary(gen):
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    scenes = sample_demo_scenes(64, seed)
    captions = [demo_caption(s) for s in scenes]
    # 64 draws of 216 captions give 55 distinct on average (47-63 over 2000 seeds): more than 40
    # (5 standard deviations below the mean; "> 50" failed for 2 % of seeds)
    assert len(set(captions)) > 40
    assert {len(s) for s in scenes} == {1}  # one shape per picture, its size always named
    assert {s[0].kind for s in scenes} == {"circle", "square", "triangle"} and all(s[0].say_size for s in scenes)
    images = render_demo_images(scenes)
    # Scenes with different captions never share a picture. (Two draws of one caption may: 64
    # draws of 216 captions repeat some, and jitters within a quarter pixel can render alike.)
    captions_of = {}
    for img, caption in zip(images, captions):
        captions_of.setdefault(img.numpy().tobytes(), set()).add(caption)
    assert all(len(c) == 1 for c in captions_of.values())
    assert len(captions_of) >= len(set(captions))
    assert sample_demo_scenes(64, seed) == scenes  # reproducible


def test_caption_matches_the_picture():
    (img,) = render_demo_images([(Shape("square", "red", "large", 0, 0),)])
    assert demo_caption((Shape("square", "red", "large", 0, 0),)) == "a large red square at the top left"
    # The red square sits in the top-left cell; the rest is background.
    red = (img[0] > 0.8) & (img[1] < 0.3) & (img[2] < 0.3)
    assert red[:11, :11].sum() > 35 and red[11:, :].sum() == 0 and red[:, 11:].sum() == 0
    background = torch.tensor(BACKGROUND)[:, None, None] / 255
    assert torch.equal(img[:, 12:, :], background.expand(3, 20, 32))
    assert torch.equal(img[:, :, 12:], background.expand(3, 32, 20))


def test_text_encoder_is_deterministic_and_distinguishes_prompts():
    prompts = ["a large red circle at the top left", "a large red circle at the top right",
               "a large blue circle at the top left", "left top the at circle red large a", "", "zebra"]
    t5, clip = encode_demo_prompts(prompts)
    assert t5.shape == (6, DEMO_T5_LEN, DEMO_T5_DIM) and clip.shape == (6, DEMO_CLIP_DIM)
    assert t5.dtype == clip.dtype == torch.bfloat16
    t5_again, clip_again = encode_demo_prompts(list(reversed(prompts)))
    assert torch.equal(t5_again.flip(0), t5) and torch.equal(clip_again.flip(0), clip)
    assert len({t.numpy().tobytes() for t in t5.float()}) == 6  # word order matters in t5
    assert torch.equal(clip[0], clip[3])  # the pooled vector is a bag of words
    assert not torch.equal(clip[0], clip[1]) and not torch.equal(clip[0], clip[2])
    assert 0.8 < clip.float().pow(2).mean(1).sqrt().min() and clip.float().pow(2).mean(1).sqrt().max() < 1.2
    with pytest.raises(TypeError):
        encode_demo_prompts("a red circle")


def test_dims_match_flux_tiny():
    configs = pytest.importorskip("mxflux.model.configs")
    tiny = configs.flux_config("flux-tiny")
    assert (tiny.context_in_dim, tiny.vec_in_dim, tiny.in_channels) == (DEMO_T5_DIM, DEMO_CLIP_DIM, 16 * 4)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo") / "demo"
    build_demo_dataset(root, n_train=96, n_eval=20, seed=3)
    return root


def test_demo_files_are_in_the_format(demo_root):
    train, ev = LatentDataset(demo_root, "train"), LatentDataset(demo_root, "eval")
    assert (len(train), len(ev)) == (96, 20)
    assert (train.latent_shift, train.latent_scale) == (DEMO_LATENT_SHIFT, DEMO_LATENT_SCALE)
    assert train.latent_shape == (16, 16, 16) and train.t5_shape == (DEMO_T5_LEN, DEMO_T5_DIM)
    assert train.clip_dim == DEMO_CLIP_DIM
    meta = json.loads((demo_root / META_FILE).read_text())
    assert meta["source"]["kind"] == "demo"

    captions = train.captions()
    batch = train.gather(range(len(train)))
    scenes = sample_demo_scenes(96, 2 * 3)  # the train split's scenes for seed 3
    assert captions == [demo_caption(s) for s in scenes]
    assert torch.equal(decode_demo_latents(batch["vae_mean"]), render_demo_images(scenes))
    assert bool((batch["vae_logvar"] == DEMO_LOGVAR).all())
    t5, clip = encode_demo_prompts(captions)
    assert torch.equal(batch["t5"], t5) and torch.equal(batch["clip"], clip)
    assert [int(ev[i]["timestep_index"]) for i in range(20)] == [i % 8 for i in range(20)]
    t5_empty, clip_empty = load_empty_encodings(demo_root)
    e_t5, e_clip = encode_demo_prompts([""])
    assert torch.equal(t5_empty, e_t5[0]) and torch.equal(clip_empty, e_clip[0])


def test_normalised_demo_latents_have_about_unit_variance(demo_root):
    ds = LatentDataset(demo_root, "train")
    z = ds.gather(range(len(ds)))["vae_mean"].float()
    x = (z - ds.latent_shift) * ds.latent_scale  # what the trainer computes
    assert abs(x.mean().item()) < 0.2 and 0.8 < x.std().item() < 1.25


def test_ensure_demo_dataset_builds_once(tmp_path):
    root = tmp_path / "demo"
    assert ensure_demo_dataset(root, n_train=16, n_eval=8) == root
    meta = root / META_FILE
    stamp = meta.stat().st_mtime_ns
    shard = next((root / "train").iterdir())
    shard_stamp = shard.stat().st_mtime_ns
    assert ensure_demo_dataset(root, n_train=16, n_eval=8) == root
    assert meta.stat().st_mtime_ns == stamp and shard.stat().st_mtime_ns == shard_stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no staging left behind
    with pytest.raises(DatasetFormatError, match="built as"):
        ensure_demo_dataset(root, n_train=16, n_eval=8, seed=1)


def test_ensure_demo_dataset_refuses_other_contents(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep me")
    with pytest.raises(DatasetExistsError, match="holds files"):
        ensure_demo_dataset(tmp_path / "notes")
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep me"

    from mxflux.data.synth import write_synthetic

    write_synthetic(tmp_path / "synth", n_train=2, n_eval=1, l_txt=2, d_t5=4, d_clip=2, latent_hw=2)
    with pytest.raises(DatasetFormatError, match="not the demo"):
        ensure_demo_dataset(tmp_path / "synth")
