"""The MX-exact FP8 encoding that runs MXFP6 GEMMs on Hopper's FP8 tensor cores (docs/design.md,
"The exact FP8 fold and its window").

An E2M3 element has at most 4 significant bits, so q·2^k is an exact E4M3 number while it
stays inside E4M3's range. Within a group of blocks (a `FoldGranularity`: a whole row, 128
elements or one block) let e_ref be the largest block exponent; each element becomes the E4M3 number q·2^(e_block − e_ref + s)
(s = 5 for E2M3, so 7.5·2^5 = 240 ≤ 448) and the group gets one fp32 scale 2^(e_ref − s).
That is exact for every block with e_block ≥ e_ref − window (11 for E2M3); blocks further
below are rounded to E4M3 and counted.
"""

from __future__ import annotations

import torch

from .constants import E8M0_BIAS, E8M0_NAN
from .formats import code_table
from .granularity import FoldGranularity
from .quantize import MXTensor, pow2

__all__ = ["fold_to_e4m3", "pow2_any", "predicted_erefs", "rowwise_erefs"]

_NO_BLOCK = -(2**20)  # sentinel exponent for zero and NaN blocks: they never set e_ref


def pow2_any(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^k for integer k in [-149, 127], fp32 subnormals included."""
    k = k.to(torch.int32)
    sub = (1 << (k.clamp(-149, -127) + 149)).view(torch.float32)
    return torch.where(k >= -126, pow2(k.clamp(-126, 127)), sub)


def fold_to_e4m3(
    mx: MXTensor, granularity: FoldGranularity = FoldGranularity.ROWWISE, *,
    held: torch.Tensor | None = None, headroom: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Encode `mx` as E4M3 data plus one fp32 scale per group along its axis.

    Returns (data float8_e4m3fn with the shape of `mx.codes`, scale fp32 with the axis
    dimension replaced by the number of groups (1 for ROWWISE), blocks_outside_window: 0-d
    int64 tensor counting the non-zero blocks outside the exact window). `data.float() * scale`
    (each scale repeated over its group) equals `mx.dequantize(unrotate=False)` bit for bit in
    every block inside the window. NaN blocks stay NaN.

    `held` (ROWWISE only: int32, one per line along the axis, e + 128 or 0 for none, as
    `rowwise_erefs` writes them) places the window of a line at a predicted e_ref instead of the
    line's own: held − 128 + `headroom` wherever that is at or above the line's largest live block
    exponent (or the line has none); a line it does not hold (no prediction, or a block above it)
    keeps its own. The values of every block inside the placed window are the same either way (a
    power of two per line moves between data and scale); blocks below it are rounded and counted.
    """
    if not isinstance(mx, MXTensor):
        raise ValueError(f"mx: expected an MXTensor, got {type(mx).__name__}")
    f = mx.format
    shift, window = f.fold_shift, f.fold_window
    if shift is None or window is None:
        raise ValueError(f"mx: elements of format {f.name!r} are not exactly representable in E4M3")
    codes = mx.codes.movedim(mx.axis, -1)
    scales = mx.scales.movedim(mx.axis, -1).to(torch.int32)
    lead, n = codes.shape[:-1], codes.shape[-1]
    nb, block = n // mx.block, mx.block
    if not isinstance(granularity, FoldGranularity):
        raise ValueError(f"granularity: expected a FoldGranularity, got {granularity!r}")
    if n % granularity.row_multiple:
        raise ValueError(f"granularity: {granularity.value} needs the axis length to be a multiple of "
                         f"{granularity.row_multiple}, got {n}")
    g = granularity.group_size(n)
    if g % block:
        raise ValueError(f"granularity: {granularity.value} groups of {g} elements do not hold whole "
                         f"blocks of {block}")
    bpg = g // block  # blocks per group

    blk_codes = codes.reshape(*lead, nb, block)
    e_block, live, is_nan = _live_blocks(blk_codes, scales, f)
    e_ref = _group_maxima(e_block, live, bpg)
    if held is not None:
        e_ref = _held_erefs(e_ref, held, headroom, granularity, lead)
    e_ref = torch.where(e_ref == _NO_BLOCK, torch.zeros_like(e_ref), e_ref)  # empty group: any scale
    d = e_block - e_ref.repeat_interleave(bpg, dim=-1)

    q = code_table(f, codes.device)[blk_codes.long()]
    # Far-below blocks would need 2^(d+s) under fp32's normal range; they round to 0 in E4M3 anyway.
    val = q * pow2((d + shift).clamp(min=-126)).unsqueeze(-1)
    val = torch.where(is_nan.unsqueeze(-1), torch.full_like(val, float("nan")), val)
    data = val.reshape(*lead, n).to(torch.float8_e4m3fn)
    scale = pow2_any(e_ref - shift)
    blocks_outside_window = (live & (d < -window)).sum()

    return data.movedim(-1, mx.axis), scale.movedim(-1, mx.axis), blocks_outside_window


def _held_erefs(own: torch.Tensor, held: torch.Tensor, headroom: int, granularity: FoldGranularity,
                lead: torch.Size) -> torch.Tensor:
    """The e_ref of each line [..., 1]: the held prediction where it holds the line's own maximum
    `own` (_NO_BLOCK for an empty line), else `own`."""
    if granularity is not FoldGranularity.ROWWISE:
        raise ValueError(f"held: a predicted e_ref is for the row granularity, got {granularity.value}")
    if not isinstance(held, torch.Tensor) or held.dtype != torch.int32 or tuple(held.shape) != tuple(lead):
        raise ValueError(f"held: expected int32 {tuple(lead)} (e_ref + 128 per line, 0 for none), got "
                         f"{getattr(held, 'dtype', type(held).__name__)} {tuple(getattr(held, 'shape', ()))}")
    pred, has = predicted_erefs(held.to(own.device), headroom)
    pred, has = pred.unsqueeze(-1), has.unsqueeze(-1)
    return torch.where(has & ((own == _NO_BLOCK) | (own <= pred)), pred, own)


def predicted_erefs(held: torch.Tensor, headroom: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the e_ref each held value predicts, 0 where none; whether it predicts one): only e + 128 in [1, 255]
    is an e_ref, raised by `headroom` binades up to E8M0's largest exponent, which holds any line. What the
    one-pass packer's kernel computes per column (`kernels.operands_onepass`)."""
    has = (held > 0) & (held < 256)
    return torch.where(has, (held - 128 + int(headroom)).clamp(max=127), 0), has


def _live_blocks(blk_codes: torch.Tensor, scales: torch.Tensor, f) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block (codes [..., blocks, block], int32 E8M0 scales [..., blocks]): its exponent, whether it
    is live (a non-zero code and not NaN: only live blocks set a group's e_ref) and whether it is NaN."""
    nonzero = (blk_codes & (f.sign_mask - 1)).amax(dim=-1) > 0
    is_nan = scales == E8M0_NAN
    return scales - E8M0_BIAS, nonzero & ~is_nan, is_nan


def _group_maxima(e_block: torch.Tensor, live: torch.Tensor, blocks_per_group: int) -> torch.Tensor:
    """The largest live block exponent of each group of `blocks_per_group` blocks; _NO_BLOCK for a group
    without a live block."""
    e_live = torch.where(live, e_block, torch.full_like(e_block, _NO_BLOCK))
    return e_live.reshape(*e_block.shape[:-1], -1, blocks_per_group).amax(dim=-1)


def rowwise_erefs(mx: MXTensor) -> torch.Tensor:
    """The row granularity's e_ref of every group (a whole line along `mx`'s axis) as the CUDA packer's
    first pass records it: int32 e_ref + 128 where the group has a live block, 0 where it has none
    (`fold_to_e4m3` encodes against the same e_ref)."""
    f = mx.format
    codes = mx.codes.movedim(mx.axis, -1)
    scales = mx.scales.movedim(mx.axis, -1).to(torch.int32)
    blk_codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // mx.block, mx.block)
    e_block, live, _ = _live_blocks(blk_codes, scales, f)
    e_ref = _group_maxima(e_block, live, e_block.shape[-1])[..., 0]
    return torch.where(e_ref == _NO_BLOCK, torch.zeros_like(e_ref), e_ref + 128).to(torch.int32)
