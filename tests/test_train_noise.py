"""Counter-based training noise: Philox4x32-10 known answers, draws that depend on (seed, step,
index) alone, their distribution; and the loader's world-size-invariant global batches."""

from __future__ import annotations

import math

import pytest
import torch

from mxflux.data.loader import plan_batches
from mxflux.train.noise import philox4x32, training_draws

# Random123's kat_vectors: counter (4 words), key (2 words) → output (4 words).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_matches_random123_known_answers():
    ctr = torch.tensor([c for c, _, _ in KAT], dtype=torch.int64).T  # [4, 3]
    for i, (_, key, want) in enumerate(KAT):
        assert philox4x32(ctr[:, i:i + 1], key).flatten().tolist() == list(want)


def test_a_samples_draws_depend_on_seed_step_and_index_only(gen):
    idx = torch.randperm(10_000, generator=gen)[:12]
    shape = (4, 6, 6)
    d = training_draws(idx, step=7, seed=3, latent_shape=shape)
    # Another micro-batch holding some of the same samples, in another order: the same draws.
    perm = torch.randperm(12, generator=gen)[:5]
    sub = training_draws(idx[perm], step=7, seed=3, latent_shape=shape)
    for a, b in zip(sub, d):
        assert torch.equal(a, b[perm])
    # Another step, seed or index: other draws.
    for other in (training_draws(idx, step=8, seed=3, latent_shape=shape),
                  training_draws(idx, step=7, seed=4, latent_shape=shape),
                  training_draws(idx + 1, step=7, seed=3, latent_shape=shape)):
        assert not torch.equal(other.noise, d.noise) and not torch.equal(other.t, d.t)
    assert d.latent_eps.shape == d.noise.shape == (12, *shape) and d.t.shape == d.drop_u.shape == (12,)
    assert d.noise.dtype == d.t.dtype == torch.float32
    assert not torch.equal(d.latent_eps, d.noise)


def test_a_step_held_in_a_tensor_draws_what_the_int_draws(gen):
    """A captured training step reads its step from a device tensor: the same draws, bit for bit,
    the step taken mod 2^32 as for an int."""
    idx = torch.randperm(10_000, generator=gen)[:8]
    for step in (0, 7, 2**32 + 5):
        want = training_draws(idx, step=step, seed=3, latent_shape=(4, 6, 6))
        for t in (torch.tensor(step), torch.tensor([step], dtype=torch.int32 if step < 2**31 else torch.int64)):
            got = training_draws(idx, step=t, seed=3, latent_shape=(4, 6, 6))
            for a, b in zip(got, want):
                assert torch.equal(a, b)
    with pytest.raises(ValueError, match="step: expected an int or a one-element integer tensor"):
        training_draws(idx, step=torch.tensor(1.0), seed=3, latent_shape=(4,))
    with pytest.raises(ValueError, match="step: expected an int or a one-element integer tensor"):
        training_draws(idx, step=torch.tensor([1, 2]), seed=3, latent_shape=(4,))


def test_draws_are_standard_normal_and_uniform():
    d = training_draws(torch.arange(64), step=0, seed=0, latent_shape=(16, 32, 32))
    for z in (d.latent_eps, d.noise):
        z = z.double().flatten()  # 1M draws: mean ± 0.005, std ± 0.005, tails as N(0, 1)
        assert abs(z.mean()) < 5e-3 and abs(z.std() - 1) < 5e-3
        assert abs((z.abs() > 2).double().mean() - math.erfc(2 / math.sqrt(2))) < 2e-3
    assert abs(torch.corrcoef(torch.stack([d.latent_eps.flatten(), d.noise.flatten()]))[0, 1]) < 5e-3
    u = training_draws(torch.arange(20_000), step=1, seed=0, latent_shape=(1,))
    for x in (u.t, u.drop_u):
        assert 0 <= float(x.min()) and float(x.max()) < 1 and abs(float(x.mean()) - 0.5) < 0.01
        assert abs(float((x < 0.1).float().mean()) - 0.1) < 0.01  # CFG dropout at p = 0.1


@pytest.mark.parametrize("world_size,micro", [(1, 8), (1, 2), (2, 4), (2, 2), (4, 2), (8, 1)])
def test_global_batches_do_not_depend_on_world_size(world_size, micro):
    """Global batch s is the same chunk of the epoch's order for any (world size, micro-batch),
    and (rank r, micro-batch k) is chunk r·accum + k of it: one rank with k micro-batches sees
    what k ranks with one micro-batch each see."""
    n, g = 203, 8
    ref = plan_batches(n, batch_size=g, seed=5, epoch=1, global_batch_size=g)  # one rank, one micro-batch
    assert len(ref) == n // g
    plans = [plan_batches(n, batch_size=micro, rank=r, world_size=world_size, seed=5, epoch=1, global_batch_size=g)
             for r in range(world_size)]
    accum = g // (micro * world_size)
    for s, want in enumerate(ref):
        chunks = [plans[r][s * accum + k] for r in range(world_size) for k in range(accum)]
        assert [i for c in chunks for i in c] == want
    with pytest.raises(ValueError, match="not a positive multiple"):
        plan_batches(n, batch_size=3, world_size=2, global_batch_size=g)
