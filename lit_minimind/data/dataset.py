"""MiniMind pretraining dataset over a jsonl file, without loading it into memory.

Also the jsonl reading shared with :mod:`lit_minimind.data.sft` (:class:`JsonlRecords`, over the
cached record index of :mod:`lit_minimind.data.index`) and the data kind of a record or file
(:func:`detect_kind`): ``{"text": ...}`` is pretraining, ``{"conversations": [...]}`` is SFT.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from lit_minimind.data.index import (
    RecordCheck,
    json_type,
    parse_record,
    record_offsets,
    require_file,
    scan_offsets,
)
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode
from lit_minimind.errors import DataError

__all__ = ["DataError", "JsonlRecords", "PretrainDataset", "IGNORE_INDEX", "detect_kind", "scan_jsonl",
           "check_pretrain_record", "parse_record"]

IGNORE_INDEX = -100  # label value ignored by the cross-entropy loss
KINDS = ("pretrain", "sft", "dpo")
# the field that marks each kind of record: MiniMind's pretrain {"text"}, SFT {"conversations"} and
# DPO {"chosen", "rejected"} (lit_minimind.data.dpo checks "rejected")
KIND_FIELD = {"pretrain": "text", "sft": "conversations", "dpo": "chosen"}
_json_type = json_type  # the name the validators of other kinds import


class JsonlRecords:
    """Offset-indexed, lazily opened jsonl records: the reading shared by the datasets.

    The constructor gets the byte offset of each record from the file's cached index
    (:func:`lit_minimind.data.index.record_offsets`: every line validated with ``check`` at the
    first start, a memory-mapped ``uint64`` array at the next ones, shared by the DataLoader
    workers and the ranks of a machine), so memory stays small for multi-GB files. ``cache_dir``:
    where the index lives (default ``$LIT_MINIMIND_CACHE`` or ``~/.cache/lit_minimind``).
    :meth:`record` seeks to one line and parses only it. The file is opened lazily, once per
    process, so the object pickles cleanly into DataLoader workers (a mapped index travels as
    its path and is mapped again). Blank (whitespace-only) lines are skipped and do not count as
    records; line numbers in errors still count them.
    """

    def __init__(self, data_path: str | os.PathLike[str], check: RecordCheck,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.data_path = Path(data_path)
        self.offsets: np.ndarray = record_offsets(self.data_path, check, cache_dir)
        self._file: BinaryIO | None = None
        self._file_pid: int | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def record(self, index: int, check: Callable[[dict], Any] | None = None) -> dict:
        """The JSON object of record ``index`` (read from disk).

        ``check(record)`` may raise ``ValueError``/``TypeError``/``KeyError``: the record is
        then reported as changed since the scan (a DataError).
        """
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} records")
        offset = int(self.offsets[index])
        file = self._handle()
        file.seek(offset)
        line = file.readline()
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise TypeError(type(record).__name__)
            if check is not None:
                check(record)
        except (ValueError, TypeError, KeyError) as exc:
            raise DataError(
                f"{self.data_path}: record {index} (byte {offset}) no longer holds a valid "
                f"record; the file changed after the dataset scanned it ({exc!r})"
            ) from exc
        return record

    def close(self) -> None:
        """Close this process's file handle (reopened on the next access)."""
        if self._file is not None:
            self._file.close()
        self._file, self._file_pid = None, None

    def _handle(self) -> BinaryIO:
        # A handle inherited through fork shares its seek position with the
        # parent, so each process opens its own.
        if self._file is None or self._file_pid != os.getpid():
            self._file = open(self.data_path, "rb")
            self._file_pid = os.getpid()
        return self._file

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"], state["_file_pid"] = None, None
        if isinstance(self.offsets, np.memmap) and self.offsets.filename:  # map it again, not a copy
            state["offsets"] = ("mapped", str(self.offsets.filename), len(self.offsets))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        offsets = state["offsets"]
        if isinstance(offsets, tuple):
            _, filename, count = offsets
            state["offsets"] = np.load(filename, mmap_mode="r", allow_pickle=False)
            if len(state["offsets"]) != count:
                raise DataError(f"{state['data_path']}: its index {filename} changed while in use "
                                "(the data file was changed): restart")
        self.__dict__.update(state)

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None and self._file_pid == os.getpid():
            self._file.close()


class PretrainDataset(JsonlRecords, Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """MiniMind pretraining samples from a jsonl file of ``{"text": ...}`` lines.

    Reads the file as :class:`JsonlRecords` does (offsets only, one line parsed per sample,
    lazily opened per process).

    Each sample is ``(input_ids, labels)``, two int64 tensors of length
    ``max_length``, built exactly as MiniMind does: ``[BOS] + first
    max_length-2 text tokens + [EOS]``, right-padded with PAD; ``labels`` is a
    copy of ``input_ids`` with every PAD position set to -100. The tokenizer
    must use MiniMind's special ids (pad 0, bos 1, eos 2), as
    :func:`lit_minimind.data.tokenizer.load_tokenizer` checks.

    Raises:
        DataError: the file is missing, is a directory, holds no records, or a
            line is not a JSON object with a string ``"text"`` (an SFT record, with
            ``"conversations"``, is named as such). The message names the file and the
            1-based line number.
    """

    def __init__(
        self, data_path: str | os.PathLike[str], tokenizer: Tokenizer, max_length: int = 512,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (room for BOS and EOS), got {max_length}")
        super().__init__(data_path, check_pretrain_record, cache_dir)
        self.tokenizer = tokenizer
        self.max_length = max_length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [BOS_ID, *encode(self.tokenizer, self.text(index), self.max_length - 2), EOS_ID]
        input_ids = torch.full((self.max_length,), PAD_ID, dtype=torch.long)
        input_ids[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        labels[input_ids == PAD_ID] = IGNORE_INDEX
        return input_ids, labels

    def text(self, index: int) -> str:
        """The raw ``"text"`` of record ``index`` (read from disk)."""
        return self.record(index, _text_of)["text"]


def _text_of(record: dict) -> str:
    text = record["text"]
    if not isinstance(text, str):
        raise TypeError(type(text).__name__)
    return text


def scan_jsonl(path: Path, check: RecordCheck | None = None) -> np.ndarray:
    """Validate a jsonl file of JSON objects without the cache; return the byte offset of each record.

    ``check(record, where)`` validates each decoded object (default: a MiniMind pretrain
    record) and raises :class:`DataError` with ``where`` (``"<path>: line N"``) in its
    message. Blank lines are skipped. Raises :class:`DataError` naming ``path`` and the
    1-based line number of the first invalid line. The datasets use the cached
    :func:`lit_minimind.data.index.record_offsets`.
    """
    return scan_offsets(require_file(path), check or check_pretrain_record)[0]


def record_kind(record: dict, where: str) -> str:
    """``"pretrain"`` for a ``{"text"}`` record, ``"sft"`` for a ``{"conversations"}`` one, ``"dpo"`` for
    a ``{"chosen", "rejected"}`` one."""
    found = [kind for kind, field in KIND_FIELD.items() if field in record]
    if len(found) == 1:
        return found[0]
    keys = ", ".join(repr(k) for k in list(record)[:5]) or "none"
    if found:
        fields = " and ".join(f'"{KIND_FIELD[k]}"' for k in found)
        raise DataError(f"{where}: record has both {fields}; cannot tell "
                        f"{' from '.join(_KIND_DATA[k] for k in found)} data (set --data.kind)")
    raise DataError(f'{where}: record has neither "text" (pretraining) nor "conversations" (SFT) '
                    f'nor "chosen"/"rejected" (DPO) (keys: {keys})')


def check_kind(record: dict, where: str, kind: str) -> None:
    """DataError unless ``record`` holds the field of ``kind``; a record of the other kind is named."""
    field = KIND_FIELD[kind]
    if field in record:
        return
    other = next((k for k in KINDS if k != kind and KIND_FIELD[k] in record), None)
    if other is not None:
        raise DataError(
            f'{where}: {_KIND_NAME[other]} record ("{KIND_FIELD[other]}") in {_KIND_NAME[kind]} data '
            f'(records need "{field}"); one file holds one kind of data'
        )
    keys = ", ".join(repr(k) for k in list(record)[:5]) or "none"
    raise DataError(f'{where}: record has no "{field}" field (keys: {keys})')


_KIND_NAME = {"pretrain": "a pretraining", "sft": "an SFT (chat)", "dpo": "a DPO (preference pair)"}
_KIND_DATA = {"pretrain": "pretraining", "sft": "SFT", "dpo": "DPO"}


def detect_kind(path: str | os.PathLike[str]) -> str:
    """The kind of a jsonl data file (``"pretrain"``, ``"sft"`` or ``"dpo"``), from its first non-blank record.

    Raises :class:`DataError` naming the file (and the line) when it is missing, empty, or
    the first record is neither kind. Later records are checked by the dataset's scan.
    """
    path = require_file(path)
    with open(path, "rb") as file:
        for lineno, line in enumerate(file, start=1):
            if line.isspace():
                continue
            where = f"{path}: line {lineno}"
            return record_kind(parse_record(line, where), where)
    raise DataError(f"{path}: no records (the file is empty or has only blank lines)")


def check_pretrain_record(record: dict, where: str) -> None:
    """Raise DataError (naming ``where``) unless ``record`` has a string "text" (MiniMind pretraining)."""
    check_kind(record, where, "pretrain")
    if not isinstance(record["text"], str):
        raise DataError(f'{where}: "text" must be a string, got {_json_type(record["text"])}')
