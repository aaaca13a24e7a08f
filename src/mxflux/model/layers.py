"""Flux building blocks, as black-forest-labs/flux `modules/layers.py` (same module and parameter names).

Every linear is an `nn.Linear` submodule, and each MLP an `nn.Sequential(Linear, GELU(tanh), Linear)`,
so `mxflux.nn.apply_precision` can swap them by qualified name without the model knowing about
precision.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DoubleStreamBlock", "EmbedND", "LastLayer", "MLPEmbedder", "Modulation", "ModulationOut",
           "QKNorm", "RMSNorm", "SelfAttention", "SingleStreamBlock", "apply_rope", "attention",
           "explicit_attention", "modulate", "rope", "split_heads", "timestep_embedding"]


# --------------------------------------------------------------------------- positions and time

def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    """Rotation matrices for one position axis: [..., L] -> [..., L, dim/2, 2, 2], fp32.

    Frequencies ω_i = θ^(-2i/dim). Angles are formed in fp64, as BFL and diffusers do (fp32
    would round an angle near 100 rad by up to ~4e-6 before cos/sin), then cast to fp32.
    """
    omega = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)
    angles = pos.to(torch.float64)[..., None] * omega
    cos, sin = torch.cos(angles), torch.sin(angles)
    rot = torch.stack([cos, -sin, sin, cos], dim=-1)
    return rot.reshape(*rot.shape[:-1], 2, 2).float()


class EmbedND(nn.Module):
    """Multi-axis RoPE: ids [B, L, n_axes] -> pe [B, 1, L, head_dim/2, 2, 2] (1 broadcasts over heads)."""

    def __init__(self, dim: int, theta: int, axes_dim: tuple[int, ...]):
        super().__init__()
        self.dim, self.theta, self.axes_dim = dim, theta, tuple(axes_dim)

    def forward(self, ids: Tensor) -> Tensor:
        pe = torch.cat([rope(ids[..., i], d, self.theta) for i, d in enumerate(self.axes_dim)], dim=-3)
        return pe.unsqueeze(1)


def apply_rope(xq: Tensor, xk: Tensor, pe: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of q and k [B, H, L, D] by pe, in fp32."""
    q = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    k = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    q = pe[..., 0] * q[..., 0] + pe[..., 1] * q[..., 1]
    k = pe[..., 0] * k[..., 0] + pe[..., 1] * k[..., 1]
    return q.reshape(xq.shape).type_as(xq), k.reshape(xk.shape).type_as(xk)


# In eager mode on the CPU, sequences up to this long take `explicit_attention`: PyTorch's CPU
# flash-attention backward is slow there (2 cores, the demo model's 16 x 2 heads x 96 tokens x 64:
# 8.6 ms forward + backward against 3.7 ms), and the [L, L] scores of a short sequence are small. Compiled graphs keep SDPA: it is the op the activation-checkpointing policies keep as
# attention's output.
CPU_EXPLICIT_ATTENTION_MAX_LEN = 512


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor) -> Tensor:
    """RoPE, then SDPA (or, eager on the CPU, `explicit_attention`): q, k, v [B, H, L, D] -> [B, L, H·D]."""
    q, k = apply_rope(q, k, pe)
    if (q.device.type == "cpu" and q.shape[-2] <= CPU_EXPLICIT_ATTENTION_MAX_LEN
            and not torch.compiler.is_compiling()):
        x = explicit_attention(q, k, v)
    else:
        x = F.scaled_dot_product_attention(q, k, v)
    return x.transpose(1, 2).flatten(2)


def explicit_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q·kᵀ/√D)·v [B, H, L, D] with a flash kernel's arithmetic: scores and softmax in
    fp32, the probabilities rounded to v's dtype for the product with v, the output in q's dtype.
    One autograd node (its profiler events are named after attention, as SDPA's are)."""
    return _ExplicitAttention.apply(q, k, v)


class _ExplicitAttention(torch.autograd.Function):
    """Keeps q, k, v and the fp32 probabilities P; backward is flash attention's: dV = P̃ᵀ·dO with
    P̃ = P in v's dtype, dS = P ⊙ (dO·Vᵀ − rowsum(dO ⊙ O)) in fp32, dQ = dS·K/√D, dK = dSᵀ·Q/√D."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        scale = q.shape[-1] ** -0.5
        with torch.autocast(q.device.type, enabled=False):
            p = ((q.float() @ k.float().transpose(-1, -2)) * scale).softmax(dim=-1)
            out = (p.to(v.dtype) @ v).to(q.dtype)
        ctx.save_for_backward(q, k, v, p, out)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, p, out = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dv = (p.to(v.dtype).transpose(-1, -2) @ dout.to(v.dtype)).to(v.dtype)
            d = (dout.float() * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dP ⊙ P), as flash
            ds = p * (dout.float() @ v.float().transpose(-1, -2) - d) * q.shape[-1] ** -0.5
            dq = (ds @ k.float()).to(q.dtype)
            dk = (ds.transpose(-1, -2) @ q.float()).to(k.dtype)
        return dq, dk, dv


def timestep_embedding(t: Tensor, dim: int = 256, max_period: int = 10_000,
                       time_factor: float = 1000.0) -> Tensor:
    """Sinusoidal embedding [cos, sin] of time_factor·t, t [B] in [0, 1] -> [B, dim], fp32.

    Kept in fp32 whatever t's dtype (BFL casts back to t's dtype); the caller casts to the compute
    dtype, so a bf16 model does not round t·1000 to 8 bits first.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period)
                      * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (time_factor * t.float())[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class MLPEmbedder(nn.Module):
    """Linear -> SiLU -> Linear; embeds the timestep / pooled text / guidance vectors."""

    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(self.silu(self.in_layer(x)))


# --------------------------------------------------------------------------- norms and attention

class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in fp32 and cast back before the learnable `scale`.

    The product with an fp32 `scale` promotes to fp32, as in BFL; QKNorm casts back to v's dtype.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        rrms = torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + 1e-6)
        return (x32 * rrms).to(x.dtype) * self.scale


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # Back to v's dtype: an fp32 scale (or inductor's fp32 upcast) would otherwise hand fp32
        # q/k to SDPA, and the flash kernel needs all three in bf16.
        return self.query_norm(q).to(v.dtype), self.key_norm(k).to(v.dtype)


def split_heads(qkv: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """[B, L, 3·H·D] -> q, k, v each [B, H, L, D] (BFL's "B L (K H D) -> K B H L D")."""
    B, L, _ = qkv.shape
    q, k, v = qkv.view(B, L, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    return q, k, v


class SelfAttention(nn.Module):
    """Holds one stream's qkv, QK-norm and proj; DoubleStreamBlock runs the joint attention itself."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, pe: Tensor) -> Tensor:
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        q, k = self.norm(q, k, v)
        return self.proj(attention(q, k, v, pe))


# --------------------------------------------------------------------------- modulation

class ModulationOut(NamedTuple):
    shift: Tensor  # each [B, 1, hidden]
    scale: Tensor
    gate: Tensor


class Modulation(nn.Module):
    """adaLN: SiLU(vec) -> Linear -> (shift, scale, gate), twice for a double block."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec: Tensor) -> tuple[ModulationOut, ModulationOut | None]:
        out = self.lin(F.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)
        return ModulationOut(*out[:3]), (ModulationOut(*out[3:]) if self.is_double else None)


def modulate(x: Tensor, mod: ModulationOut) -> Tensor:
    return (1 + mod.scale) * x + mod.shift


def _layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)


def _mlp(dim: int, hidden: int) -> nn.Sequential:
    # An nn.Sequential so the keys are `.0` / `.2` (as BFL) and the precision policy can fuse it.
    return nn.Sequential(nn.Linear(dim, hidden, bias=True), nn.GELU(approximate="tanh"),
                         nn.Linear(hidden, dim, bias=True))


# --------------------------------------------------------------------------- blocks

class DoubleStreamBlock(nn.Module):
    """Separate weights for image and text tokens, one joint attention over [txt; img]."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool = False):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.hidden_size = hidden_size

        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = _layer_norm(hidden_size)
        self.img_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias)
        self.img_norm2 = _layer_norm(hidden_size)
        self.img_mlp = _mlp(hidden_size, mlp_hidden_dim)

        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = _layer_norm(hidden_size)
        self.txt_attn = SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias)
        self.txt_norm2 = _layer_norm(hidden_size)
        self.txt_mlp = _mlp(hidden_size, mlp_hidden_dim)

    def _qkv(self, x: Tensor, norm: nn.Module, mod: ModulationOut, attn: SelfAttention):
        q, k, v = split_heads(attn.qkv(modulate(norm(x), mod)), self.num_heads)
        q, k = attn.norm(q, k, v)
        return q, k, v

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor, pe: Tensor) -> tuple[Tensor, Tensor]:
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)

        img_q, img_k, img_v = self._qkv(img, self.img_norm1, img_mod1, self.img_attn)
        txt_q, txt_k, txt_v = self._qkv(txt, self.txt_norm1, txt_mod1, self.txt_attn)

        # Joint attention, text tokens first (pe is laid out the same way).
        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)
        attn = attention(q, k, v, pe)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]

        img = img + img_mod1.gate * self.img_attn.proj(img_attn)
        img = img + img_mod2.gate * self.img_mlp(modulate(self.img_norm2(img), img_mod2))

        txt = txt + txt_mod1.gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt_mod2.gate * self.txt_mlp(modulate(self.txt_norm2(txt), txt_mod2))
        return img, txt


class SingleStreamBlock(nn.Module):
    """Parallel attention + MLP on the joint sequence (ViT-22B style).

    linear1 computes qkv and the MLP input in one GEMM (hidden -> 3·hidden + mlp_hidden);
    linear2 maps [attention output, GELU(mlp)] back to hidden (attention proj and fc2 in one GEMM).
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)

        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads)
        self.pre_norm = _layer_norm(hidden_size)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x: Tensor, vec: Tensor, pe: Tensor) -> Tensor:
        mod, _ = self.modulation(vec)
        qkv, mlp = torch.split(self.linear1(modulate(self.pre_norm(x), mod)),
                               [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)
        q, k, v = split_heads(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        out = self.linear2(torch.cat((attention(q, k, v, pe), self.mlp_act(mlp)), dim=2))
        return x + mod.gate * out


class LastLayer(nn.Module):
    """adaLN (shift, scale — BFL order) on the image tokens, then Linear to patch channels."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = _layer_norm(hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        x = (1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :]
        return self.linear(x)
