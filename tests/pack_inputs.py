"""Inputs and exact comparisons shared by the packer tests (CPU kernel and Triton kernels).

Every generator draws from a seed taken from the test's `gen` fixture (fresh per run, printed).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

# Triton kernel tests run on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1,
# small shapes): the device their inputs live on, and the marks that skip them elsewhere.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_marks() -> list:
    from mxflux.kernels import HAS_TRITON

    return [pytest.mark.gpu,
            pytest.mark.skipif(not HAS_TRITON or not (torch.cuda.is_available() or INTERPRETED),
                               reason="needs Triton and a CUDA device (or TRITON_INTERPRET=1)")]

# ------------------------------------------------------------------ inputs
# Generated on the tensor's device from a seed drawn from the test's generator (fast at Flux sizes).
def dev_gen(gen, device):
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    return torch.Generator(device=device).manual_seed(seed)


def normal(r, c, gen, device="cpu"):
    g = dev_gen(gen, device)
    return torch.randn(r, c, generator=g, device=device).bfloat16()


def student_t(r, c, gen, device="cpu", df=3):
    g = dev_gen(gen, device)
    z = torch.randn(r, c, generator=g, device=device)
    u = torch.zeros(r, c, device=device)
    for _ in range(df):
        u += torch.randn(r, c, generator=g, device=device).square()
    return (z / torch.sqrt(u / df)).bfloat16()


def adversarial(r, c, gen, device="cpu"):
    """Wide binade spreads along both axes (so blocks_outside_window > 0), NaN/Inf/overflowing blocks, zero
    rows, columns and blocks, bf16 subnormals, tiny blocks around E8M0's clamp, negative zeros."""
    g = dev_gen(gen, device)
    kw = dict(generator=g, device=device)
    f64 = torch.float64
    x = torch.randn(r, c, dtype=f64, **kw)
    nbc, nbr = c // 32, -(-r // 32)
    s_row = torch.randint(-30, 31, (r, nbc), **kw).repeat_interleave(32, dim=1)
    s_col = torch.randint(-30, 31, (nbr, c), **kw).repeat_interleave(32, dim=0)[:r]
    x = x * torch.pow(2.0, (s_row + s_col).to(f64))

    def blocks(frac):  # random (row, 32-column block) picks, as an [r, c] mask
        return (torch.rand(r, nbc, **kw) < frac).repeat_interleave(32, dim=1)

    def one_per_block(frac):
        pick = (torch.rand(r, nbc, **kw) < frac).repeat_interleave(32, dim=1)
        lane = torch.randint(0, 32, (r, nbc), **kw).repeat_interleave(32, dim=1)
        return pick & (torch.arange(c, device=device) % 32 == lane)

    tiny = torch.randn(r, c, dtype=f64, **kw) * torch.pow(2.0, -torch.randint(120, 136, (r, c), **kw).to(f64))
    x = torch.where(blocks(0.03), tiny, x)
    huge = torch.where(torch.rand(r, c, **kw) < 0.5, -3.0e38, 3.0e38).to(f64)
    x = torch.where(blocks(0.01), huge, x)
    x = torch.where(blocks(0.02), 0.0, x)
    x = torch.where(blocks(0.01), -0.0, x)
    x = torch.where(one_per_block(0.01), math.nan, x)
    x = torch.where(one_per_block(0.005), math.inf, x)
    x = torch.where(one_per_block(0.005), -math.inf, x)
    x[torch.randint(0, r, (3,), **kw)] = 0.0
    x[:, torch.randint(0, c, (3,), **kw)] = 0.0
    return x.bfloat16()


def ties(r, c, gen, device="cpu"):
    """E2M3 rounding ties and saturation (exact ties exist only without the rotation)."""
    g = dev_gen(gen, device)
    kw = dict(generator=g, device=device)
    vals = torch.tensor([4.0, 1.0625, 0.0625, 7.75, 0.9375, 2.125, 4.25, 6.25, 0.1875, 7.6, 3.875,
                         0.03125, 1.9375, 0.5625, 5.75, 0.0, -0.0], device=device)
    x = vals[torch.randint(0, len(vals), (r, c), **kw)]
    x = torch.where(torch.rand(r, c, **kw) < 0.5, -x, x)
    x.view(-1, 32)[:, 0] = 4.0  # every row block has amax in [4, 8)
    e = torch.randint(-20, 21, (r, c // 32), **kw).repeat_interleave(32, dim=1)
    return (x * torch.pow(2.0, e.float())).bfloat16()


DISTS = {"normal": normal, "student_t": student_t, "adversarial": adversarial}


# ------------------------------------------------------------------ comparison
def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_bits_equal(name, got, want):
    if want is None:
        assert got is None, name
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype)
    gb, wb = _bits(got), _bits(want)
    bad = gb != wb
    if bad.any():
        idx = bad.nonzero()[:6].tolist()
        pytest.fail(f"{name}: {int(bad.sum())} of {bad.numel()} differ, e.g. at {idx}: "
                    f"got {[int(gb[tuple(i)]) for i in idx]}, want {[int(wb[tuple(i)]) for i in idx]}")


def assert_colsum_close(got, want, v):
    """fp32 sums of R terms in two orders differ by at most ~2·R·2^-24·Σ|v| per column."""
    assert got.shape == want.shape and got.dtype == torch.float32
    absum = v.float().abs().sum(0)
    # columns whose partial sums can overflow in one order and not another are order-dependent
    ok = absum < 1e38
    assert torch.equal(got[ok].isnan(), want[ok].isnan())
    fin = ok & want.isfinite()
    tol = 2 * v.shape[0] * 2.0**-24 * absum[fin] + 1e-38
    err = (got[fin] - want[fin]).abs()
    assert bool((err <= tol).all()), f"colsum error up to {float((err / tol).max()):.2f}x the bound"
