"""The LightningDataModule: MiniMind's jsonl + tokenizer, MiniMind's per-epoch order, resumable batches."""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Subset

from lit_minimind.sampler import MINIMIND_SEED, EpochShardSampler, ResumableBatchSampler


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it is resumable.

    Its position is restored at index level by :class:`callbacks.ResumeCallback` through
    :meth:`MiniMindDataModule.resume_at`, so there is no iterator state to save.
    """

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class MiniMindDataModule(L.LightningDataModule):
    """Pretraining data as MiniMind reads it.

    Args:
        data_path: MiniMind pretrain jsonl (one ``{"text": ...}`` per line). Default: a corpus
            built at run time from the documentation every Python ships (``pydoc_data``).
        tokenizer_path: directory holding ``tokenizer.json`` (e.g. MiniMind's ``model/``).
            Default: a byte-level BPE (vocab 6400) trained on the embedded corpus, cached.
        max_seq_len: tokens per sample, bos and eos included (MiniMind's ``max_seq_len``).
        batch_size: samples per batch and per process.
        num_workers: DataLoader worker processes.
        cache_dir: where the embedded corpus and tokenizer are cached
            (default ``$LIT_MINIMIND_CACHE`` or ``~/.cache/lit_minimind``).
        val_fraction: hold out this fraction of the records (the last ones of the file) for a
            validation loss at each epoch's end; 0 (default) trains on everything, as MiniMind.
    """

    def __init__(
        self,
        data_path: str | None = None,
        tokenizer_path: str | None = None,
        max_seq_len: int = 340,
        batch_size: int = 32,
        num_workers: int = 0,
        cache_dir: str | None = None,
        val_fraction: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_path = data_path
        self.tokenizer_path = tokenizer_path
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.val_fraction = val_fraction
        self.train_dataset = None
        self.val_dataset = None
        self.tokenizer = None
        self._resume: tuple[int, int] | None = None

    def resolved_paths(self) -> tuple[Path, Path]:
        """``(data_path, tokenizer_dir)``, building the embedded defaults when unset."""
        from lit_minimind.corpus import write_embedded_corpus
        from lit_minimind.tokenizer import build_default_tokenizer, default_cache_dir

        cache = Path(self.cache_dir) if self.cache_dir else default_cache_dir()
        data = Path(self.data_path) if self.data_path else write_embedded_corpus(cache)
        tok = Path(self.tokenizer_path) if self.tokenizer_path else build_default_tokenizer(cache)
        return data, tok

    def prepare_data(self) -> None:
        self.resolved_paths()  # builds/caches the embedded corpus and tokenizer once, on rank 0

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        from lit_minimind.dataset import PretrainDataset
        from lit_minimind.tokenizer import load_tokenizer

        data, tok = self.resolved_paths()
        self.tokenizer = load_tokenizer(tok)
        full = PretrainDataset(data, self.tokenizer, max_length=self.max_seq_len)
        n_val = math.ceil(len(full) * self.val_fraction) if self.val_fraction > 0 else 0
        if n_val >= len(full):
            raise ValueError(f"val_fraction {self.val_fraction} leaves no training records in {data}")
        self.train_dataset = Subset(full, range(len(full) - n_val)) if n_val else full
        self.val_dataset = Subset(full, range(len(full) - n_val, len(full))) if n_val else None
        if self.val_dataset is None and self.trainer is not None:
            self.trainer.limit_val_batches = 0  # no validation split: no validation loop at all

    def batches_per_epoch(self, world_size: int = 1) -> int:
        """MiniMind's ``iters`` on each rank: ``ceil(ceil(N / world_size) / batch_size)``."""
        assert self.train_dataset is not None, "call setup() first"
        return math.ceil(math.ceil(len(self.train_dataset) / world_size) / self.batch_size)

    def resume_at(self, epoch: int, step: int) -> None:
        """Make the next train loader skip (at index level) the first ``step`` batches of ``epoch``."""
        self._resume = (epoch, step)

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = EpochShardSampler(len(self.train_dataset), rank=rank, world_size=world)
        batch_sampler = ResumableBatchSampler(sampler, self.batch_size)
        # Lightning creates the first iterator before it calls set_epoch, and worker processes
        # start drawing indices right then: the sampler must know its epoch already.
        sampler.set_epoch(trainer.current_epoch if trainer is not None else 0)
        if self._resume is not None:
            sampler.set_epoch(self._resume[0])
            batch_sampler.resume_at(*self._resume)
            self._resume = None
        return ResumableDataLoader(
            self.train_dataset,
            batch_sampler=batch_sampler,
            num_workers=self.num_workers,
            persistent_workers=False,
            pin_memory=trainer is not None and trainer.accelerator.__class__.__name__ == "CUDAAccelerator",
            # its own generator: creating an iterator must not draw from the global RNG, which the
            # model (dropout) uses and whose state a checkpoint restores
            generator=torch.Generator().manual_seed(MINIMIND_SEED),
        )

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
