"""Training samples that the search's trials never train on, for a run without a validation loader.

Without a validation loader, the search scores its candidates on training data. Holding out the first batches
of one pass is not enough: a trial longer than a pass starts a new, reshuffled pass, and the held-out samples
come back inside its batches. From then on the trial trains on the samples that score it. The score then
rewards the candidate that memorises them fastest, and it cannot show the overfitting that a long run at that
LR ends in. On 13 of the 20 tasks of ``benchmarks/lr_hard.py`` whose sweep led to a search, the trials ran
past one pass.

So where a trial reaches a second pass and the training loader allows it, the split is by sample: a fixed
random subset of the dataset's indices is held out. The trials draw their batches from a copy of the loader,
re-created by Lightning's own helper with a sampler over the other indices (shuffled when the run's loader
shuffles), and the same order is used for every candidate. A single ``DataLoader`` over a sized, map-style
dataset with a ``RandomSampler`` or a ``SequentialSampler`` qualifies, and so does the ``DistributedSampler``
Lightning puts in their place under DDP (every rank holds out the same samples and takes its share of
both sides). An iterable dataset, a custom sampler, several loaders or a batch limit do not, and there the
first batches of a pass are held out as before (:func:`split` returns ``None``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

#: at most this share of the dataset is held out (the trials keep the rest to train on)
MAX_HELD_SHARE = 0.25

#: the held-out subset and the trials' order are drawn from generators seeded with this (no global RNG)
SEED = 0


class IndexSampler(Sampler[int]):
    """``indices`` in order, or (``shuffle``) in a new random order each pass, drawn from a generator
    seeded when the sampler is made: every sampler made with the same arguments yields the same passes.

    Under DDP (``replicas`` > 1) every rank draws the same order and takes its share, every
    ``replicas``-th index from its ``rank`` on, the order padded with its first indices to a multiple of
    ``replicas`` as ``DistributedSampler`` pads it: every rank gets as many batches as the others."""

    def __init__(
        self, indices: Sequence[int], shuffle: bool, seed: int = SEED, replicas: int = 1, rank: int = 0
    ) -> None:
        self.indices = list(indices)
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)
        self.replicas, self.rank = replicas, rank

    def __iter__(self) -> Iterator[int]:
        order = self.indices
        if self.shuffle:
            order = [self.indices[i] for i in torch.randperm(len(order), generator=self.generator).tolist()]
        padded = order + order[: len(self) * self.replicas - len(order)]
        return iter(padded[self.rank :: self.replicas])

    def __len__(self) -> int:
        return -(-len(self.indices) // self.replicas)


@dataclass(frozen=True)
class Split:
    """The held-out samples (``held_out``: a loader over them) and the rest (:meth:`training` makes a
    fresh loader over them, the same passes each time)."""

    loader: DataLoader
    rest: list[int]
    shuffle: bool
    held_out: DataLoader
    samples: int
    replicas: int = 1
    rank: int = 0

    def training(self) -> DataLoader:
        return _update_dataloader(
            self.loader, IndexSampler(self.rest, self.shuffle, replicas=self.replicas, rank=self.rank)
        )


def split(loader: Any, batches: int, drawn: int) -> Split | None:
    """Hold out ``batches`` batches' worth of samples of ``loader``'s dataset (at most
    :data:`MAX_HELD_SHARE` of it, and at least two batches on each rank), for trials that draw up to
    ``drawn`` batches of a pass (the held-out ones included).

    ``None`` where one pass holds them all (the first batches of a pass are then held out cleanly, and
    the trials keep the run's own loader), where the loader does not allow a split by sample (see the
    module's docstring), or where the dataset is too small for two held-out batches a rank."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    try:
        if drawn <= len(loader):
            return None
    except TypeError:
        return None
    sampler, batch_size = loader.sampler, loader.batch_size
    shards = _shards(sampler)
    if shards is None or batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return None
    try:
        size = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    shuffle, replicas, rank = shards
    count = min(batches * batch_size * replicas, int(MAX_HELD_SHARE * size))
    if count < 2 * batch_size * replicas:
        return None
    order = torch.randperm(size, generator=torch.Generator().manual_seed(SEED)).tolist()
    held = IndexSampler(sorted(order[:count]), shuffle=False, replicas=replicas, rank=rank)
    try:
        cut = Split(
            loader, sorted(order[count:]), shuffle, _update_dataloader(loader, held), count, replicas, rank
        )
        cut.training()  # fails here, not in a trial
    except Exception:  # a loader that Lightning cannot re-create keeps the hold-out by batch
        return None
    return cut


def _shards(sampler: Any) -> tuple[bool, int, int] | None:
    """Whether ``sampler`` shuffles, and over how many ranks it shards and which one this is: ``None``
    for a sampler this module does not replace (one that draws with replacement, a subset of its
    samples, weights or a custom order)."""
    if type(sampler) is SequentialSampler:
        return False, 1, 0
    if type(sampler) is RandomSampler:
        plain = not sampler.replacement and sampler._num_samples is None
        return (True, 1, 0) if plain else None
    if type(sampler) is DistributedSampler and not sampler.drop_last:
        return bool(sampler.shuffle), int(sampler.num_replicas), int(sampler.rank)
    return None
