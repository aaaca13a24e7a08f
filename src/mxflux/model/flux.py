"""The Flux DiT (black-forest-labs/flux `model.py`), its MLPerf initialisation, and its inputs.

State-dict names equal BFL's, so BFL checkpoints load unchanged (diffusers ones through
`mxflux.model.convert`). The model knows nothing about precision: which of its linears a recipe's
precision converts is `mxflux.nn.precision.default_layers` (or the recipe's `precision.include`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .configs import FluxConfig
from .layers import DoubleStreamBlock, EmbedND, LastLayer, MLPEmbedder, SingleStreamBlock, timestep_embedding

__all__ = ["Flux", "image_ids", "patchify", "text_ids", "unpatchify"]


class Flux(nn.Module):
    """Transformer for flow matching on patch-token sequences.

    forward(img [B, L_img, in_channels], img_ids [B, L_img, 3], txt [B, L_txt, context_in_dim],
    txt_ids [B, L_txt, 3], timesteps [B] in [0, 1], y [B, vec_in_dim], guidance [B] or None)
    -> [B, L_img, out_channels]. The compute dtype is img's; ids and timesteps may be any float.
    """

    def __init__(self, config: FluxConfig):
        super().__init__()
        self.config = self.params = config  # `params`: BFL's attribute name
        c = config
        self.in_channels, self.out_channels = c.in_channels, c.out_channels
        self.hidden_size, self.num_heads = c.hidden_size, c.num_heads

        self.pe_embedder = EmbedND(dim=c.head_dim, theta=c.theta, axes_dim=c.axes_dim)
        self.img_in = nn.Linear(c.in_channels, c.hidden_size, bias=True)
        self.time_in = MLPEmbedder(256, c.hidden_size)
        self.vector_in = MLPEmbedder(c.vec_in_dim, c.hidden_size)
        self.guidance_in = MLPEmbedder(256, c.hidden_size) if c.guidance_embed else nn.Identity()
        self.txt_in = nn.Linear(c.context_in_dim, c.hidden_size)

        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(c.hidden_size, c.num_heads, mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias)
            for _ in range(c.depth))
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(c.hidden_size, c.num_heads, mlp_ratio=c.mlp_ratio)
            for _ in range(c.depth_single_blocks))
        self.final_layer = LastLayer(c.hidden_size, 1, c.out_channels)

        if not self.img_in.weight.is_meta:  # meta models are initialised after materialising
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """MLPerf reference (torchtitan, DiT style) initialisation.

        Zero: every modulation linear, the final adaLN_modulation and final linear, all biases —
        so a fresh model outputs exactly 0 (and every block starts as the identity).
        Xavier-uniform: img_in, txt_in, qkv, proj, MLPs, linear1/2. Normal(0, 0.02): time_in,
        vector_in (and guidance_in). RMSNorm scales: 1.
        """
        def xavier(*linears: nn.Linear) -> None:
            for lin in linears:
                nn.init.xavier_uniform_(lin.weight)

        def normal(*embedders: MLPEmbedder) -> None:
            for emb in embedders:
                nn.init.normal_(emb.in_layer.weight, std=0.02)
                nn.init.normal_(emb.out_layer.weight, std=0.02)

        def zero(*linears: nn.Linear) -> None:
            for lin in linears:
                nn.init.zeros_(lin.weight)

        xavier(self.img_in, self.txt_in)
        normal(self.time_in, self.vector_in)
        if isinstance(self.guidance_in, MLPEmbedder):
            normal(self.guidance_in)
        for b in self.double_blocks:
            xavier(b.img_attn.qkv, b.img_attn.proj, b.img_mlp[0], b.img_mlp[2],
                   b.txt_attn.qkv, b.txt_attn.proj, b.txt_mlp[0], b.txt_mlp[2])
            zero(b.img_mod.lin, b.txt_mod.lin)
        for b in self.single_blocks:
            xavier(b.linear1, b.linear2)
            zero(b.modulation.lin)
        zero(self.final_layer.adaLN_modulation[1], self.final_layer.linear)

        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(".scale"):  # RMSNorm
                nn.init.ones_(p)

    def forward(self, img: Tensor, img_ids: Tensor, txt: Tensor, txt_ids: Tensor, timesteps: Tensor,
                y: Tensor, guidance: Tensor | None = None) -> Tensor:
        self._check_inputs(img, img_ids, txt, txt_ids, timesteps, y, guidance)
        dtype = img.dtype

        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256).to(dtype))
        if self.config.guidance_embed:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(dtype))
        vec = vec + self.vector_in(y)
        txt = self.txt_in(txt)

        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))  # text first, as the sequence

        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)

        x = torch.cat((txt, img), dim=1)
        for block in self.single_blocks:
            x = block(x, vec=vec, pe=pe)
        img = x[:, txt.shape[1]:]

        return self.final_layer(img, vec)

    def _check_inputs(self, img, img_ids, txt, txt_ids, timesteps, y, guidance) -> None:
        """Name the tensor and the expected shape, instead of failing deep inside a matmul."""
        c = self.config
        if img.ndim != 3 or img.shape[-1] != c.in_channels:
            raise ValueError(f"img: expected [B, L_img, {c.in_channels}] patch tokens, got "
                             f"{list(img.shape)} (patchify [B, 16, H, W] latents first)")
        if txt.ndim != 3 or txt.shape[-1] != c.context_in_dim:
            raise ValueError(f"txt: expected [B, L_txt, {c.context_in_dim}], got {list(txt.shape)}")
        (B, L_img), L_txt, n_axes = img.shape[:2], txt.shape[1], len(c.axes_dim)
        expected = {"img_ids": (img_ids, [B, L_img, n_axes]), "txt_ids": (txt_ids, [B, L_txt, n_axes]),
                    "timesteps": (timesteps, [B]), "y": (y, [B, c.vec_in_dim])}
        if c.guidance_embed:
            if guidance is None:
                raise ValueError("guidance: this config has guidance_embed=True; pass guidance [B]")
            expected["guidance"] = (guidance, [B])
        for name, (tensor, shape) in expected.items():
            if list(tensor.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {list(tensor.shape)}")


# --------------------------------------------------------------------------- inputs

def patchify(latents: Tensor) -> Tensor:
    """VAE latents [B, C, H, W] -> tokens [B, (H/2)·(W/2), 4C]: "b c (h 2) (w 2) -> b (h w) (c 2 2)"."""
    if latents.ndim != 4 or latents.shape[2] % 2 or latents.shape[3] % 2:
        raise ValueError(f"latents: expected [B, C, H, W] with even H and W, got {list(latents.shape)}")
    B, C, H, W = latents.shape
    x = latents.reshape(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // 2) * (W // 2), C * 4)


def unpatchify(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of `patchify`: tokens [B, (H/2)·(W/2), 4C] -> latents [B, C, H, W] (H, W latent sizes)."""
    if tokens.ndim != 3 or height % 2 or width % 2 or tokens.shape[1] != (height // 2) * (width // 2) \
            or tokens.shape[2] % 4:
        raise ValueError(f"tokens: expected [B, {(height // 2) * (width // 2)}, 4·C] for a "
                         f"{height}x{width} latent (even sizes), got {list(tokens.shape)}")
    B, _, D = tokens.shape
    h, w, C = height // 2, width // 2, D // 4
    x = tokens.reshape(B, h, w, C, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, C, height, width)


def image_ids(batch: int, h: int, w: int, device=None, dtype=torch.float32) -> Tensor:
    """RoPE positions of an h x w token grid (h = H/2, w = W/2): [B, h·w, 3] = (0, row, col)."""
    ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
    return ids.reshape(1, h * w, 3).repeat(batch, 1, 1)


def text_ids(batch: int, length: int, device=None, dtype=torch.float32) -> Tensor:
    """RoPE positions of text tokens: all zeros [B, L, 3] (T5 already encodes text order)."""
    return torch.zeros(batch, length, 3, device=device, dtype=dtype)
