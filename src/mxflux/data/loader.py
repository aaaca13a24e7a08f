"""Deterministic, rank-sharded, resumable batches over a map-style dataset.

The batch plan (`plan_batches`) is a pure function of (number of samples, batch size, rank,
world size, seed, epoch, shuffle, drop_last, limit, global batch size): the permutation comes from
a generator seeded by (seed, epoch) alone, ranks take disjoint slices of it, and resuming at
`start_step` just drops the first batches of the plan, reading nothing. Given the global batch
size, the epoch is cut into global batches that do not depend on the number of ranks, and each
rank takes its contiguous slice of each: a training step sees the same samples on any world size. `build_loader` runs the plan through a
`torch.utils.data.DataLoader`; for a `LatentDataset` each worker reads a whole batch at once
(`LatentDataset.gather`) straight into shared memory.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, get_worker_info

__all__ = ["build_loader", "num_batches", "plan_batches"]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit seed from (seed, epoch), so that neighbouring epochs' permutations are unrelated."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF  # splitmix64 finaliser
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def num_batches(num_samples: int, *, batch_size: int, world_size: int = 1, rank: int = 0,
                drop_last: bool = True) -> int:
    """Batches one rank gets per epoch (with drop_last, every rank gets the same number)."""
    if drop_last:
        return num_samples // (batch_size * world_size)
    mine = len(range(rank, num_samples, world_size))
    return -(-mine // batch_size)


def plan_batches(num_samples: int, *, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 epoch: int = 0, shuffle: bool = True, drop_last: bool = True,
                 limit: int | None = None, global_batch_size: int | None = None) -> list[list[int]]:
    """This rank's batches (lists of sample indices) for one epoch, in order.

    The epoch's order is a permutation of range(n) seeded by (seed, epoch) (or range(n) itself
    without shuffle), where n = min(num_samples, limit). With drop_last the order is cut to a whole
    number of global batches (batch_size x world_size), so every rank takes the same number of
    full batches; without it every sample is used exactly once and the last batch of a rank may be
    short (ranks may then differ by one batch). Rank r takes order[r::world_size]: the ranks'
    samples are disjoint, and their union is the (cut) order.

    With `global_batch_size` G (training: a multiple of batch_size x world_size, and drop_last),
    the order is cut to whole global batches instead, global batch s is order[s*G:(s+1)*G] and
    rank r takes its slice [r*G/W, (r+1)*G/W) of it, split into micro-batches of batch_size in
    order. The micro-batches of all ranks at step s then cover exactly global batch s, whatever
    the world size W; and (rank, micro-batch) ↔ chunk r*G/W/batch_size + k of the global batch,
    so one rank with k micro-batches sees the same chunks as k ranks with one each.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..world_size-1 (world_size {world_size})")
    n = num_samples if limit is None else min(num_samples, int(limit))
    if n < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if global_batch_size is not None:
        per_rank, rest = divmod(int(global_batch_size), world_size)
        if global_batch_size <= 0 or rest or per_rank % batch_size:
            raise ValueError(f"global_batch_size {global_batch_size} is not a positive multiple of "
                             f"batch_size x world_size = {batch_size} x {world_size}")
        if not drop_last:
            raise ValueError("global_batch_size needs drop_last=True (every step is a whole global batch)")
    if shuffle:
        g = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
        order = torch.randperm(n, generator=g)
    else:
        order = torch.arange(n)
    if global_batch_size is not None:
        order = order[: (n // global_batch_size) * global_batch_size].view(-1, world_size, per_rank)
        mine = order[:, rank].flatten().tolist()
        return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    if drop_last:
        order = order[: (n // (batch_size * world_size)) * batch_size * world_size]
    mine = order[rank::world_size].tolist()
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


class _BatchReader(torch.utils.data.Dataset):
    """Presents a dataset with `gather` to the DataLoader as one that fetches whole batches."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        # In a worker, build the batch in shared memory: it then reaches the main process as is.
        return self.dataset.gather(indices, shared_memory=get_worker_info() is not None)


def _whole_batch(batch: dict) -> dict:
    """collate_fn for `_BatchReader`: its batches come out of `gather` already collated."""
    return batch


def build_loader(dataset, *, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 epoch: int = 0, start_step: int = 0, num_workers: int = 2, prefetch_factor: int = 4,
                 shuffle: bool = True, drop_last: bool = True, pin_memory: bool | None = None,
                 limit: int | None = None, global_batch_size: int | None = None) -> DataLoader:
    """A DataLoader over this rank's batches of one epoch, starting after `start_step` batches.

    The order follows `plan_batches` and nothing else: two loaders with the same arguments yield
    the same batches, whatever the number of workers. Batches are dicts of tensors with a leading
    batch axis plus 'index' (int64 [B], the sample indices). `start_step` is the number of this
    rank's batches of the epoch already consumed (exact resume; skipped without reading). `limit`
    restricts the epoch to the first `limit` samples of the dataset (e.g. a partial evaluation).
    `global_batch_size` makes the plan world-size invariant per global batch (see `plan_batches`).
    `pin_memory` defaults to whether CUDA is available. `prefetch_factor` is ignored without
    workers. `len()` of the result is the number of batches still to come.
    """
    batches = plan_batches(len(dataset), batch_size=batch_size, rank=rank, world_size=world_size, seed=seed,
                           epoch=epoch, shuffle=shuffle, drop_last=drop_last, limit=limit,
                           global_batch_size=global_batch_size)
    if not 0 <= start_step <= len(batches):
        raise ValueError(f"start_step {start_step} is outside this epoch's {len(batches)} batches "
                         f"(rank {rank} of {world_size}, batch_size {batch_size}, {len(dataset)} samples)")
    batches = batches[start_step:]
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    batched = hasattr(dataset, "gather")
    return DataLoader(
        _BatchReader(dataset) if batched else dataset,
        batch_sampler=batches,  # a list of index lists: replayed as is
        collate_fn=_whole_batch if batched else None,  # None: torch's default_collate
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        pin_memory=pin_memory,
        # Workers' base seed is drawn from this generator, not from torch's global RNG, so
        # building a loader never disturbs the training randomness.
        generator=torch.Generator().manual_seed(_epoch_seed(seed + 1, epoch)),
        worker_init_fn=_ignore_sigint if num_workers > 0 else None,
    )


def _ignore_sigint(worker_id: int) -> None:
    """Ctrl-C reaches every process of the terminal's group, workers included; the trainer
    finishes its step and checkpoints before it stops, so its workers must keep serving until
    then (they end with their loader)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)

