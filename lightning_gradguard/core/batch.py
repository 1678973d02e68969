"""Batches: finding tensors in them, cutting them, and preparing them exactly as Lightning's loop does.

:func:`prepare_batch` is the one place a batch drawn outside Lightning's loop (a pre-flight check's first
batch, an LR sweep's batches, a re-draw) goes through what Lightning does to every training batch, in
Lightning's order: ``precision_plugin.convert_input``, then ``on_before_batch_transfer``, then the
strategy's ``batch_to_device`` (which runs ``transfer_batch_to_device`` and ``on_after_batch_transfer``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import Tensor

from lightning_gradguard.core.snapshot import loader_generators, tensors_free_iterables
from lightning_gradguard.core.trial import seed_all
from lightning_gradguard.functional.tree import tensors_in


def prepare_batch(trainer: pl.Trainer, batch: Any, dataloader_idx: int = 0) -> Any:
    """What Lightning's training loop does to a batch before ``training_step`` sees it, in its order."""
    batch = trainer.precision_plugin.convert_input(batch)
    batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)


def batch_size_of(batch: Any) -> int | None:
    """The leading dimension of the first tensor in ``batch`` with at least one dimension."""
    for t in tensors_in(batch):
        if t.dim() >= 1:
            return int(t.shape[0])
    return None


#: keys of a dict batch that name its targets (the rest are its inputs): the transformers library's and the
#: usual hand-written ones
TARGET_KEYS = ("labels", "label", "targets", "target", "y")


def mismatched(batch: Any) -> Any | None:
    """``batch`` with every sample's inputs paired with another sample's targets, or ``None`` where inputs
    and targets cannot be told apart. The targets move (rolled by one along the batch) and the inputs stay
    where they are, so a model whose forward pass depends on a sample's place in the batch (augmentations
    drawn in order from a seeded generator) gives the same outputs, and a loss that never reads the targets
    (a self-supervised one beside a dataset's unused labels) gives the same value. A tuple or list of two or
    more: its first element is the inputs, the rest the targets; a dict: :data:`TARGET_KEYS` are the
    targets. Only tensors whose leading dimension is the batch size (at least 2) are rolled."""
    n = batch_size_of(batch)
    if n is None or n < 2:
        return None

    def roll(t: Tensor) -> Tensor:
        return torch.roll(t, 1, dims=0) if t.dim() >= 1 and t.shape[0] == n else t

    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and any(True for _ in tensors_in(batch[0])):
        rolled = [batch[0], *(apply_to_collection(b, Tensor, roll) for b in batch[1:])]
        return tuple(rolled) if isinstance(batch, tuple) else rolled
    if isinstance(batch, dict):
        targets = [k for k in batch if k in TARGET_KEYS]
        if targets and len(targets) < len(batch):
            return {k: apply_to_collection(v, Tensor, roll) if k in targets else v for k, v in batch.items()}
    return None


def slice_batch(batch: Any, max_samples: int | None) -> Any:
    """Keep the first ``max_samples`` samples of every tensor whose leading dimension is the batch size."""
    n = batch_size_of(batch)
    if max_samples is None or n is None or n <= max_samples:
        return batch

    def cut(t: Tensor) -> Tensor:
        return t[:max_samples] if t.dim() >= 1 and t.shape[0] == n else t

    return apply_to_collection(batch, Tensor, cut)


def first_train_batch(trainer: pl.Trainer) -> tuple[Any, list[torch.Generator]]:
    """The first batch of a fresh pass over the train dataloader(s), prepared as the training loop does.

    Also returns the ``torch.Generator`` objects of the samplers, whose state the caller must restore
    (drawing a batch advances them, and the global RNG of a shuffling sampler).
    """
    combined = trainer.fit_loop._combined_loader
    if combined is None:
        raise RuntimeError("the train dataloader is not set up yet")
    gens: list[torch.Generator] = []
    for loader in tensors_free_iterables(combined.iterables):
        gens.extend(loader_generators(loader))
    fresh = CombinedLoader(combined.iterables, combined._mode)
    with _iterators_of_our_own(tensors_free_iterables(combined.iterables)):
        iterator = iter(fresh)
        try:
            batch, _, dataloader_idx = next(iterator)
        finally:
            del iterator
    return prepare_batch(trainer, batch, dataloader_idx or 0), gens


@contextmanager
def _iterators_of_our_own(loaders: list[Any]) -> Iterator[None]:
    """Draw from ``loaders`` without touching a persistent worker pool: put their iterators back after.

    A ``DataLoader(persistent_workers=True)`` creates its iterator (and its workers) on the first
    ``iter()`` and keeps it; later passes only reset it, which draws one random number fewer (no new base
    seed for the workers) and leaves the workers' own RNGs where the earlier pass left them. A pass of
    ours that created that iterator would shift every epoch's batch order of the real run. So each
    loader's stored iterator (``_iterator``, the attribute Lightning's
    ``_shutdown_workers_and_reset_iterator`` resets too) is set aside, our pass gets one of its own, whose
    workers are shut down afterwards, and the stored one (``None`` before the first epoch) is put back:
    the real run creates or resets it exactly as it would have.
    """
    kept = [(dl, dl._iterator) for dl in loaders if hasattr(dl, "_iterator")]
    for dl, _ in kept:
        dl._iterator = None
    try:
        yield
    finally:
        for dl, before in kept:
            ours, dl._iterator = dl._iterator, before
            if ours is not None and ours is not before and hasattr(ours, "_shutdown_workers"):
                ours._shutdown_workers()


def redraw_first_samples(trainer: pl.Trainer) -> Any:
    """The samples of the first batch fetched once more, with the dataset's own randomness re-seeded.

    Call it with the RNG state :func:`first_train_batch` started from: the sampler then yields the same
    indices (a ``DataLoader`` iterator draws its base seed first, then the sampler draws its order). The
    items are fetched with ``dataset[i]`` after every global RNG is re-seeded to other values, so a
    dataset that draws labels at random on every access returns different ones. ``None`` for anything
    but a single map-style ``DataLoader``.
    """
    from torch.utils.data import DataLoader, IterableDataset

    combined = trainer.fit_loop._combined_loader
    loaders = tensors_free_iterables(combined.iterables) if combined is not None else []
    if len(loaders) != 1:
        return None
    dl = loaders[0]
    if not isinstance(dl, DataLoader) or dl.batch_sampler is None or isinstance(dl.dataset, IterableDataset):
        return None
    order = iter(dl.batch_sampler)
    torch.empty((), dtype=torch.int64).random_(generator=dl.generator)  # the iterator's base seed
    indices = next(order)
    seed_all(0x5EED)
    return prepare_batch(trainer, dl.collate_fn([dl.dataset[i] for i in indices]))
