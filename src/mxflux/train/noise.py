"""Counter-based training randomness: every draw of a training sample is a pure function of
(train seed, optimizer step, the sample's dataset index), on any device and any number of ranks.

A per-rank `torch.Generator` makes the noise depend on how the global batch is split over ranks
and micro-batches, so a 2-rank run differs from a 1-rank run of the same global batch and a
checkpoint must carry one generator state per rank. Here nothing is stateful: the draws come
from Philox4x32-10 (Salmon et al., SC'11; the generator behind cuRAND and torch's CUDA RNG) with

    key     = (seed mod 2^32, seed div 2^32)
    counter = (j, stream, dataset index, optimizer step)     (each mod 2^32)

where j counts 4-word blocks within a stream. Stream 0 gives the latent-sampling ε (z = mean +
std·ε), stream 1 the flow noise, stream 2 the timestep t and the CFG-dropout uniform. Philox is
evaluated for the whole micro-batch at once with int64 tensor ops on the target device: no
per-sample loop, no host→device copy; on CUDA the function is compiled (torch.compile) into a
few fused kernels. The 32×32 → 64-bit products are split into 16-bit halves so that no int64
operation overflows: the integer part is exact and identical on every device (checked on an
H200); uniforms take the top 24 bits; normals come from Box–Muller (truncated at 5.9σ), whose
log/sin/cos may differ between CPU and CUDA in the last bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TrainingDraws", "philox4x32", "training_draws", "uniform_from_bits", "normal_from_bits"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF

STREAM_LATENT, STREAM_NOISE, STREAM_SCALARS = 0, 1, 2


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a·m for an int64 tensor `a` of values in [0, 2^32), overflow-free.

    m = mh·2^16 + ml; a·ml and a·mh are < 2^48, and s = a·ml + (a·mh mod 2^16)·2^16 < 2^49.
    """
    p1, p2 = a * (m & 0xFFFF), a * (m >> 16)
    s = p1 + ((p2 & 0xFFFF) << 16)
    return (p2 >> 16) + (s >> 32), s & _MASK32


def philox4x32(counter: torch.Tensor, key: tuple[int, int], rounds: int = 10) -> torch.Tensor:
    """Philox4x32-`rounds` of `counter` [4, ...] (int64, words in [0, 2^32)) under a 64-bit key.

    Returns int64 [4, ...] with the four output words. Matches Random123's known-answer vectors.
    Constants are Python ints (no tensors made here), so the function also traces under torch.compile.
    """
    if counter.dtype != torch.int64 or counter.shape[0] != 4:
        raise ValueError(f"counter must be int64 [4, ...], got {counter.dtype} {tuple(counter.shape)}")
    k0, k1 = int(key[0]) & _MASK32, int(key[1]) & _MASK32
    c0, c1, c2, c3 = counter.unbind(0)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32-bit words → float32 uniforms in [0, 1) on a 2^-24 grid (exact, device-independent)."""
    return (bits >> 8).to(torch.float32) * 2.0**-24


def normal_from_bits(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit words → two independent standard normals (Box–Muller, float32)."""
    u1 = ((a >> 8).to(torch.float32) + 0.5) * 2.0**-24  # in (0, 1): log(u1) is finite
    theta = (2 * torch.pi) * uniform_from_bits(b)
    r = torch.sqrt(-2.0 * torch.log(u1))
    return r * torch.cos(theta), r * torch.sin(theta)


class TrainingDraws(NamedTuple):
    latent_eps: torch.Tensor  # [B, *latent_shape] N(0, 1): z = mean + std·ε
    noise: torch.Tensor  # [B, *latent_shape] N(0, 1): the flow's ε
    t: torch.Tensor  # [B] U[0, 1): rectified-flow time
    drop_u: torch.Tensor  # [B] U[0, 1): CFG dropout when < p


def _draws(idx: torch.Tensor, step: torch.Tensor, seed: int, n: int, chunk: int | None = None):
    """(normals [B, 2, n], t [B], drop_u [B]) for dataset indices `idx` [B] at `step` (int64 [])."""
    device, b = idx.device, idx.shape[0]
    blocks = -(-n // 4)  # 4 words → 4 normals per Philox call
    j = torch.arange(blocks, dtype=torch.int64, device=device)
    cols = torch.cat((j, j, j[:1]))  # streams 0 and 1: `blocks` calls each; stream 2: one call
    stream = torch.cat((torch.full((blocks,), STREAM_LATENT, dtype=torch.int64, device=device),
                        torch.full((blocks,), STREAM_NOISE, dtype=torch.int64, device=device),
                        torch.full((1,), STREAM_SCALARS, dtype=torch.int64, device=device)))
    width = cols.numel()
    counter = torch.stack((cols.expand(b, width), stream.expand(b, width),
                           (idx & _MASK32).view(b, 1).expand(b, width), step.view(1, 1).expand(b, width)))
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    if chunk:  # CPU: a few cache-sized pieces run ~2x faster than one memory-bound sweep
        flat = counter.reshape(4, -1)
        w = torch.cat([philox4x32(c, key) for c in flat.split(chunk, dim=1)], dim=1).view(4, b, width)
    else:
        w = philox4x32(counter, key)  # [4, B, width]
    z0, z1 = normal_from_bits(w[0, :, :-1], w[1, :, :-1])
    z2, z3 = normal_from_bits(w[2, :, :-1], w[3, :, :-1])
    normals = torch.stack((z0, z1, z2, z3), dim=-1).view(b, 2, blocks * 4)[..., :n]
    return normals, uniform_from_bits(w[0, :, -1]), uniform_from_bits(w[1, :, -1])


# On CUDA the ~250 small elementwise kernels of eager Philox are launch-bound (≈2 ms per
# micro-batch of 64 MLPerf latents on an H200); compiled, they fuse into a few kernels. The
# integer part is exact either way; a failed compile falls back to eager once, with a warning.
COMPILE_ON_CUDA = True
_compiled = None
_compile_failed = False
_CPU_CHUNK = 1 << 16


def _run_draws(idx: torch.Tensor, step: torch.Tensor, seed: int, n: int):
    global _compiled, _compile_failed
    if idx.device.type != "cuda":
        return _draws(idx, step, seed, n, _CPU_CHUNK if idx.device.type == "cpu" else None)
    if COMPILE_ON_CUDA and not _compile_failed:
        if _compiled is None:
            _compiled = torch.compile(_draws, dynamic=False, fullgraph=True)
        try:
            return _compiled(idx, step, seed, n)
        except Exception as e:  # no working Triton/inductor here: eager from now on
            import warnings

            _compile_failed = True
            warnings.warn(f"mxflux.train.noise: torch.compile of the training draws failed ({e!r:.200}); "
                          "using eager kernels", stacklevel=3)
    return _draws(idx, step, seed, n)


def training_draws(indices: torch.Tensor, step: int | torch.Tensor, seed: int, latent_shape: tuple[int, ...],
                   device: torch.device | str | None = None) -> TrainingDraws:
    """All random draws of one micro-batch: a function of (seed, step, index) per sample only.

    `indices` are the samples' dataset indices (int64 [B]); the result lives on `device`
    (default: the device of `indices`). A sample's draws do not depend on which other samples
    share its micro-batch, on its position in it, or on the rank that processes it. `step` may
    be an integer tensor on `device` holding the step (a captured training step reads it from
    there at every replay; an int would be baked into the graph).
    """
    device = torch.device(device) if device is not None else indices.device
    idx = indices.to(device=device, dtype=torch.int64).reshape(-1)
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype.is_floating_point or step.device != device:
            raise ValueError(f"step: expected an int or a one-element integer tensor on {device}, got "
                             f"{step.dtype} {tuple(step.shape)} on {step.device}")
        step_t = step.reshape(()).to(torch.int64) & _MASK32
    else:
        step_t = torch.full((), int(step) & _MASK32, dtype=torch.int64, device=device)  # a fill: no copy
    n = 1
    for d in latent_shape:
        n *= int(d)
    normals, t, drop_u = _run_draws(idx, step_t, int(seed), n)
    shape = (idx.shape[0], *latent_shape)
    return TrainingDraws(latent_eps=normals[:, 0].reshape(shape), noise=normals[:, 1].reshape(shape),
                         t=t, drop_u=drop_u)
