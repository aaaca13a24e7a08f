"""Generate images from prompts with a trained Flux: Euler sampling of the rectified flow → PNG grid."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ..data.prepare import vae_latent_normalisation
from ..model import image_ids, patchify, text_ids, unpatchify
from .flow import euler_sample
from .guidance import guidance_input

__all__ = ["VaeDecoder", "generate_latents", "save_grid"]


@torch.no_grad()
def generate_latents(model, t5: torch.Tensor, clip: torch.Tensor, *, latent_shape: tuple[int, int, int],
                     steps: int, seed: int, shift: float, scale: float,
                     dtype: torch.dtype = torch.bfloat16, guidance: float = 1.0,
                     empty: tuple[torch.Tensor, torch.Tensor] | None = None,
                     distilled_guidance: float | None = None,
                     time_shift: float = 1.0) -> torch.Tensor:
    """Sample VAE latents [B, C, H, W] (un-normalised: z = x/scale + shift) for encoded prompts.

    `guidance` > 1 is classifier-free guidance with the empty prompt's encodings `empty` =
    (t5 [L, D], clip [D]) (what CFG dropout trained the model on): v = v_empty + g·(v_prompt −
    v_empty), both halves in one batch. 1.0 is the plain conditional model.
    `distilled_guidance` is the guidance input of a model with a guidance embedder (FLUX.1-dev), which
    needs one (`mxflux.train.guidance.sampling_distilled_guidance` picks it); other models take none.
    `time_shift` shifts the Euler steps' times towards the noise (`mxflux.train.flow.shift_time`).
    """
    if guidance != 1.0 and empty is None:
        raise ValueError("empty: classifier-free guidance needs the empty prompt's (t5, clip) encodings")
    device = next(model.parameters()).device
    b = t5.shape[0]
    c, h, w = latent_shape
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((b, c, h, w), generator=g).to(device)
    if guidance != 1.0:  # [prompts; empty prompts]
        t5 = torch.cat([t5, empty[0].to(t5.dtype).expand(b, *t5.shape[1:])])
        clip = torch.cat([clip, empty[1].to(clip.dtype).expand(b, *clip.shape[1:])])
    n = t5.shape[0]
    ids_img, ids_txt = image_ids(n, h // 2, w // 2, device=device), text_ids(n, t5.shape[1], device=device)
    t5, clip = t5.to(device, dtype), clip.to(device, dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    embed = model.config.guidance_embed
    if embed and distilled_guidance is None:
        raise ValueError("distilled_guidance: this model has a guidance embedder (FLUX.1-dev style) and needs "
                         "the value of its guidance input")
    embedded = guidance_input(distilled_guidance if embed else None, n, device)

    def velocity(x, t):
        if guidance != 1.0:
            x, t = torch.cat([x, x]), torch.cat([t, t])
        with autocast:
            out = model(img=patchify(x).to(dtype), img_ids=ids_img, txt=t5, txt_ids=ids_txt, timesteps=t, y=clip,
                        guidance=embedded)
        v = unpatchify(out.float(), h, w)
        if guidance == 1.0:
            return v
        v_prompt, v_empty = v[:b], v[b:]
        return v_empty + guidance * (v_prompt - v_empty)

    was_training = model.training
    model.eval()
    try:
        x0 = euler_sample(velocity, noise, steps, time_shift)
    finally:
        model.train(was_training)
    return x0 / scale + shift


class VaeDecoder:
    """A diffusers `AutoencoderKL` as the sampler needs it: latent geometry, normalisation, decoding.

    `latent_shift` / `latent_scale` are the VAE's `shift_factor` / `scaling_factor`: the
    normalisation `mxflux data prepare` stores with a dataset it encodes with this VAE.
    """

    def __init__(self, vae, *, device: torch.device | str, dtype: torch.dtype):
        self.vae, self.device, self.dtype = vae, torch.device(device), dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: torch.device | str, dtype: torch.dtype) -> "VaeDecoder":
        """Load `path`: an AutoencoderKL folder, or a diffusers pipeline folder holding one in vae/."""
        try:
            from diffusers import AutoencoderKL
        except ImportError as e:
            raise ImportError(f"decoding with a VAE needs diffusers (pip install 'mxflux[prepare]'): {e}") from None
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"--vae: {path} is not a diffusers AutoencoderKL folder")
        if (path / "vae").is_dir() and not (path / "config.json").is_file():
            path = path / "vae"
        vae = AutoencoderKL.from_pretrained(path, torch_dtype=dtype).to(device).eval()
        return cls(vae, device=device, dtype=dtype)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.latent_channels)

    @property
    def downsample(self) -> int:
        """Pixels per latent, per axis (8 for FLUX.1's VAE)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_shift(self) -> float:
        return vae_latent_normalisation(self.vae)[0]

    @property
    def latent_scale(self) -> float:
        return vae_latent_normalisation(self.vae)[1]

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """[C, h, w] of an image of height x width pixels; h and w even (2x2 patches)."""
        f = 2 * self.downsample
        if height % f or width % f:
            raise ValueError(f"image size {height}x{width}: expected multiples of {f} (the VAE downsamples "
                             f"{self.downsample}x, Flux patches 2x2)")
        return self.latent_channels, height // self.downsample, width // self.downsample

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Un-normalised latents [B, C, h, w] -> images [B, 3, H, W], [0, 1] for in-range pixels
        (not clamped: `save_grid` clamps what it draws)."""
        x = self.vae.decode(z.to(self.device, self.dtype)).sample.float()
        return (x + 1) / 2


def save_grid(images: torch.Tensor, path: str | Path, captions: list[str] | None = None, cols: int = 4) -> Path:
    """Save images [B, 3, H, W] in [0, 1] as one captioned PNG grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = images.shape[0]
    cols = min(cols, b)
    rows = -(-b // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.4 * cols, 2.6 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < b:
            ax.imshow(images[i].clamp(0, 1).permute(1, 2, 0).cpu().float().numpy(), interpolation="nearest")
            if captions:
                ax.set_title(captions[i], fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole or not at all: an interrupted run redraws a missing samples.png when resumed.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=100, format="png")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path
