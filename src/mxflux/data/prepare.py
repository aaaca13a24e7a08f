"""Encode captioned images into a dataset: a diffusers VAE, a T5 encoder and a CLIP text encoder.

Input: a directory of images (.png .jpg .jpeg .webp, searched recursively, taken in sorted path
order), each with its caption in a text file of the same stem beside it (`cat.jpg` + `cat.txt`).
Each image is resized (shorter side to `image_size`, bicubic) and centre-cropped to a square, scaled
to [-1, 1] and encoded by `AutoencoderKL`: the latent distribution's mean and log-variance are
stored (the trainer samples from them every step). Captions go through T5 (`last_hidden_state`,
padded or truncated to `t5_len` tokens, no attention mask: as BFL's and the MLPerf reference's
embedder) and CLIP (`pooler_output`, 77 tokens). The empty prompt's encodings are stored for CFG
dropout; the latent shift and scale are the VAE config's `shift_factor` and `scaling_factor`.

Needs the `prepare` extra (diffusers, transformers, pillow). Models are loaded from local
directories (`from_pretrained(path)`); for the MLPerf models these are the `vae`, `text_encoder_2`
(T5-XXL) and `text_encoder` (CLIP-L) folders of FLUX.1-schnell, with tokenizers in `tokenizer_2`
and `tokenizer`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .shards import DataError, DatasetWriter, check_output_dir

__all__ = ["IMAGE_SUFFIXES", "find_captioned_images", "prepare_dataset", "vae_latent_normalisation"]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
CLIP_MAX_LENGTH = 77


def find_captioned_images(image_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """(image path, caption) for every image under `image_dir`, in sorted path order."""
    image_dir = Path(image_dir)
    if not image_dir.is_dir():
        raise DataError(f"image directory {image_dir} does not exist")
    images = sorted(p for p in image_dir.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise DataError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {image_dir}")
    pairs = []
    for path in images:
        caption_file = path.with_suffix(".txt")
        if not caption_file.is_file():
            raise DataError(f"image {path} has no caption file {caption_file.name} beside it")
        pairs.append((path, caption_file.read_text(encoding="utf-8").strip()))
    return pairs


def _load_image(path: Path, size: int) -> torch.Tensor:
    """An image file -> [3, size, size] in [-1, 1]: shorter side resized to `size`, centre crop."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        w, h = im.size
        s = size / min(w, h)
        im = im.resize((max(size, round(w * s)), max(size, round(h * s))), Image.Resampling.BICUBIC)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
        pixels = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy())
    return pixels.permute(2, 0, 1).float() / 127.5 - 1


def vae_latent_normalisation(vae) -> tuple[float, float]:
    """(shift, scale) of a diffusers AutoencoderKL's latents: its config's `shift_factor` (0 when
    absent, as in SD-style VAEs) and `scaling_factor`. A dataset stores (z - shift) · scale."""
    return float(getattr(vae.config, "shift_factor", None) or 0.0), float(vae.config.scaling_factor)


class _Encoders:
    """The three pretrained encoders, loaded once, in eval mode on `device`."""

    def __init__(self, *, vae_path, t5_path, clip_path, t5_tokenizer_path, clip_tokenizer_path, t5_len,
                 device, dtype):
        try:
            from diffusers import AutoencoderKL
            from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel
        except ImportError as e:
            raise DataError(f"`mxflux data prepare` needs diffusers and transformers "
                            f"(pip install 'mxflux[prepare]'): {e}") from None
        self.device, self.dtype, self.t5_len = torch.device(device), dtype, t5_len
        self.vae = AutoencoderKL.from_pretrained(vae_path, torch_dtype=dtype).to(self.device).eval()
        self.t5_tok = AutoTokenizer.from_pretrained(t5_tokenizer_path or t5_path)
        self.t5 = T5EncoderModel.from_pretrained(t5_path, torch_dtype=dtype).to(self.device).eval()
        self.clip_tok = AutoTokenizer.from_pretrained(clip_tokenizer_path or clip_path)
        self.clip = CLIPTextModel.from_pretrained(clip_path, torch_dtype=dtype).to(self.device).eval()

    @torch.no_grad()
    def images(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist
        return dist.mean.float().cpu(), dist.logvar.float().cpu()

    @torch.no_grad()
    def captions(self, captions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        captions = list(captions)
        ids = self.t5_tok(captions, padding="max_length", max_length=self.t5_len, truncation=True,
                          return_tensors="pt").input_ids.to(self.device)
        t5 = self.t5(input_ids=ids).last_hidden_state
        ids = self.clip_tok(captions, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True,
                            return_tensors="pt").input_ids.to(self.device)
        clip = self.clip(input_ids=ids).pooler_output
        return t5.float().cpu(), clip.float().cpu()


def prepare_dataset(image_dir: str | os.PathLike, out: str | os.PathLike, *, vae_path: str | os.PathLike,
                    t5_path: str | os.PathLike, clip_path: str | os.PathLike,
                    t5_tokenizer_path: str | os.PathLike | None = None,
                    clip_tokenizer_path: str | os.PathLike | None = None, t5_len: int = 256,
                    image_size: int = 256, batch_size: int = 16, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, eval_dir: str | os.PathLike | None = None,
                    num_eval: int = 0, samples_per_shard: int | None = None) -> Path:
    """Encode the captioned images of `image_dir` (and `eval_dir`) into a dataset at `out`.

    The eval split is `eval_dir`'s images when given, else the last `num_eval` images of
    `image_dir`; eval sample i gets timestep_index i % 8. `dtype` is the encoders' compute dtype
    (default: bf16 on CUDA, fp32 elsewhere); tensors are stored in bf16 whatever it is.
    """
    check_output_dir(out)  # before loading any model
    train = find_captioned_images(image_dir)
    if eval_dir is not None:
        evals = find_captioned_images(eval_dir)
    else:
        if not 0 <= num_eval < len(train):
            raise DataError(f"num_eval {num_eval} must leave training images: {image_dir} has {len(train)}")
        train, evals = train[:len(train) - num_eval], train[len(train) - num_eval:]
    if batch_size <= 0 or image_size <= 0 or t5_len <= 0:
        raise DataError(f"batch_size, image_size and t5_len must be positive "
                        f"(got {batch_size}, {image_size}, {t5_len})")
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    enc = _Encoders(vae_path=vae_path, t5_path=t5_path, clip_path=clip_path, t5_tokenizer_path=t5_tokenizer_path,
                    clip_tokenizer_path=clip_tokenizer_path, t5_len=t5_len, device=device, dtype=dtype)

    # One tiny pass fixes the dims the writer needs: latent channels and size, text widths.
    mean, _ = enc.images(_load_image(train[0][0], image_size)[None])
    t5_empty, clip_empty = enc.captions([""])
    c, h, w = mean.shape[1:]
    latent_shift, latent_scale = vae_latent_normalisation(enc.vae)
    if h != w:
        raise DataError(f"the VAE gave a non-square latent {list(mean.shape[1:])} for square images")
    source = {"kind": "prepared", "image_dir": str(image_dir), "eval_dir": None if eval_dir is None else str(eval_dir),
              "vae": str(vae_path), "t5": str(t5_path), "clip": str(clip_path), "image_size": image_size,
              "t5_len": t5_len, "encoder_dtype": str(dtype).removeprefix("torch.")}
    with DatasetWriter(out, l_txt=t5_len, d_t5=t5_empty.shape[-1], d_clip=clip_empty.shape[-1], latent_channels=c,
                       latent_hw=h, latent_shift=latent_shift, latent_scale=latent_scale,
                       samples_per_shard=samples_per_shard, source=source) as writer:
        writer.write_empty_encodings(t5_empty[0], clip_empty[0])
        for split, pairs in (("train", train), ("eval", evals)):
            for start in range(0, len(pairs), batch_size):
                part = pairs[start:start + batch_size]
                pixels = torch.stack([_load_image(path, image_size) for path, _ in part])
                captions = [caption for _, caption in part]
                mean, logvar = enc.images(pixels)
                t5, clip = enc.captions(captions)
                batch = {"vae_mean": mean, "vae_logvar": logvar, "t5": t5, "clip": clip}
                if split == "eval":
                    batch["timestep_index"] = torch.arange(start, start + len(part)) % 8
                writer.write(split, batch, captions=captions)
                log.info("%s: %d/%d images encoded", split, start + len(part), len(pairs))
    return Path(out)
