"""Flux model shapes (`FluxConfig`, `FLUX_CONFIGS`) and the matmul FLOP count they imply.

Field names follow black-forest-labs/flux `FluxParams`, so a BFL config reads the same here.
Every MX-eligible linear (attention qkv/proj, MLP fc1/fc2, single-block linear1/linear2) has both
dimensions a multiple of 32 in every config below, so an MXFP6 run never silently keeps one in bf16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["FLUX_CONFIGS", "FluxConfig", "ForwardFlops", "flops_per_sample", "flux_config",
           "forward_flops"]


@dataclass(frozen=True)
class FluxConfig:
    in_channels: int  # 16 VAE latent channels x 2x2 patch = 64
    out_channels: int
    vec_in_dim: int  # pooled CLIP-L embedding (768)
    context_in_dim: int  # T5 hidden size (4096)
    hidden_size: int
    mlp_ratio: float
    num_heads: int
    depth: int  # double-stream blocks
    depth_single_blocks: int
    axes_dim: tuple[int, ...]  # RoPE dims per position axis; sums to the head dim
    theta: int
    qkv_bias: bool
    guidance_embed: bool  # flux-dev style guidance-distilled models only

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dim", tuple(self.axes_dim))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_heads {self.num_heads}")
        if sum(self.axes_dim) != self.head_dim:
            raise ValueError(f"axes_dim {self.axes_dim} sums to {sum(self.axes_dim)}, but RoPE "
                             f"rotates the whole head: it must sum to head_dim {self.head_dim}")
        if any(d % 2 for d in self.axes_dim):
            raise ValueError(f"axes_dim {self.axes_dim}: RoPE rotates pairs, every entry must be even")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)


# flux-schnell's shape; the data dims (64 in, 768 pooled CLIP, 4096 T5) are MLPerf's.
_SCHNELL = dict(in_channels=64, out_channels=64, vec_in_dim=768, context_in_dim=4096,
                hidden_size=3072, mlp_ratio=4.0, num_heads=24, axes_dim=(16, 56, 56),
                theta=10_000, qkv_bias=True, guidance_embed=False)

FLUX_CONFIGS: dict[str, FluxConfig] = {
    # 11,891,178,560 parameters: the MLPerf Training Flux.1 model.
    "flux-12b": FluxConfig(**_SCHNELL, depth=19, depth_single_blocks=38),
    # FLUX.1-dev: flux-12b with the guidance embedder of a guidance-distilled model
    # (11,901,408,320 parameters).
    "flux-12b-dev": FluxConfig(**{**_SCHNELL, "guidance_embed": True}, depth=19, depth_single_blocks=38),
    # 1 double + 1 single block at full width (535,318,336 parameters): full-size GEMM shapes on
    # one GPU, for kernel and end-to-end benchmarks; same data dims as flux-12b.
    "flux-535m": FluxConfig(**_SCHNELL, depth=1, depth_single_blocks=1),
    # 12 heads x 64, 4 double + 8 single (162,271,296 parameters); still reads MLPerf data.
    "flux-small": FluxConfig(**{**_SCHNELL, "hidden_size": 768, "num_heads": 12,
                                "axes_dim": (8, 28, 28)}, depth=4, depth_single_blocks=8),
    # CPU tests: 2 heads x 64, 2 double + 2 single, toy text dims (1,810,496 parameters).
    "flux-tiny": FluxConfig(in_channels=64, out_channels=64, vec_in_dim=32, context_in_dim=64,
                            hidden_size=128, mlp_ratio=4.0, num_heads=2, depth=2,
                            depth_single_blocks=2, axes_dim=(8, 28, 28), theta=10_000,
                            qkv_bias=True, guidance_embed=False),
}


def flux_config(name: str, **overrides) -> FluxConfig:
    """The named config, optionally with fields replaced (e.g. `flux_config("flux-tiny", depth=1)`)."""
    if name not in FLUX_CONFIGS:
        raise ValueError(f"unknown Flux config {name!r}; expected one of {sorted(FLUX_CONFIGS)}")
    return dataclasses.replace(FLUX_CONFIGS[name], **overrides)


@dataclass(frozen=True)
class ForwardFlops:
    """Matmul FLOPs of one sample's forward pass (2 per multiply-add), by where they run."""

    mx_linear: float  # the linears nn.precision's DEFAULT_PRECISION_INCLUDE selects (qkv, proj, MLPs, linear1/2)
    other_linear: float  # img_in, txt_in, embedders, modulation, final layer (stay bf16)
    attention: float  # Q·Kᵀ and P·V inside scaled_dot_product_attention

    @property
    def total(self) -> float:
        return self.mx_linear + self.other_linear + self.attention


def forward_flops(config: FluxConfig, img_tokens: int, txt_tokens: int) -> ForwardFlops:
    """Matmul FLOPs of one sample's forward pass; elementwise ops (norms, RoPE, GELU) are ignored.

    Per-sample vectors (timestep, pooled text, modulation) are one row each. For flux-12b at 256
    image + 256 text tokens: 6.81 TFLOP, 97.1% of it in the MX linears.
    """
    c, tokens = config, img_tokens + txt_tokens
    d, mlp = c.hidden_size, c.mlp_hidden_dim

    def linear(rows: int, fan_in: int, fan_out: int) -> float:
        return 2.0 * rows * fan_in * fan_out

    # Each token passes its own stream's qkv, proj, fc1, fc2 in a double block.
    double_mx = linear(tokens, d, 3 * d) + linear(tokens, d, d) + 2 * linear(tokens, d, mlp)
    single_mx = linear(tokens, d, 3 * d + mlp) + linear(tokens, d + mlp, d)
    # Q·Kᵀ and P·V over the joint [txt; img] sequence, all heads together: 2 x 2·L²·d.
    attention = 4.0 * tokens * tokens * d

    embed = (linear(img_tokens, c.in_channels, d) + linear(txt_tokens, c.context_in_dim, d)
             + linear(1, 256, d) + linear(1, d, d) + linear(1, c.vec_in_dim, d) + linear(1, d, d))
    if c.guidance_embed:
        embed += linear(1, 256, d) + linear(1, d, d)
    modulation = c.depth * 2 * linear(1, d, 6 * d) + c.depth_single_blocks * linear(1, d, 3 * d)
    final = linear(1, d, 2 * d) + linear(img_tokens, d, c.out_channels)

    blocks = c.depth + c.depth_single_blocks
    return ForwardFlops(
        mx_linear=c.depth * double_mx + c.depth_single_blocks * single_mx,
        other_linear=embed + modulation + final,
        attention=blocks * attention,
    )


def flops_per_sample(config: FluxConfig, img_tokens: int, txt_tokens: int) -> float:
    """Training matmul FLOPs per sample: forward + backward (two matmuls per forward one) = 3x forward.

    flux-12b at 256 image + 256 text tokens (256² images, T5 padded to 256): 20.4 TFLOP, the figure
    MLPerf throughput is quoted in (NVIDIA's configs use 20.3).
    """
    return 3.0 * forward_flops(config, img_tokens, txt_tokens).total
