"""MiniMind pretraining dataset over a jsonl file, without loading it into memory."""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from tokenizers import Tokenizer
from torch.utils.data import Dataset

from lit_minimind.errors import DataError
from lit_minimind.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode

__all__ = ["DataError", "PretrainDataset", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # label value ignored by the cross-entropy loss


class PretrainDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """MiniMind pretraining samples from a jsonl file of ``{"text": ...}`` lines.

    The constructor reads the file once, validates every line and keeps only
    the byte offset of each record (an int64 array), so memory stays small for
    multi-GB files. ``__getitem__`` seeks to one line and parses only it. The
    file is opened lazily, once per process, so the dataset pickles cleanly
    into DataLoader workers. Blank (whitespace-only) lines are skipped and do
    not count as records; line numbers in errors still count them.

    Each sample is ``(input_ids, labels)``, two int64 tensors of length
    ``max_length``, built exactly as MiniMind does: ``[BOS] + first
    max_length-2 text tokens + [EOS]``, right-padded with PAD; ``labels`` is a
    copy of ``input_ids`` with every PAD position set to -100. The tokenizer
    must use MiniMind's special ids (pad 0, bos 1, eos 2), as
    :func:`lit_minimind.tokenizer.load_tokenizer` checks.

    Raises:
        DataError: the file is missing, is a directory, holds no records, or a
            line is not a JSON object with a string ``"text"``. The message
            names the file and the 1-based line number.
    """

    def __init__(
        self, data_path: str | os.PathLike[str], tokenizer: Tokenizer, max_length: int = 512
    ) -> None:
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (room for BOS and EOS), got {max_length}")
        self.data_path = Path(data_path)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.offsets: np.ndarray = scan_jsonl(self.data_path)
        self._file: BinaryIO | None = None
        self._file_pid: int | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [BOS_ID, *encode(self.tokenizer, self.text(index), self.max_length - 2), EOS_ID]
        input_ids = torch.full((self.max_length,), PAD_ID, dtype=torch.long)
        input_ids[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels = input_ids.clone()
        labels[input_ids == PAD_ID] = IGNORE_INDEX
        return input_ids, labels

    def text(self, index: int) -> str:
        """The raw ``"text"`` of record ``index`` (read from disk)."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} records")
        offset = int(self.offsets[index])
        file = self._handle()
        file.seek(offset)
        line = file.readline()
        try:
            text = json.loads(line)["text"]
            if not isinstance(text, str):
                raise TypeError(type(text).__name__)
        except (ValueError, TypeError, KeyError) as exc:
            raise DataError(
                f"{self.data_path}: record {index} (byte {offset}) no longer holds a valid "
                f"record; the file changed after the dataset scanned it ({exc!r})"
            ) from exc
        return text

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
        return state

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None and self._file_pid == os.getpid():
            self._file.close()


def scan_jsonl(path: Path) -> np.ndarray:
    """Validate a MiniMind pretrain jsonl file; return the byte offset of each record.

    Blank lines are skipped. Raises :class:`DataError` naming ``path`` and the
    1-based line number of the first invalid line.
    """
    if not path.exists():
        raise DataError(f"{path}: data file does not exist")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a jsonl file")

    offsets = array("q")
    position = 0
    with open(path, "rb") as file:
        for lineno, line in enumerate(file, start=1):
            start = position
            position += len(line)
            if line.isspace():
                continue
            _check_record(line, path, lineno)
            offsets.append(start)
    if not offsets:
        raise DataError(f"{path}: no records (the file is empty or has only blank lines)")
    return np.array(offsets, dtype=np.int64)


def _check_record(line: bytes, path: Path, lineno: int) -> None:
    """Raise DataError unless ``line`` is a JSON object with a string "text"."""
    where = f"{path}: line {lineno}"
    try:
        record = json.loads(line)
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {_json_type(record)}")
    if "text" not in record:
        keys = ", ".join(repr(k) for k in list(record)[:5]) or "none"
        raise DataError(f'{where}: record has no "text" field (keys: {keys})')
    if not isinstance(record["text"], str):
        raise DataError(f'{where}: "text" must be a string, got {_json_type(record["text"])}')


def _json_type(value: object) -> str:
    """JSON name of a decoded value's type, for error messages."""
    names = {
        dict: "object", list: "array", str: "string", bool: "boolean",
        int: "number", float: "number", type(None): "null",
    }
    return names.get(type(value), type(value).__name__)
