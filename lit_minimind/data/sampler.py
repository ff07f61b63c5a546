"""Index-level samplers: MiniMind's per-epoch permutation and batch skipping on resume.

Skipping works on indices, never on data: a skipped batch is never loaded, tokenized
or collated, so resuming late in a huge epoch costs the same as resuming early.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized

import torch
from torch.utils.data import BatchSampler, Sampler

MINIMIND_SEED = 42


def epoch_permutation(num_samples: int, epoch: int, seed: int = MINIMIND_SEED) -> list[int]:
    """MiniMind's data order: ``torch.randperm(n)`` right after seeding ``seed + epoch``.

    A dedicated generator gives the same numbers as MiniMind's global ``setup_seed``
    without disturbing the global RNG.
    """
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


class SkipBatchSampler(Sampler[list[int]]):
    """MiniMind's ``SkipBatchSampler`` (lesson 15), with ``__len__``.

    Groups the indices of ``sampler`` into batches of ``batch_size`` and drops the first
    ``skip_batches`` batches; a trailing partial batch is kept.
    ``list(SkipBatchSampler(range(10), 3, 2)) == [[6, 7, 8], [9]]``.
    """

    def __init__(self, sampler: Iterable[int], batch_size: int, skip_batches: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        start = self.skip_batches * self.batch_size
        for i in range(start, len(indices), self.batch_size):
            yield indices[i : i + self.batch_size]

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        total = math.ceil(len(self.sampler) / self.batch_size)
        return max(0, total - self.skip_batches)


class EpochShardSampler(Sampler[int]):
    """The samples one rank sees in one epoch.

    The permutation depends on the epoch only (MiniMind's ``randperm`` after seeding
    ``42 + epoch``), never on the world size; rank ``r`` of ``W`` takes every W-th index
    starting at ``r``, padded like ``DistributedSampler`` so all ranks get the same count.
    Because the permutation is world-size independent, the samples trained by ``s`` steps
    on ``W`` ranks are exactly those trained by ``s * W / W'`` steps on ``W'`` ranks.
    Lightning calls :meth:`set_epoch` at the start of every epoch.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = MINIMIND_SEED) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.world_size)

    def indices(self, epoch: int) -> list[int]:
        """This rank's samples of ``epoch``, in order."""
        order = epoch_permutation(self.num_samples, epoch, self.seed)
        padded_size = len(self) * self.world_size
        if padded_size > len(order):  # repeat from the start, as DistributedSampler does
            order += order[: padded_size - len(order)]
        return order[self.rank : padded_size : self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(self.epoch))


class ResumableBatchSampler(BatchSampler):
    """Batches of one rank's epoch, able to start mid-epoch without touching skipped data.

    Unlike :class:`SkipBatchSampler`, ``len()`` is always the whole epoch: Lightning's
    restored batch counters already account for the skipped batches, so a shrinking
    length would end the epoch early. :meth:`resume_at` arms a one-shot skip that applies
    when the given epoch is iterated; later epochs start at batch 0.
    """

    def __init__(self, sampler: EpochShardSampler, batch_size: int, drop_last: bool = False) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, step: int) -> None:
        """Skip the first ``step`` batches the next time ``epoch`` is iterated."""
        self._resume = (epoch, step)

    def __iter__(self) -> Iterator[list[int]]:
        # a generator: epoch and skip are read at the first ``next()``, after ``set_epoch``
        skip = 0
        epoch = getattr(self.sampler, "epoch", 0)
        if self._resume is not None and self._resume[0] == epoch:
            skip = self._resume[1]
            self._resume = None
        yield from SkipBatchSampler(self.sampler, self.batch_size, skip)
