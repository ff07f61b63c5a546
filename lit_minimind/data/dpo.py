"""MiniMind's DPO data (``DPODataset`` of ``dataset/lm_dataset.py``) over a jsonl file of preference pairs.

A record is one line ``{"chosen": [messages], "rejected": [messages]}``; each side is a
conversation as in SFT data (roles ``system``, ``user``, ``assistant``, ...), usually the same
prompt with the preferred and the dispreferred answer.

Each side of a sample is built as MiniMind builds it: rendered with the chat template (no
generation prompt), each empty ``<think>\\n\\n</think>\\n\\n`` block kept with probability
``empty_think_ratio`` (MiniMind's ``post_processing_chat``, one draw per side), tokenized, cut to
``max_length`` and right-padded with PAD; the loss mask is 1 on each assistant answer (the tokens
SFT labels, :func:`lit_minimind.data.sft.minimind_labels`). A sample is the dict
``x_chosen, y_chosen, mask_chosen, x_rejected, y_rejected, mask_rejected`` (int64, length
``max_length - 1``): ``x`` the ids without the last, ``y`` the ids without the first, ``mask``
the answer mask aligned with ``y``. No system prompt is added (MiniMind's DPO does not).

The draws of sample ``index`` come from a generator seeded with ``(seed, epoch, index)``, as in
:class:`lit_minimind.data.sft.SFTDataset`, so a resumed run sees the same samples.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from lit_minimind.data.chat_template import render_chat
from lit_minimind.data.dataset import IGNORE_INDEX, JsonlRecords, _json_type, check_kind
from lit_minimind.data.sampler import MINIMIND_SEED
from lit_minimind.data.sft import EMPTY_THINK, FollowsEpoch, chat_messages, check_ratios, check_sft_record, minimind_labels
from lit_minimind.data.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_ID
from lit_minimind.errors import DataError

__all__ = ["DPODataset", "SIDES", "check_dpo_record"]

SIDES = ("chosen", "rejected")


class DPODataset(FollowsEpoch, JsonlRecords, Dataset[dict[str, torch.Tensor]]):
    """MiniMind DPO samples (a dict of six int64 tensors of length ``max_length - 1``) from a jsonl file.

    Args:
        data_path: jsonl of ``{"chosen": [...], "rejected": [...]}`` records.
        tokenizer: from :func:`lit_minimind.data.tokenizer.load_tokenizer` (pad/bos/eos = 0/1/2).
        max_length: tokens per side before the shift (MiniMind's ``max_seq_len``).
        chat_template: Jinja source (:func:`lit_minimind.data.chat_template.load_chat_template`);
            default MiniMind's.
        empty_think_ratio: probability of keeping the empty ``<think>`` blocks of a side
            (MiniMind's ``post_processing_chat`` default 0.2; 0 always drops them).
        seed: base seed of the draws.
        cache_dir: where the record index is cached (:class:`lit_minimind.data.dataset.JsonlRecords`).

    Raises:
        DataError: missing/empty file or a bad line (not a DPO record, a side that is not a
            valid conversation), naming the file and the 1-based line.
    """

    def __init__(
        self,
        data_path: str | os.PathLike[str],
        tokenizer: Tokenizer,
        max_length: int = 1024,
        chat_template: str | None = None,
        empty_think_ratio: float = 0.2,
        seed: int = MINIMIND_SEED,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (inputs and targets are shifted), got {max_length}")
        check_ratios(empty_think_ratio=empty_think_ratio)
        super().__init__(data_path, check_dpo_record, cache_dir)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.chat_template = chat_template
        self.empty_think_ratio = empty_think_ratio
        self.seed = seed
        self.answer_start = tokenizer.encode(f"{BOS_TOKEN}assistant\n", add_special_tokens=False).ids
        self.answer_end = tokenizer.encode(f"{EOS_TOKEN}\n", add_special_tokens=False).ids

    def pair(self, index: int) -> dict[str, list[dict[str, Any]]]:
        """The raw ``chosen`` and ``rejected`` conversations of record ``index`` (read from disk)."""
        record = self.record(index, _pair_of)
        return {side: record[side] for side in SIDES}

    def prompts(self, index: int, epoch: int | None = None) -> dict[str, str]:
        """The rendered text of each side of sample ``index`` (empty-think rule applied)."""
        index = range(len(self))[index]
        rng = np.random.default_rng([self.seed, self.current_epoch if epoch is None else epoch, index])
        draws = rng.random(len(SIDES))
        out, pair = {}, self.pair(index)
        for side, u in zip(SIDES, draws):
            messages, tools = chat_messages(pair[side])
            text = render_chat(messages, self.chat_template, add_generation_prompt=False, tools=tools)
            if EMPTY_THINK in text and not u < self.empty_think_ratio:  # MiniMind: drop if random() > ratio
                text = text.replace(EMPTY_THINK, "")
            out[side] = text
        return out

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = {}
        for side, text in self.prompts(index).items():
            ids = self.tokenizer.encode(text).ids[: self.max_length]
            ids += [PAD_ID] * (self.max_length - len(ids))
            mask = [int(label != IGNORE_INDEX) for label in
                    minimind_labels(ids, self.answer_start, self.answer_end, self.max_length)]
            sample[f"x_{side}"] = torch.tensor(ids[:-1], dtype=torch.long)
            sample[f"y_{side}"] = torch.tensor(ids[1:], dtype=torch.long)
            sample[f"mask_{side}"] = torch.tensor(mask[1:], dtype=torch.long)
        return sample


def _pair_of(record: dict) -> dict:
    for side in SIDES:
        if not isinstance(record[side], list) or not record[side]:
            raise TypeError(side)
    return record


def check_dpo_record(record: dict, where: str) -> None:
    """Raise DataError (naming ``where``) unless ``record`` is a usable MiniMind DPO record: both sides
    present, each a conversation as SFT data has (:func:`lit_minimind.data.sft.check_sft_record`)."""
    check_kind(record, where, "dpo")
    for side in SIDES:
        if side not in record:
            raise DataError(f'{where}: DPO record without "{side}" (records need "chosen" and "rejected")')
        conversation = record[side]
        if not isinstance(conversation, list):
            raise DataError(f'{where}: "{side}" must be an array of messages, got {_json_type(conversation)}')
        try:
            check_sft_record({"conversations": conversation}, f"{where}: {side}")
        except DataError as err:
            raise DataError(str(err).replace('"conversations"', f'"{side}"').replace("conversations[", f"{side}[")) from None
