"""MiniMind's RL prompts (``RLAIFDataset`` of ``dataset/lm_dataset.py``) over a jsonl file of conversations.

A record is an SFT record (:mod:`lit_minimind.data.sft`; MiniMind's ``rlaif.jsonl`` ends each with an empty
assistant turn). Its prompt is the conversation without its last assistant turn, augmented as SFT
(a system prompt with probability ``add_system_ratio``), rendered with the chat template and MiniMind's
generation prompt, thinking opened with probability ``thinking_ratio`` (the template's ``open_thinking``).

The draws are MiniMind's (:meth:`RLAIFDataset.draws`): Python's ``random`` seeded ``42 + epoch``, drawn sample
after sample in the epoch's order (a system-prompt draw for a conversation without a system message or tools,
then the thinking draw), so a single-process run opens thinking in exactly MiniMind's prompts. With DataLoader
workers (:attr:`RLAIFDataset.layout`), as MiniMind's with the same ``num_workers``: batch ``k`` is drawn by worker
``k mod W``, whose ``random`` torch seeds with the iterator's base seed (the draw after MiniMind's ``randperm``
from its stream seeded ``42 + epoch``) plus the worker's id. The order is
the epoch's (the sampler followed with :meth:`follow_epoch`, else MiniMind's single-process permutation); the
sequence starts at the epoch's first sample, or, after a resume from MiniMind's own file (no RNG state in it),
at the resume position (:attr:`RLAIFDataset.draws_restart`), as MiniMind's resumed run draws. The system prompts
are the port's (SFT's), not MiniMind's: with ``add_system_ratio > 0`` the text differs from MiniMind's.

A sample is ``(prompt text, its token ids cut to max_length)``; :func:`collate_prompts` left-pads a batch with PAD
into ``{"input_ids", "attention_mask", "prompts"}``. Cut on the left (the last tokens kept), that is
``train_grpo.py``'s ``tokenizer(prompts, padding_side="left")[:, -max_seq_len:]``; cut on the right (the first
kept), ``train_ppo.py``'s ``tokenizer(prompts, padding_side="left", truncation=True, max_length=max_seq_len)``.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from lit_minimind.data.chat_template import render_chat
from lit_minimind.data.dataset import JsonlRecords
from lit_minimind.data.sampler import MINIMIND_SEED, epoch_permutation
from lit_minimind.data.sft import SYSTEM_PROMPTS, FollowsEpoch, augment, chat_messages, check_ratios, check_sft_record
from lit_minimind.data.tokenizer import PAD_ID
from lit_minimind.errors import DataError

__all__ = ["RLAIFDataset", "check_truncation_side", "collate_prompts", "THINKING_RATIO"]

THINKING_RATIO = 0.9  # train_grpo.py's --thinking_ratio


class RLAIFDataset(FollowsEpoch, JsonlRecords, Dataset[tuple[str, list[int]]]):
    """MiniMind's RL prompts ``(text, ids)`` from a jsonl file of conversations.

    Args:
        data_path: jsonl of ``{"conversations": [...]}`` records.
        tokenizer: from :func:`lit_minimind.data.tokenizer.load_tokenizer`.
        max_length: the prompt's tokens at most (MiniMind's ``--max_seq_len``).
        truncation_side: ``left`` drops an over-long prompt's first tokens (GRPO's), ``right`` its last (PPO's).
        chat_template: Jinja source; default MiniMind's.
        add_system_ratio: probability of prepending a system prompt to a conversation without one.
        thinking_ratio: probability of opening the thinking block (MiniMind's ``--thinking_ratio``).
        seed: base seed of the draws.
        cache_dir: where the record index is cached.
    """

    def __init__(self, data_path: str | os.PathLike[str], tokenizer: Tokenizer, max_length: int = 768,
                 chat_template: str | None = None, add_system_ratio: float = 0.2,
                 thinking_ratio: float = THINKING_RATIO, seed: int = MINIMIND_SEED, truncation_side: str = "left",
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.truncation_side = check_truncation_side(truncation_side)
        check_ratios(add_system_ratio=add_system_ratio, thinking_ratio=thinking_ratio)
        super().__init__(data_path, check_rlaif_record, cache_dir)
        self.tokenizer, self.max_length, self.chat_template = tokenizer, max_length, chat_template
        self.add_system_ratio, self.thinking_ratio, self.seed = add_system_ratio, thinking_ratio, seed
        self.epoch = 0
        self._epoch_source = None
        self.draws_restart: tuple[int, int] | None = None  # (epoch, position): MiniMind's resume restarts its draws
        self.layout: tuple[int, int] = (1, 0)  # (batch size, DataLoader workers) the draws follow (set by the loader)
        self._system_draw: np.ndarray | None = None  # per record: whether MiniMind draws for a system prompt
        self._plan: tuple[tuple[int, ...], dict[int, tuple[int, bool]]] | None = None

    def order(self, epoch: int) -> list[int]:
        """The samples of ``epoch`` in the order this rank reads them."""
        source = self._epoch_source
        if source is not None and hasattr(source, "indices"):  # the rank's EpochShardSampler
            return source.indices(epoch)
        return epoch_permutation(len(self), epoch, self.seed)

    def draws(self, epoch: int) -> dict[int, tuple[int, bool]]:
        """MiniMind's draws of ``epoch``, per sample: ``(system prompt index or -1, thinking opened)``."""
        start = self.draws_restart[1] if self.draws_restart and self.draws_restart[0] == epoch else 0
        needs = self.add_system_ratio > 0 or 0 < self.thinking_ratio < 1
        key = (epoch, start, needs, self.layout, id(self._epoch_source))
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1]
        plan: dict[int, tuple[int, bool]] = {}
        order = self.order(epoch) if needs else []
        if needs and self._system_draw is None:
            self._system_draw = np.array([system_draw(self.record(i)["conversations"]) for i in range(len(self))])
        batch_size, workers = self.layout
        rngs = [random.Random(seed) for seed in self.draw_seeds(epoch, workers)]
        for k, first in enumerate(range(start, len(order), batch_size)):
            rng = rngs[k % len(rngs)]  # a loader's batch k goes to worker k mod W
            for index in order[first:first + batch_size]:
                system = -1
                if self._system_draw[index] and rng.random() < self.add_system_ratio:
                    system = rng.choice(range(len(SYSTEM_PROMPTS)))
                plan.setdefault(index, (system, rng.random() < self.thinking_ratio))
        self._plan = (key, plan)
        return plan

    def draw_seeds(self, epoch: int, workers: int) -> list[int]:
        """The seeds of MiniMind's Python ``random`` in ``epoch``: ``42 + epoch`` in the main process, else one per
        DataLoader worker: the iterator's base seed (drawn after the epoch's ``randperm``) + the worker's id."""
        if workers == 0:
            return [self.seed + epoch]
        stream = torch.Generator().manual_seed(self.seed + epoch)
        torch.randperm(len(self), generator=stream)
        base = int(torch.empty((), dtype=torch.int64).random_(generator=stream))
        return [base + worker for worker in range(workers)]

    def prompt(self, index: int, epoch: int | None = None) -> str:
        """The rendered prompt of sample ``index`` in ``epoch`` (default: the current one)."""
        index = range(len(self))[index]
        epoch = self.current_epoch if epoch is None else epoch
        # no plan when ratios of 0 or 1 decide alone; a sample before a restart's plan is never read in training
        system, think = self.draws(epoch).get(index) or (-1, self.thinking_ratio == 1.0)
        conversations = self.record(index)["conversations"]
        if conversations[-1].get("role") == "assistant":
            conversations = conversations[:-1]  # MiniMind: conversations[:-1], the answer slot
        messages, tools = chat_messages(augment(conversations, system >= 0, SYSTEM_PROMPTS[max(system, 0)]))
        return render_chat(messages, self.chat_template, add_generation_prompt=True, tools=tools,
                           open_thinking=bool(think))

    def __getitem__(self, index: int) -> tuple[str, list[int]]:
        text = self.prompt(index)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return text, ids[:self.max_length] if self.truncation_side == "right" else ids[-self.max_length:]


def check_truncation_side(side: str) -> str:
    """``side`` if it names an end a prompt is cut at (``left`` or ``right``), else a ValueError saying so."""
    if side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    return side


def collate_prompts(samples: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """Left-pad a batch of prompts with PAD: ``input_ids``, ``attention_mask`` (0 on padding), ``prompts``."""
    width = max(len(ids) for _, ids in samples)
    ids = torch.tensor([[PAD_ID] * (width - len(t)) + t for _, t in samples], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for _, t in samples], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "prompts": [text for text, _ in samples]}


def system_draw(conversations: list[dict[str, Any]]) -> bool:
    """Whether MiniMind's ``pre_processing_chat`` draws for a system prompt: no tools, no system message first."""
    return not any(m.get("tools") for m in conversations) and conversations[0].get("role") != "system"


def check_rlaif_record(record: dict, where: str) -> None:
    """An SFT record without the need of an answer, whose prompt (all but a last assistant turn) is not empty."""
    check_sft_record(record, where, need_answer=False)
    conversations = record["conversations"]
    if len(conversations) == 1 and conversations[0].get("role") == "assistant":
        raise DataError(f"{where}: no prompt (the only message is the assistant's)")
