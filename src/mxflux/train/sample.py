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
                     dtype: torch.dtype = torch.bfloat16, guidance: float = 1.0,
                     empty: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Sample VAE latents [B, C, H, W] (un-normalised: z = x/scale + shift) for encoded prompts.

    `guidance` > 1 is classifier-free guidance with the empty prompt's encodings `empty` =
    (t5 [L, D], clip [D]) (what CFG dropout trained the model on): v = v_empty + g·(v_prompt −
    v_empty), both halves in one batch. 1.0 is the plain conditional model.
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

    def velocity(x, t):
        if guidance != 1.0:
            x, t = torch.cat([x, x]), torch.cat([t, t])
        with autocast:
            out = model(img=patchify(x).to(dtype), img_ids=ids_img, txt=t5, txt_ids=ids_txt, timesteps=t, y=clip)
        v = unpatchify(out.float(), h, w)
        if guidance == 1.0:
            return v
        v_prompt, v_empty = v[:b], v[b:]
        return v_empty + guidance * (v_prompt - v_empty)

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
