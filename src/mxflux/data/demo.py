"""The built-in demo dataset: captioned images of coloured shapes, built locally in seconds.

Images are 32x32 RGB pictures of one shape (circle, square, triangle; red, green, blue, yellow;
small or large) on a 3x3 grid of places, captioned like "a large red circle at the top left".
(Version 2 drew one or two shapes and named the size in half of the phrases: in the default job's
560 CPU steps its samples held stray second objects and no recognisable shape; one fully named
shape per image draws one clean object per sample and learns the square first.) Several shapes
joined by "and" still encode and render (`demo_caption`, `render_demo_images`). The places are
"at the top left", "at the top", "at the top right", "on the left", "in the center", "on the
right", "at the bottom left", "at the bottom", "at the bottom right". A small Flux (`flux-tiny`)
learns to draw the named colour at the named place within a few thousand steps (two and a half
minutes on one H200; docs/DATA_FORMAT.md). Everything a real dataset gets from pretrained
networks is replaced by a fixed, exact stand-in:

- "VAE": pixel codes k in 0..255 of R, G, B and a luma channel L, mapped to (k - 128) / 128 (exact
  in bf16) and pixel-unshuffled by 2: [4, 32, 32] -> [16, 16, 16]. `decode_demo_latents` is its
  exact inverse (it ignores L and rounds to the nearest code). The stored log-variance is a
  constant -10, so sampled latents are the means up to ~0.007 (under one pixel code).
- Latent statistics: DEMO_LATENT_SHIFT / DEMO_LATENT_SCALE are these latents' mean and inverse
  standard deviation, so the trainer's (z - shift) * scale has about unit variance. They are
  written to the dataset's meta.json, which is where the trainer must read them from.
- "Text encoders": each word has a fixed pseudo-random embedding derived from a hash of the word
  (SHAKE-256: the same on every machine and version, and defined for any word). t5 [32, 64] is
  word embedding + position embedding per word, padded with a pad embedding; clip [32] is a fixed
  projection of the mean word embedding, scaled to unit RMS. The dims match `flux-tiny`
  (context_in_dim 64, vec_in_dim 32).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .shards import META_FILE, DatasetExistsError, DatasetFormatError, DatasetWriter, read_meta

__all__ = [
    "DEMO_CLIP_DIM", "DEMO_EXAMPLE_PROMPTS", "DEMO_IMAGE_SIZE", "DEMO_LATENT_SCALE", "DEMO_LATENT_SHIFT",
    "DEMO_EVAL_SAMPLES", "DEMO_LOGVAR", "DEMO_T5_DIM", "DEMO_T5_LEN", "DEMO_TRAIN_SAMPLES", "DEMO_VERSION", "Shape",
    "build_demo_dataset",
    "decode_demo_latents", "demo_caption", "demo_vocabulary", "encode_demo_images", "encode_demo_prompts",
    "ensure_demo_dataset", "render_demo_images", "sample_demo_scenes", "unknown_prompt_words_warning",
]

DEMO_VERSION = 3  # bump when images, captions or encoders change (ensure_demo_dataset then refuses old demos)
DEMO_IMAGE_SIZE = 32  # small enough that flux-tiny learns it in minutes on a 2-core CPU
DEMO_LATENT_CHANNELS = 16  # 4 image channels x 2x2
DEMO_LATENT_HW = DEMO_IMAGE_SIZE // 2
DEMO_T5_LEN = 32  # flux-tiny: context_in_dim 64, vec_in_dim 32
DEMO_T5_DIM = 64
DEMO_CLIP_DIM = 32
DEMO_LOGVAR = -10.0
# Mean and 1/std of the demo latents (measured over 8192 training images, seed 0, rounded).
DEMO_LATENT_SHIFT = 0.7816
DEMO_LATENT_SCALE = 4.6154

COLORS = {  # RGB pixel codes
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 90, 220),
    "yellow": (240, 200, 30),
}
BACKGROUND = (235, 235, 230)
KINDS = ("circle", "square", "triangle")
SIZES = {"small": 2.75, "large": 4.25}  # radius in pixels
PLACES = {  # (row, col) on a 3x3 grid -> caption phrase
    (0, 0): "at the top left", (0, 1): "at the top", (0, 2): "at the top right",
    (1, 0): "on the left", (1, 1): "in the center", (1, 2): "on the right",
    (2, 0): "at the bottom left", (2, 1): "at the bottom", (2, 2): "at the bottom right",
}
_JITTER = 0.75  # pixels, uniform, per axis
_SUPERSAMPLE = 4  # anti-aliasing: coverage from 4x4 samples per pixel
_RENDER_CHUNK = 64  # images rendered at a time

DEMO_EXAMPLE_PROMPTS = (
    "a large red circle in the center",
    "a small blue square at the top left",
    "a large yellow triangle at the bottom right",
    "a large green square on the left",
    "a small red triangle at the top and a large blue circle at the bottom",
    "a large green circle on the left and a large yellow square on the right",
    "a small yellow circle at the bottom left",
    "a large blue triangle at the top right and a small green circle at the bottom left",
)


# ---------------------------------------------------------------------------------------------
# Scenes and captions


@dataclass(frozen=True)
class Shape:
    kind: str  # circle | square | triangle
    color: str  # a key of COLORS
    size: str  # small | large
    row: int  # 0..2, top to bottom
    col: int  # 0..2, left to right
    dx: float = 0.0  # jitter of the centre, pixels
    dy: float = 0.0
    say_size: bool = True  # whether the caption names the size (the demo's captions always do)

    @property
    def phrase(self) -> str:
        size = f"{self.size} " if self.say_size else ""
        return f"a {size}{self.color} {self.kind} {PLACES[(self.row, self.col)]}"


def demo_caption(scene: tuple[Shape, ...]) -> str:
    return " and ".join(shape.phrase for shape in scene)


def sample_demo_scenes(n: int, seed: int) -> list[tuple[Shape, ...]]:
    """`n` random scenes of one shape each (size always named), reproducible from `seed`."""
    rng = random.Random(seed)
    scenes = []
    for _ in range(n):
        (r, c), = rng.sample(sorted(PLACES), k=1)
        scenes.append((Shape(kind=rng.choice(KINDS), color=rng.choice(sorted(COLORS)), size=rng.choice(sorted(SIZES)),
                             row=r, col=c, dx=rng.uniform(-_JITTER, _JITTER), dy=rng.uniform(-_JITTER, _JITTER)),))
    return scenes


def _coverage(shapes: list[Shape]) -> torch.Tensor:
    """Fraction of each pixel that each shape covers: [N, 32, 32] (4x4 samples per pixel)."""
    s, size, cell = _SUPERSAMPLE, DEMO_IMAGE_SIZE, DEMO_IMAGE_SIZE / 3
    p = (torch.arange(size * s, dtype=torch.float64) + 0.5) / s  # sample positions, in pixels
    y, x = p[None, :, None], p[None, None, :]

    def column(values) -> torch.Tensor:  # one value per shape, broadcast over [N, rows, cols]
        return torch.tensor(values, dtype=torch.float64)[:, None, None]

    cx = column([(sh.col + 0.5) * cell + sh.dx for sh in shapes])
    cy = column([(sh.row + 0.5) * cell + sh.dy for sh in shapes])
    r = column([SIZES[sh.size] for sh in shapes])
    kind = column([KINDS.index(sh.kind) for sh in shapes])
    ax, ay = (x - cx).abs(), (y - cy).abs()
    circle = ax**2 + ay**2 <= r**2
    square = (ax <= 0.85 * r) & (ay <= 0.85 * r)
    t = 1.1 * r  # an upward equilateral triangle with circumradius 1.1 r
    triangle = (y <= cy + t / 2) & (ax * math.sqrt(3) <= y - (cy - t))
    inside = torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))
    return F.avg_pool2d(inside.double()[:, None], s)[:, 0]


def render_demo_images(scenes: list[tuple[Shape, ...]]) -> torch.Tensor:
    """Images [B, 3, 32, 32], float32 in [0, 1], each pixel a whole code k/255 (anti-aliased)."""
    if len(scenes) > _RENDER_CHUNK:  # bounds the supersampled masks' memory
        return torch.cat([render_demo_images(scenes[i:i + _RENDER_CHUNK])
                          for i in range(0, len(scenes), _RENDER_CHUNK)])
    size = DEMO_IMAGE_SIZE
    img = torch.tensor(BACKGROUND, dtype=torch.float64)[None, :, None, None].repeat(len(scenes), 1, size, size)
    for slot in range(max((len(sc) for sc in scenes), default=0)):  # paint first shapes, then second ones
        which = [i for i, sc in enumerate(scenes) if len(sc) > slot]
        shapes = [scenes[i][slot] for i in which]
        alpha = _coverage(shapes)[:, None]
        color = torch.tensor([COLORS[sh.color] for sh in shapes], dtype=torch.float64)[:, :, None, None]
        img[which] = img[which] * (1 - alpha) + color * alpha
    return (img.round() / 255).float()


# ---------------------------------------------------------------------------------------------
# The demo "VAE": exact and invertible


def encode_demo_images(images: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [0, 1] (whole codes k/255) -> latents [B, 16, H/2, W/2], float32.

    Every latent value is (k - 128) / 128 for an integer code k, exactly representable in bf16.
    """
    if images.dim() != 4 or images.shape[1] != 3 or images.shape[2] % 2 or images.shape[3] % 2:
        raise ValueError(f"expected images [B, 3, H, W] with even H and W, got {list(images.shape)}")
    codes = (images.double() * 255).round()
    if codes.min() < 0 or codes.max() > 255:
        raise ValueError("image values must lie in [0, 1]")
    r, g, b = codes.unbind(1)
    luma = torch.div(77 * r + 150 * g + 29 * b + 128, 256, rounding_mode="floor")  # BT.601, integer
    planes = torch.stack([r, g, b, luma], dim=1)
    return F.pixel_unshuffle((planes - 128) / 128, 2).float()


def decode_demo_latents(z: torch.Tensor) -> torch.Tensor:
    """Latents [B, 16, H/2, W/2] -> images [B, 3, H, W] in [0, 1]: the inverse of `encode_demo_images`.

    Takes raw latents (as stored; a model's normalised output x becomes x / scale + shift first).
    Values are rounded to the nearest pixel code, so decode(encode(images)) == images exactly.
    """
    if z.dim() != 4 or z.shape[1] != DEMO_LATENT_CHANNELS:
        raise ValueError(f"expected latents [B, {DEMO_LATENT_CHANNELS}, h, w], got {list(z.shape)}")
    planes = F.pixel_shuffle(z.detach().double().cpu(), 2)
    codes = (planes[:, :3] * 128 + 128).round().clamp(0, 255)
    return codes.float() / 255


# ---------------------------------------------------------------------------------------------
# The demo "text encoders": fixed, hash-derived embeddings


def _hash_uniform(key: str, n: int) -> torch.Tensor:
    """`n` values, uniform with unit variance, derived only from `key` (identical everywhere)."""
    raw = hashlib.shake_256(f"mxflux-demo-v{DEMO_VERSION}/{key}".encode()).digest(4 * n)
    ints = torch.from_numpy(np.frombuffer(raw, dtype="<u4").astype(np.float64))
    return ((ints + 0.5) / 2**32 * 2 - 1) * math.sqrt(3)


@lru_cache(maxsize=4096)
def _word(word: str) -> torch.Tensor:
    return _hash_uniform(f"word/{word}", DEMO_T5_DIM)


@lru_cache(maxsize=1)
def _positions() -> torch.Tensor:
    return torch.stack([0.5 * _hash_uniform(f"position/{i}", DEMO_T5_DIM) for i in range(DEMO_T5_LEN)])


@lru_cache(maxsize=1)
def _clip_projection() -> torch.Tensor:
    rows = [_hash_uniform(f"clip/{i}", DEMO_T5_DIM) for i in range(DEMO_CLIP_DIM)]
    return torch.stack(rows) / math.sqrt(DEMO_T5_DIM)


def _words(prompt: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", prompt.lower())[:DEMO_T5_LEN]


def demo_vocabulary() -> frozenset[str]:
    """Every word of the demo's captions: the words the demo text encoder's model was trained on."""
    phrases = [*COLORS, *KINDS, *SIZES, *PLACES.values(), "a", "and"]
    return frozenset(w for phrase in phrases for w in _words(phrase))


def unknown_prompt_words_warning(prompts: list[str] | tuple[str, ...]) -> str | None:
    """One line naming the prompt words outside the demo's captions (None: there are none). Any
    word encodes (the embeddings are hashes), but a model trained on the demo never saw these, so
    a sample of such a prompt silently draws something else."""
    known = demo_vocabulary()
    unknown: dict[str, list[str]] = {}  # prompt -> its unknown words, in order
    for prompt in prompts:
        words = [w for w in dict.fromkeys(_words(prompt)) if w not in known]
        if words:
            unknown[prompt] = words
    if not unknown:
        return None
    listed = "; ".join(f"{', '.join(words)} (in {prompt!r})" for prompt, words in unknown.items())
    return (f"warning: the demo text encoder does not know {listed}: the demo's captions name only a colour "
            f"({', '.join(COLORS)}), a shape ({', '.join(KINDS)}), a size ({', '.join(SIZES)}) and a place "
            f"(e.g. 'at the top left', 'in the center')")


def encode_demo_prompts(prompts: list[str] | tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (t5 [B, 32, 64], clip [B, 32]), bf16. Any words work; the empty prompt too."""
    if isinstance(prompts, str):
        raise TypeError("encode_demo_prompts takes a list of prompts, not one string")
    t5 = torch.empty((len(prompts), DEMO_T5_LEN, DEMO_T5_DIM), dtype=torch.float64)
    clip = torch.empty((len(prompts), DEMO_CLIP_DIM), dtype=torch.float64)
    pad = _word("<pad>")
    for i, prompt in enumerate(prompts):
        words = _words(prompt)
        t5[i] = pad
        for j, w in enumerate(words):
            t5[i, j] = _word(w) + _positions()[j]
        pooled = torch.stack([_word(w) for w in words]).mean(0) if words else pad
        c = _clip_projection() @ pooled
        clip[i] = c / c.pow(2).mean().sqrt()
    return t5.to(torch.bfloat16), clip.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The dataset


# The built-in dataset's split sizes (what `mxflux train` builds on first use).
DEMO_TRAIN_SAMPLES, DEMO_EVAL_SAMPLES = 2048, 256


def _source(n_train: int, n_eval: int, seed: int) -> dict:
    return {"kind": "demo", "demo_version": DEMO_VERSION, "n_train": n_train, "n_eval": n_eval, "seed": seed,
            "image_size": DEMO_IMAGE_SIZE, "decoder": "mxflux.data.demo.decode_demo_latents"}


def _write_demo(writer: DatasetWriter, n_train: int, n_eval: int, seed: int, chunk: int = 256) -> None:
    for split, count, split_seed in (("train", n_train, 2 * seed), ("eval", n_eval, 2 * seed + 1)):
        scenes = sample_demo_scenes(count, split_seed)
        for start in range(0, count, chunk):
            part = scenes[start:start + chunk]
            captions = [demo_caption(s) for s in part]
            mean = encode_demo_images(render_demo_images(part))
            t5, clip = encode_demo_prompts(captions)
            batch = {"vae_mean": mean, "vae_logvar": torch.full_like(mean, DEMO_LOGVAR), "t5": t5, "clip": clip}
            if split == "eval":
                batch["timestep_index"] = torch.arange(start, start + len(part)) % 8
            writer.write(split, batch, captions=captions)
    t5_empty, clip_empty = encode_demo_prompts([""])
    writer.write_empty_encodings(t5_empty[0], clip_empty[0])


def _demo_writer(root: str | os.PathLike, n_train: int, n_eval: int, seed: int) -> DatasetWriter:
    return DatasetWriter(root, l_txt=DEMO_T5_LEN, d_t5=DEMO_T5_DIM, d_clip=DEMO_CLIP_DIM,
                         latent_channels=DEMO_LATENT_CHANNELS, latent_hw=DEMO_LATENT_HW,
                         latent_shift=DEMO_LATENT_SHIFT, latent_scale=DEMO_LATENT_SCALE,
                         samples_per_shard=1024, source=_source(n_train, n_eval, seed))


def build_demo_dataset(root: str | os.PathLike, *, n_train: int = DEMO_TRAIN_SAMPLES, n_eval: int = DEMO_EVAL_SAMPLES,
                       seed: int = 0) -> Path:
    """Write the demo dataset to `root` (which must not hold anything yet); returns `root`."""
    with _demo_writer(root, n_train, n_eval, seed) as writer:
        _write_demo(writer, n_train, n_eval, seed)
    return Path(root)


def ensure_demo_dataset(root: str | os.PathLike, *, n_train: int = DEMO_TRAIN_SAMPLES, n_eval: int = DEMO_EVAL_SAMPLES,
                        seed: int = 0) -> Path:
    """`root` holding the demo dataset: built on first use, reused afterwards; returns `root`.

    Safe to call from several processes at once (e.g. every rank of a torchrun job): each builds
    in its own staging directory and the first to finish moves it into place. Refuses a `root`
    that holds anything else, or a demo built with other arguments or by another demo version.
    """
    root = Path(root)
    if not (root / META_FILE).exists():
        try:
            writer = _demo_writer(root, n_train, n_eval, seed)  # refuses a `root` that holds files
        except DatasetExistsError:
            if not (root / META_FILE).exists():
                raise
            writer = None  # another process finished the demo meanwhile
        if writer is not None:
            try:
                with writer:
                    _write_demo(writer, n_train, n_eval, seed)
            except DatasetExistsError:  # another process finished first: use its dataset
                shutil.rmtree(writer.staging, ignore_errors=True)
    source = read_meta(root).source
    want = _source(n_train, n_eval, seed)
    if source.get("kind") != "demo":
        raise DatasetFormatError(f"{root} holds a dataset that is not the demo (source {source}); "
                                 f"choose another directory for the demo")
    if source != want:
        raise DatasetFormatError(f"{root} holds a demo dataset built as {source}, but {want} was asked "
                                 f"for: remove it to rebuild, or choose another directory")
    return root
