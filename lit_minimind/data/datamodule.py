"""The LightningDataModule: MiniMind's jsonl + tokenizer, MiniMind's per-epoch order, resumable batches."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from lit_minimind.data.sampler import MINIMIND_SEED, EpochShardSampler, ResumableBatchSampler
from lit_minimind.data.workers import capped_workers, worker_init_fn
from lit_minimind.errors import CheckpointError, DataError, PositionError
from lit_minimind.resume.internals import batches_done
from lit_minimind.resume.states import DataPosition, position_here


class ResumableDataLoader(DataLoader):
    """A DataLoader that says it resumes mid-epoch (Lightning warns otherwise): its position is kept
    by :meth:`MiniMindDataModule.state_dict`, which counts what training consumed."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class MiniMindDataModule(L.LightningDataModule):
    """Pretraining or SFT data as MiniMind reads it.

    Args:
        data_path: MiniMind jsonl: pretraining (one ``{"text": ...}`` per line) or SFT (one
            ``{"conversations": [...]}`` per line, see :mod:`lit_minimind.data.sft`). Default: a corpus
            built at run time from the documentation every Python ships (``pydoc_data``): plain
            text, or with ``kind: sft`` a small chat corpus derived from it
            (:func:`lit_minimind.data.corpus.embedded_conversations`).
        tokenizer_path: directory holding ``tokenizer.json`` (e.g. MiniMind's ``model/``).
            Default: a byte-level BPE (vocab 6400) trained on the embedded corpus, cached.
        max_seq_len: tokens per sample, bos and eos included (MiniMind's ``max_seq_len``).
        batch_size: samples per batch and per process.
        num_workers: DataLoader worker processes.
        cache_dir: where the embedded corpus, the tokenizer and the record index of the data file
            are cached (default ``$LIT_MINIMIND_CACHE`` or ``~/.cache/lit_minimind``; the index:
            ``index/``, 8 bytes per record, see :mod:`lit_minimind.data.index`).
        val_fraction: hold out this fraction of the records (the last ones of the file) for a
            validation loss at each epoch's end; 0 (default) trains on everything, as MiniMind.
        kind: ``auto`` (default) detects the data from the first non-blank record
            (``"conversations"``: SFT, ``"text"``: pretraining, ``"chosen"``/``"rejected"``: DPO
            pairs, :mod:`lit_minimind.data.dpo`; without ``data_path``: pretraining); ``pretrain``,
            ``sft`` or ``dpo`` forces it (``dpo`` without ``data_path``: pairs made from the embedded
            chat corpus); ``rlaif``: the prompts of conversations for the RL stage
            (:mod:`lit_minimind.data.rlaif`, set by ``--model.objective grpo``; without ``data_path``:
            the embedded chat corpus); ``agent``: MiniMind's agent RL records (:mod:`lit_minimind.data.agent`,
            set by ``--model.objective agent``; without ``data_path``: the embedded demo questions for the six
            tools). A file mixing kinds is an error naming the first line of another kind.
        add_system_ratio: SFT only: probability of prepending a system prompt to a conversation
            that has none (MiniMind: 0.2).
        empty_think_ratio: SFT and DPO: probability of keeping a sample's empty
            ``<think>\\n\\n</think>\\n\\n`` blocks (MiniMind: 0.2; 0 always drops them, 1 always
            keeps them). Both augmentations draw from a generator seeded by (42, epoch, sample
            index), so a resumed run sees the same samples; the epoch is the sampler's once
            :meth:`lit_minimind.data.sft.SFTDataset.follow_epoch` links them, else 0.
        thinking_ratio: RL prompts only: probability of opening the thinking block of a prompt
            (MiniMind's ``--thinking_ratio`` 0.9), drawn the same way; agent RL: of each rollout (drawn there from
            Python's ``random``, ``train_agent.py``'s 0.1, the agent stage's default).
        truncation_side: RL prompts only: which end of a prompt longer than ``max_seq_len`` is cut: ``left``
            (its last tokens kept: ``train_grpo.py``'s slice of the padded batch) or ``right`` (its first tokens
            kept: ``train_ppo.py``'s ``tokenizer(..., truncation=True)``, set with ``--model.objective ppo``).
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
        kind: Literal["auto", "pretrain", "sft", "dpo", "rlaif", "agent"] = "auto",
        add_system_ratio: float = 0.2,
        empty_think_ratio: float = 0.2,
        thinking_ratio: float = 0.9,
        truncation_side: Literal["left", "right"] = "left",
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
        if kind not in ("auto", "pretrain", "sft", "dpo", "rlaif", "agent"):
            raise ValueError(f"kind must be 'auto', 'pretrain', 'sft', 'dpo', 'rlaif' or 'agent', got {kind!r}")
        from lit_minimind.data.sft import check_ratios

        check_ratios(add_system_ratio=add_system_ratio, empty_think_ratio=empty_think_ratio, thinking_ratio=thinking_ratio)
        self.kind = kind
        self.data_kind: str | None = None  # "pretrain", "sft", "dpo", "rlaif" or "agent", known after setup()
        self.add_system_ratio = add_system_ratio
        self.empty_think_ratio = empty_think_ratio
        self.thinking_ratio = thinking_ratio
        from lit_minimind.data.rlaif import check_truncation_side

        self.truncation_side = check_truncation_side(truncation_side)
        self.train_dataset = None
        self.val_dataset = None
        self.tokenizer = None
        self.position: DataPosition | None = None  # set by load_state_dict, used by the next loader
        self.saved_position: dict[str, Any] | None = None

    def resolved_paths(self) -> tuple[Path, Path]:
        """``(data_path, tokenizer_dir)``, building the embedded defaults when unset."""
        from lit_minimind.data.corpus import write_embedded_corpus
        from lit_minimind.data.tokenizer import build_default_tokenizer, default_cache_dir

        cache = Path(self.cache_dir) if self.cache_dir else default_cache_dir()
        if self.kind == "agent" and not self.data_path:  # the embedded demo questions
            from lit_minimind.data.agent import EMBEDDED_AGENT_DATA

            data = EMBEDDED_AGENT_DATA
        else:
            data = Path(self.data_path) if self.data_path else write_embedded_corpus(cache)
        tok = Path(self.tokenizer_path) if self.tokenizer_path else build_default_tokenizer(cache)
        return data, tok

    def prepare_data(self) -> None:
        self.resolved_paths()  # builds/caches the embedded corpus and tokenizer once, on rank 0

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        from lit_minimind.data.dataset import PretrainDataset, detect_kind
        from lit_minimind.data.tokenizer import default_cache_dir, load_tokenizer

        data, tok = self.resolved_paths()
        if self.kind in ("sft", "dpo", "rlaif") and not self.data_path:  # the embedded chat corpus (or its pairs)
            from lit_minimind.data.corpus import write_embedded_dpo_corpus, write_embedded_sft_corpus

            write = write_embedded_dpo_corpus if self.kind == "dpo" else write_embedded_sft_corpus
            data = write(Path(self.cache_dir) if self.cache_dir else default_cache_dir())
        self.data_kind = detect_kind(data) if self.kind == "auto" else self.kind
        self.tokenizer = load_tokenizer(tok)
        model = self.trainer.lightning_module if self.trainer is not None else None
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab_size is not None and self.tokenizer.get_vocab_size() > vocab_size:
            raise DataError(f"tokenizer {tok} has {self.tokenizer.get_vocab_size()} tokens, more than the model's "
                            f"{vocab_size}: pass --model.vocab_size {self.tokenizer.get_vocab_size()}")
        if self.data_kind == "sft":
            from lit_minimind.data.chat_template import load_chat_template
            from lit_minimind.data.sft import SFTDataset

            full = SFTDataset(data, self.tokenizer, max_length=self.max_seq_len, chat_template=load_chat_template(tok),
                              add_system_ratio=self.add_system_ratio, empty_think_ratio=self.empty_think_ratio,
                              cache_dir=self.cache_dir)
        elif self.data_kind == "dpo":
            from lit_minimind.data.chat_template import load_chat_template
            from lit_minimind.data.dpo import DPODataset

            full = DPODataset(data, self.tokenizer, max_length=self.max_seq_len, chat_template=load_chat_template(tok),
                              empty_think_ratio=self.empty_think_ratio, cache_dir=self.cache_dir)
        elif self.data_kind == "rlaif":
            from lit_minimind.data.chat_template import load_chat_template
            from lit_minimind.data.rlaif import RLAIFDataset

            full = RLAIFDataset(data, self.tokenizer, max_length=self.max_seq_len, chat_template=load_chat_template(tok),
                                add_system_ratio=self.add_system_ratio, thinking_ratio=self.thinking_ratio,
                                truncation_side=self.truncation_side, cache_dir=self.cache_dir)
        elif self.data_kind == "agent":
            from lit_minimind.data.agent import AgentDataset
            from lit_minimind.data.chat_template import load_chat_template

            full = AgentDataset(data, cache_dir=self.cache_dir)
            full.chat_template = load_chat_template(tok)  # the rollouts render their turns with it
        else:
            full = PretrainDataset(data, self.tokenizer, max_length=self.max_seq_len, cache_dir=self.cache_dir)
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

    # ----------------------------------------------------------------- data position (checkpointed)
    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data: Lightning saves it in every checkpoint.

        ``step`` is the number of batches of the current epoch that training has consumed, as
        counted by Lightning's training loop (not by the loader, whose workers run ahead).
        """
        trainer = self.trainer
        if trainer is None or self.train_dataset is None:
            return {}
        return {
            "epoch": trainer.current_epoch,
            "step": batches_done(trainer),
            "world_size": trainer.world_size,
            "iters": self.batches_per_epoch(trainer.world_size),
            "batch_size": self.batch_size,
            "dataset_len": len(self.train_dataset),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Arm the next train loader to start after the saved position (translated to this world size); a
        checkpoint of other data is refused, naming each setting that differs."""
        if not state_dict:
            return
        if self.train_dataset is not None and (problems := self.checkpoint_mismatches(state_dict)):
            raise CheckpointError("checkpoint does not match this run (a resume needs the same data):\n  "
                                  + "\n  ".join(problems))
        world = self.trainer.world_size if self.trainer is not None else 1
        saved_iters = state_dict.get("iters") or self.batches_per_epoch(int(state_dict.get("world_size") or 1))
        try:
            self.position = position_here(state_dict, world, self.batches_per_epoch(world), int(saved_iters))
        except PositionError as err:
            raise CheckpointError(str(err)) from None
        self.saved_position = dict(state_dict)

    def checkpoint_mismatches(self, state_dict: dict[str, Any]) -> list[str]:
        """One line per data setting that differs from a checkpoint's (a resume needs the same data)."""
        assert self.train_dataset is not None, "call setup() first"
        problems = []
        if state_dict.get("dataset_len") not in (None, len(self.train_dataset)):
            problems.append(f"dataset length: checkpoint {state_dict['dataset_len']} samples, this run {len(self.train_dataset)}")
        if state_dict.get("batch_size") not in (None, self.batch_size):
            problems.append(f"batch size: checkpoint {state_dict['batch_size']}, this run {self.batch_size} "
                            "(a step would mean other samples)")
        return problems

    def train_dataloader(self) -> DataLoader:
        assert self.train_dataset is not None
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        sampler = EpochShardSampler(len(self.train_dataset), rank=rank, world_size=world)
        batch_sampler = ResumableBatchSampler(sampler, self.batch_size)
        records = self.train_dataset.dataset if isinstance(self.train_dataset, Subset) else self.train_dataset
        if hasattr(records, "follow_epoch"):  # SFT augmentation is drawn per (seed, epoch, index)
            records.follow_epoch(sampler)
        workers = capped_workers(self.num_workers, rank)
        if hasattr(records, "layout"):  # RL prompts draw as MiniMind's loader with this many workers: never capped
            records.layout, workers = (self.batch_size, self.num_workers), self.num_workers
        # Lightning creates the first iterator before it calls set_epoch, and worker processes
        # start drawing indices right then: the sampler must know its epoch already.
        sampler.set_epoch(trainer.current_epoch if trainer is not None else 0)
        if self.position is not None:  # the first loader after a restore starts where training stopped
            epoch, skip = self.position.next_batch()
            sampler.set_epoch(epoch)
            batch_sampler.resume_at(epoch, skip)
            if hasattr(records, "draws_restart") and (self.saved_position or {}).get("restart_draws"):
                records.draws_restart = (epoch, skip * self.batch_size)  # MiniMind's resume: its draws start here
            self.position = None
        return ResumableDataLoader(
            self.train_dataset,
            batch_sampler=batch_sampler,
            num_workers=workers,
            persistent_workers=False,
            pin_memory=trainer is not None and trainer.accelerator.__class__.__name__ == "CUDAAccelerator",
            # its own generator: creating an iterator must not draw from the global RNG, which the
            # model (dropout) uses and whose state a checkpoint restores
            generator=torch.Generator().manual_seed(MINIMIND_SEED),
            worker_init_fn=worker_init_fn(rank),  # workers ignore stop signals: this process saves and stops
            collate_fn=self.collate_fn,
        )

    @property
    def collate_fn(self) -> Any:
        """RL prompts are left-padded per batch (:func:`lit_minimind.data.rlaif.collate_prompts`); the rest stack."""
        if self.data_kind == "rlaif":
            from lit_minimind.data.rlaif import collate_prompts

            return collate_prompts
        if self.data_kind == "agent":  # lists of messages, tools and ground truths (no tensors)
            from lit_minimind.data.agent import collate_agent

            return collate_agent
        return None

    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            return []
        trainer = self.trainer
        sampler = None
        if trainer is not None and trainer.world_size > 1:  # each rank validates its share (val_loss: sync_dist)
            sampler = DistributedSampler(self.val_dataset, trainer.world_size, trainer.global_rank, shuffle=False)
        rank = trainer.global_rank if trainer is not None else 0
        return DataLoader(self.val_dataset, batch_size=self.batch_size, sampler=sampler, num_workers=capped_workers(self.num_workers, rank),
                          worker_init_fn=worker_init_fn(rank))
