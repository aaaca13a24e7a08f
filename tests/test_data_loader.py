"""The loader: deterministic order, disjoint rank shards, exact resume, identical batches with workers."""

from __future__ import annotations

import os

import pytest
import torch

from mxflux.data.loader import build_loader, num_batches, plan_batches
from mxflux.data.shards import LatentDataset
from mxflux.data.synth import write_synthetic


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> LatentDataset:
    root = tmp_path_factory.mktemp("data") / "ds"
    seed = int(os.environ.get("MXFLUX_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"[dataset fixture] MXFLUX_TEST_SEED={seed}")
    write_synthetic(root, n_train=103, n_eval=21, l_txt=4, d_t5=8, d_clip=4, latent_hw=2, seed=seed,
                    samples_per_shard=10)
    return LatentDataset(root, "train")


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_same_seed_and_epoch_same_order(gen):
    seed, epoch = torch.randint(0, 10**6, (2,), generator=gen).tolist()
    a = plan_batches(1000, batch_size=8, seed=seed, epoch=epoch)
    assert a == plan_batches(1000, batch_size=8, seed=seed, epoch=epoch)
    assert a != plan_batches(1000, batch_size=8, seed=seed, epoch=epoch + 1)
    assert a != plan_batches(1000, batch_size=8, seed=seed + 1, epoch=epoch)
    assert sorted(flat(a)) != flat(a)  # shuffled
    assert len(a) == 125 and all(len(b) == 8 for b in a)


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_ranks_disjoint_and_covering_without_drop_last(gen, world_size):
    n = int(torch.randint(50, 500, (1,), generator=gen))
    plans = [plan_batches(n, batch_size=7, rank=r, world_size=world_size, seed=3, epoch=1, drop_last=False)
             for r in range(world_size)]
    samples = [flat(p) for p in plans]
    assert sorted(i for s in samples for i in s) == list(range(n))  # every sample exactly once
    for r, p in enumerate(plans):
        assert len(p) == num_batches(n, batch_size=7, world_size=world_size, rank=r, drop_last=False)
        assert all(len(b) == 7 for b in p[:-1])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_disjoint_with_drop_last(gen, world_size):
    n = int(torch.randint(100, 1000, (1,), generator=gen))
    plans = [plan_batches(n, batch_size=5, rank=r, world_size=world_size, seed=11, epoch=0)
             for r in range(world_size)]
    steps = num_batches(n, batch_size=5, world_size=world_size)
    assert all(len(p) == steps and all(len(b) == 5 for b in p) for p in plans)
    seen = [i for p in plans for i in flat(p)]
    assert len(set(seen)) == len(seen) == steps * 5 * world_size
    # Global step s uses one contiguous slice of the epoch's permutation, split over the ranks.
    order = plan_batches(n, batch_size=5 * world_size, seed=11, epoch=0)
    for s in range(steps):
        assert sorted(i for p in plans for i in p[s]) == sorted(order[s])


def test_unshuffled_order_and_limit():
    assert plan_batches(10, batch_size=4, shuffle=False, drop_last=False) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    rank1 = plan_batches(10, batch_size=2, shuffle=False, drop_last=False, rank=1, world_size=2, limit=7)
    assert rank1 == [[1, 3], [5]]
    shuffled = flat(plan_batches(100, batch_size=1, limit=30, seed=5))
    assert sorted(shuffled) == list(range(30))


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank 2 is not in"):
        plan_batches(10, batch_size=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        plan_batches(10, batch_size=0)


def test_loader_batches_follow_the_plan(dataset):
    plan = plan_batches(len(dataset), batch_size=6, seed=9, epoch=2)
    batches = list(build_loader(dataset, batch_size=6, seed=9, epoch=2, num_workers=0))
    assert [b["index"].tolist() for b in batches] == plan
    for b in batches[:3]:
        for j, i in enumerate(b["index"].tolist()):
            sample = dataset[i]
            for k in ("vae_mean", "vae_logvar", "t5", "clip"):
                assert torch.equal(b[k][j], sample[k])


def test_start_step_resumes_exactly(dataset, gen):
    full = [b["index"].tolist() for b in build_loader(dataset, batch_size=4, seed=1, epoch=3, num_workers=0,
                                                      rank=1, world_size=2)]
    k = int(torch.randint(0, len(full) + 1, (1,), generator=gen))
    resumed = build_loader(dataset, batch_size=4, seed=1, epoch=3, num_workers=0, rank=1, world_size=2, start_step=k)
    assert len(resumed) == len(full) - k
    assert [b["index"].tolist() for b in resumed] == full[k:]
    with pytest.raises(ValueError, match="start_step 99 is outside"):
        build_loader(dataset, batch_size=4, num_workers=0, start_step=99)


def test_workers_give_identical_batches(dataset):
    ref = list(build_loader(dataset, batch_size=8, seed=4, epoch=1, num_workers=0))
    got = list(build_loader(dataset, batch_size=8, seed=4, epoch=1, num_workers=2, prefetch_factor=2))
    assert len(got) == len(ref) == len(dataset) // 8
    for a, b in zip(ref, got):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_eval_loader_covers_the_split_once(dataset):
    ev = LatentDataset(dataset.root, "eval")
    seen, timesteps = [], []
    for rank in range(3):
        for b in build_loader(ev, batch_size=4, rank=rank, world_size=3, shuffle=False, drop_last=False,
                              num_workers=0):
            seen += b["index"].tolist()
            timesteps += b["timestep_index"].tolist()
    assert sorted(seen) == list(range(len(ev)))
    assert all(t == i % 8 for i, t in zip(seen, timesteps))


def test_building_and_iterating_leaves_global_rng_alone(dataset):
    state = torch.get_rng_state()
    for _ in build_loader(dataset, batch_size=8, num_workers=0):
        pass
    assert torch.equal(torch.get_rng_state(), state)


def test_any_map_style_dataset_of_dicts():
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": torch.tensor([i * i])}

    batches = list(build_loader(Squares(), batch_size=3, shuffle=False, num_workers=0))
    assert [b["x"].flatten().tolist() for b in batches] == [[0, 1, 4], [9, 16, 25], [36, 49, 64]]
