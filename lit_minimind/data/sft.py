"""MiniMind's SFT data (``SFTDataset`` of ``dataset/lm_dataset.py``) over a jsonl file of conversations.

A record is one line ``{"conversations": [{"role": ..., "content": ..., ...}, ...]}`` with roles
``system``, ``user``, ``assistant`` (optionally ``reasoning_content``, ``tool_calls``) and
``tool``; a ``system`` message may carry ``tools``. ``tools`` and ``tool_calls`` may be JSON
strings (MiniMind's format) or JSON values.

A sample is built as MiniMind builds it:

1. augmentation (:func:`augment`): without a leading system message, a system prompt from
   :data:`SYSTEM_PROMPTS` is prepended with probability ``add_system_ratio``; tool-use records
   (any message with ``tools``) are never changed;
2. the conversation is rendered with the tokenizer's chat template
   (:func:`lit_minimind.data.chat_template.render_chat`, no generation prompt);
3. each empty thinking block ``<think>\\n\\n</think>\\n\\n`` in the text is kept with probability
   ``empty_think_ratio`` (all kept or all removed), as MiniMind's ``post_processing_chat``;
4. the text is tokenized, cut to ``max_length`` tokens and right-padded with PAD (id 0);
5. labels (:func:`minimind_labels`): -100 everywhere except each assistant answer, from the
   token after ``<|im_start|>assistant\\n`` up to and including the ``<|im_end|>\\n`` that closes
   it (both tokens). An answer whose closing ``<|im_end|>\\n`` is cut off by ``max_length`` is
   labelled to the end of the sample. (MiniMind labels on the padded ids, so an answer that
   was never closed would label PAD too; the template always closes answers.)

``(input_ids, labels)`` are aligned (not shifted): the model shifts them, as for pretraining,
and MiniMind's ``train_full_sft.py`` computes the same loss.

Augmentation is deterministic: the draws of sample ``index`` come from a generator seeded with
``(seed, epoch, index)``, so a sample is the same whatever the worker, order or resume point.
The epoch is :attr:`SFTDataset.epoch`, set with :meth:`SFTDataset.set_epoch`, or read at each
access from an object with an ``epoch`` attribute given to :meth:`SFTDataset.follow_epoch`
(the epoch sampler, whose ``set_epoch`` Lightning calls every epoch).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from lit_minimind.data.chat_template import render_chat
from lit_minimind.data.dataset import IGNORE_INDEX, JsonlRecords, _json_type, check_kind
from lit_minimind.data.sampler import MINIMIND_SEED
from lit_minimind.data.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_ID
from lit_minimind.errors import DataError

__all__ = ["FollowsEpoch", "SFTDataset", "SYSTEM_PROMPTS", "EMPTY_THINK", "augment", "minimind_labels", "check_sft_record"]

ROLES = ("system", "user", "assistant", "tool")
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what the template renders for an assistant turn without reasoning
SYSTEM_PROMPTS = (
    "You are minimind, a small but useful language model.",
    "You are a helpful assistant. Answer clearly and accurately.",
    "You are a knowledgeable AI. Give precise, well-founded answers.",
    "You are minimind, a lightweight assistant. Keep answers short and correct.",
    "You are a friendly chatbot. Read the question carefully before answering.",
)


class SupportsEpoch(Protocol):
    epoch: int


class FollowsEpoch:
    """The epoch a dataset draws its augmentation for: :attr:`epoch` (:meth:`set_epoch`), or read at
    each access from a source with an ``epoch`` attribute (:meth:`follow_epoch`)."""

    epoch: int = 0
    _epoch_source: SupportsEpoch | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the augmentation draws (and stop following an epoch source)."""
        self.epoch = int(epoch)
        self._epoch_source = None

    def follow_epoch(self, source: SupportsEpoch) -> None:
        """Read the epoch from ``source.epoch`` at every access (e.g. the epoch sampler).

        In DataLoader worker processes the source is the copy pickled when the loader's
        iterator was created, which Lightning does after it set the epoch.
        """
        self._epoch_source = source

    @property
    def current_epoch(self) -> int:
        return int(self._epoch_source.epoch) if self._epoch_source is not None else self.epoch


class SFTDataset(FollowsEpoch, JsonlRecords, Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """MiniMind SFT samples ``(input_ids, labels)`` (int64, length ``max_length``) from a jsonl file.

    Reads the file as :class:`lit_minimind.data.dataset.JsonlRecords` (offsets only, validated once).

    Args:
        data_path: jsonl of ``{"conversations": [...]}`` records.
        tokenizer: from :func:`lit_minimind.data.tokenizer.load_tokenizer` (pad/bos/eos = 0/1/2).
        max_length: tokens per sample (MiniMind's ``max_seq_len``).
        chat_template: Jinja source (:func:`lit_minimind.data.chat_template.load_chat_template`);
            default MiniMind's.
        add_system_ratio: probability of prepending a system prompt to a conversation without one.
        empty_think_ratio: probability of keeping the empty ``<think>`` blocks of a sample
            (MiniMind's meaning: 0 always drops them, 1 always keeps them).
        seed: base seed of the augmentation draws.
        cache_dir: where the record index is cached (:class:`lit_minimind.data.dataset.JsonlRecords`).

    Raises:
        DataError: missing/empty file, or a bad line (not JSON, not an object, a pretraining
            record, ``conversations`` not a non-empty array, a message that is not an object,
            an unknown role, non-string content, invalid ``tools``/``tool_calls`` JSON, no
            assistant turn), naming the file and the 1-based line.
    """

    def __init__(
        self,
        data_path: str | os.PathLike[str],
        tokenizer: Tokenizer,
        max_length: int = 1024,
        chat_template: str | None = None,
        add_system_ratio: float = 0.2,
        empty_think_ratio: float = 0.2,
        seed: int = MINIMIND_SEED,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        check_ratios(add_system_ratio=add_system_ratio, empty_think_ratio=empty_think_ratio)
        super().__init__(data_path, check_sft_record, cache_dir)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.chat_template = chat_template
        self.add_system_ratio = add_system_ratio
        self.empty_think_ratio = empty_think_ratio
        self.seed = seed
        self.epoch = 0
        self._epoch_source: SupportsEpoch | None = None
        # MiniMind: tokenizer(f"{bos_token}assistant\n") and tokenizer(f"{eos_token}\n")
        self.answer_start = tokenizer.encode(f"{BOS_TOKEN}assistant\n", add_special_tokens=False).ids
        self.answer_end = tokenizer.encode(f"{EOS_TOKEN}\n", add_special_tokens=False).ids

    # ----------------------------------------------------------------- samples
    def conversation(self, index: int) -> list[dict[str, Any]]:
        """The raw ``conversations`` of record ``index`` (read from disk)."""
        return self.record(index, lambda r: _conversations_of(r))["conversations"]

    def draws(self, index: int, epoch: int | None = None) -> tuple[float, float, int]:
        """``(u_system, u_think, prompt_choice)`` of sample ``index`` in ``epoch`` (default: current)."""
        index = range(len(self))[index]  # normalizes negative indices, IndexError when out of range
        rng = np.random.default_rng([self.seed, self.current_epoch if epoch is None else epoch, index])
        u_system, u_think = rng.random(2)
        return float(u_system), float(u_think), int(rng.integers(len(SYSTEM_PROMPTS)))

    def prompt(self, index: int, epoch: int | None = None) -> str:
        """The text of sample ``index`` after augmentation, rendering and the empty-think rule."""
        u_system, u_think, choice = self.draws(index, epoch)
        messages = augment(self.conversation(index), u_system < self.add_system_ratio, SYSTEM_PROMPTS[choice])
        messages, tools = chat_messages(messages)
        text = render_chat(messages, self.chat_template, add_generation_prompt=False, tools=tools)
        # MiniMind drops them when random() > empty_think_ratio: keep with probability empty_think_ratio
        if EMPTY_THINK in text and not u_think < self.empty_think_ratio:
            text = text.replace(EMPTY_THINK, "")
        return text

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizer.encode(self.prompt(index)).ids[: self.max_length]
        ids += [PAD_ID] * (self.max_length - len(ids))
        labels = minimind_labels(ids, self.answer_start, self.answer_end, self.max_length)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def check_ratios(**ratios: float) -> None:
    """Raise ValueError naming the first of ``ratios`` (probabilities) outside [0, 1]."""
    for name, ratio in ratios.items():
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {ratio}")


def augment(conversations: list[dict[str, Any]], add_system: bool, system_prompt: str) -> list[dict[str, Any]]:
    """MiniMind's ``pre_processing_chat``: prepend a system message if asked and there is none.

    Conversations using tools are never changed.
    """
    if any(message.get("tools") for message in conversations):
        return conversations
    if conversations[0].get("role") != "system" and add_system:
        return [{"role": "system", "content": system_prompt}, *conversations]
    return conversations


def chat_messages(conversations: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
    """MiniMind's ``create_chat_prompt`` inputs: the messages (``tool_calls`` JSON decoded) and the
    ``tools`` of the system message (JSON decoded), or ``None``."""
    messages, tools = [], None
    for message in conversations:
        message = dict(message)
        if message.get("role") == "system" and message.get("tools"):
            tools = json.loads(message["tools"]) if isinstance(message["tools"], str) else message["tools"]
        if message.get("tool_calls") and isinstance(message["tool_calls"], str):
            message["tool_calls"] = json.loads(message["tool_calls"])
        messages.append(message)
    return messages, tools


def minimind_labels(input_ids: list[int], start: list[int], end: list[int], max_length: int) -> list[int]:
    """MiniMind's ``generate_labels``: copy the ids of each assistant answer, -100 elsewhere.

    An answer runs from after each ``start`` sequence (``<|im_start|>assistant\\n``) to the end of
    the next ``end`` sequence (``<|im_end|>\\n``) included; without one, to the end of
    ``input_ids`` (whatever it holds, padding included, as MiniMind).
    """
    labels = [IGNORE_INDEX] * len(input_ids)
    n, n_start, n_end = len(input_ids), len(start), len(end)
    i = 0
    while i < n:
        if input_ids[i : i + n_start] == start:
            first = i + n_start
            stop = first
            while stop < n and input_ids[stop : stop + n_end] != end:
                stop += 1
            for j in range(first, min(stop + n_end, max_length)):
                labels[j] = input_ids[j]
            i = stop + n_end if stop < n else n
        else:
            i += 1
    return labels


def _conversations_of(record: dict) -> list:
    conversations = record["conversations"]
    if not isinstance(conversations, list) or not conversations:
        raise TypeError("conversations")
    return conversations


def check_sft_record(record: dict, where: str, need_answer: bool = True) -> None:
    """Raise DataError (naming ``where``) unless ``record`` is a usable MiniMind SFT record (with
    ``need_answer`` False: an RL prompt record, which may end before any assistant turn)."""
    check_kind(record, where, "sft")
    conversations = record["conversations"]
    if not isinstance(conversations, list):
        raise DataError(f'{where}: "conversations" must be an array of messages, got {_json_type(conversations)}')
    if not conversations:
        raise DataError(f'{where}: "conversations" is empty')
    has_answer = False
    for i, message in enumerate(conversations):
        at = f"{where}: conversations[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at}: expected a message object, got {_json_type(message)}")
        role = message.get("role")
        if role not in ROLES:
            shown = repr(role) if isinstance(role, str) else _json_type(role)
            raise DataError(f"{at}: unknown role {shown} (expected one of {', '.join(ROLES)})")
        has_answer |= role == "assistant"
        for field in ("content", "reasoning_content"):
            value = message.get(field)
            if value is not None and not isinstance(value, str):
                raise DataError(f'{at}: "{field}" must be a string, got {_json_type(value)}')
        for field in ("tools", "tool_calls"):
            value = message.get(field)
            if isinstance(value, str) and value:
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise DataError(f'{at}: "{field}" is a string but not valid JSON ({exc.msg.removesuffix(" at")})') from exc
            if value not in (None, "") and not isinstance(value, list):
                raise DataError(f'{at}: "{field}" must be an array (or its JSON string), got {_json_type(value)}')
    if need_answer and not has_answer:
        raise DataError(f"{where}: no assistant turn (nothing to train on)")
