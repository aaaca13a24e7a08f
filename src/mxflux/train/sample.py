"""Generate images from prompts with a trained Flux: Euler sampling of the rectified flow → PNG grid."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import image_ids, patchify, text_ids, unpatchify
from .flow import euler_sample

__all__ = ["generate_latents", "save_grid"]


@torch.no_grad()
def generate_latents(model, t5: torch.Tensor, clip: torch.Tensor, *, latent_shape: tuple[int, int, int],
                     steps: int, seed: int, shift: float, scale: float,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Sample VAE latents [B, C, H, W] (un-normalised: z = x/scale + shift) for encoded prompts."""
    device = next(model.parameters()).device
    b = t5.shape[0]
    c, h, w = latent_shape
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((b, c, h, w), generator=g).to(device)
    ids_img, ids_txt = image_ids(b, h // 2, w // 2, device=device), text_ids(b, t5.shape[1], device=device)
    t5, clip = t5.to(device, dtype), clip.to(device, dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def velocity(x, t):
        with autocast:
            out = model(img=patchify(x).to(dtype), img_ids=ids_img, txt=t5, txt_ids=ids_txt, timesteps=t, y=clip)
        return unpatchify(out.float(), h, w)

    was_training = model.training
    model.eval()
    try:
        x0 = euler_sample(velocity, noise, steps)
    finally:
        model.train(was_training)
    return x0 / scale + shift


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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
