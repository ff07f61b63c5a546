"""Tests for lit_minimind.data.dataset.PretrainDataset."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from lit_minimind.data.dataset import PretrainDataset
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, encode, load_tokenizer
from lit_minimind.errors import DataError

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "minimind"
MINIMIND_TOKENIZER = SHARED / "tokenizer"
TINY_JSONL = SHARED / "original_run" / "tiny.jsonl"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    if not (MINIMIND_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"MiniMind tokenizer not found at {MINIMIND_TOKENIZER}")
    return load_tokenizer(MINIMIND_TOKENIZER)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
        encoding="utf-8",
    )
    return path


# --- sample format ---------------------------------------------------------------


def test_sample_format(tmp_path: Path, tokenizer: Tokenizer) -> None:
    text = "Hello world. 你好"
    dataset = PretrainDataset(write_jsonl(tmp_path / "d.jsonl", [text]), tokenizer, max_length=32)
    input_ids, labels = dataset[0]
    body = tokenizer.encode(text, add_special_tokens=False).ids
    n = len(body) + 2
    assert input_ids.dtype == labels.dtype == torch.long
    assert input_ids.shape == labels.shape == (32,)
    assert input_ids[0] == BOS_ID
    assert input_ids[1 : n - 1].tolist() == body
    assert input_ids[n - 1] == EOS_ID
    assert (input_ids[n:] == PAD_ID).all()
    assert labels[:n].tolist() == input_ids[:n].tolist()
    assert (labels[n:] == -100).all()


def test_long_text_truncated(tmp_path: Path, tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 50
    dataset = PretrainDataset(write_jsonl(tmp_path / "d.jsonl", [text]), tokenizer, max_length=16)
    input_ids, labels = dataset[0]
    body = tokenizer.encode(text, add_special_tokens=False).ids
    assert input_ids.tolist() == [BOS_ID, *body[:14], EOS_ID]
    assert labels.tolist() == input_ids.tolist()  # no padding, nothing masked


def test_empty_text_and_blank_lines(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('\n{"text": "a"}\n   \n\n{"text": ""}\n\n', encoding="utf-8")
    dataset = PretrainDataset(path, tokenizer, max_length=8)
    assert len(dataset) == 2
    assert dataset.text(0) == "a" and dataset.text(1) == ""
    input_ids, labels = dataset[1]
    assert input_ids.tolist() == [BOS_ID, EOS_ID] + [PAD_ID] * 6
    assert labels.tolist() == [BOS_ID, EOS_ID] + [-100] * 6
    with pytest.raises(IndexError):
        dataset[2]


def test_matches_tokenizer_on_tiny_jsonl(tokenizer: Tokenizer) -> None:
    if not TINY_JSONL.is_file():
        pytest.skip(f"MiniMind sample data not found at {TINY_JSONL}")
    dataset = PretrainDataset(TINY_JSONL, tokenizer, max_length=64)
    lines = TINY_JSONL.read_text(encoding="utf-8").splitlines()
    assert len(dataset) == len(lines)
    for i, line in enumerate(lines[:8]):
        text = json.loads(line)["text"]
        expected = tokenizer.encode(text, add_special_tokens=False).ids[:62]
        assert encode(tokenizer, text, 62) == expected
        input_ids, _ = dataset[i]
        assert input_ids[: len(expected) + 2].tolist() == [BOS_ID, *expected, EOS_ID]


def test_pickles_and_works_in_dataloader_workers(tmp_path: Path, tokenizer: Tokenizer) -> None:
    texts = [f"sample number {i}: " + "word " * i for i in range(12)]
    dataset = PretrainDataset(write_jsonl(tmp_path / "d.jsonl", texts), tokenizer, max_length=24)
    first = dataset[3]  # opens the file in this process
    clone = pickle.loads(pickle.dumps(dataset))
    assert all(torch.equal(a, b) for a, b in zip(clone[3], first))
    loader = DataLoader(dataset, batch_size=4, num_workers=2)
    batches = list(loader)
    input_ids = torch.cat([b[0] for b in batches])
    assert torch.equal(input_ids, torch.stack([dataset[i][0] for i in range(len(dataset))]))
    dataset.close()


# --- validation errors ---------------------------------------------------------


def test_missing_file(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match="does not exist") as err:
        PretrainDataset(path, tokenizer)
    assert str(path) in str(err.value)


def test_directory(tmp_path: Path, tokenizer: Tokenizer) -> None:
    with pytest.raises(DataError, match="is a directory") as err:
        PretrainDataset(tmp_path, tokenizer)
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize("content", ["", "\n  \n\n"], ids=["empty", "only-blank-lines"])
def test_no_records(tmp_path: Path, tokenizer: Tokenizer, content: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match="no records") as err:
        PretrainDataset(path, tokenizer)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(("bad_line", "message"), [
    ('{"text": "a line cut short', "not valid JSON (Unterminated string starting at column 10)"),
    ('{"text": "no comma" "x": 1}', "not valid JSON (Expecting ',' delimiter at column 21)"),
    ('{"text": "ends early"', "not valid JSON (Expecting ',' delimiter at column 22)"),
])
def test_a_malformed_line_is_described_as_written_not_by_its_newline(tmp_path: Path, tokenizer, bad_line: str,
                                                                      message: str) -> None:
    """The line's newline is not part of its JSON: a string left open is "unterminated" at the column it opened,
    an object left open is reported on its own line, not at "column 1" of the next."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + bad_line + '\n{"text": "fine"}\n')
    with pytest.raises(DataError) as err:
        PretrainDataset(path, tokenizer)
    assert str(err.value) == f"{path}: line 2: {message}"


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"text": "unterminated', "not valid JSON"),
        ('["text", "a list"]', "expected a JSON object, got array"),
        ('"just a string"', "expected a JSON object, got string"),
        ('{"content": "x"}', 'no "text" field'),
        ('{"text": 42}', '"text" must be a string, got number'),
        ('{"text": null}', '"text" must be a string, got null'),
        ('{"text": ["a"]}', '"text" must be a string, got array'),
    ],
)
def test_bad_line(tmp_path: Path, tokenizer: Tokenizer, bad_line: str, problem: str) -> None:
    path = tmp_path / "d.jsonl"
    # Line 3 is bad; line 2 is blank and still counts toward the line number.
    path.write_text(f'{{"text": "ok"}}\n\n{bad_line}\n{{"text": "ok"}}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        PretrainDataset(path, tokenizer)
    message = str(err.value)
    assert str(path) in message and "line 3" in message and problem in message


def test_invalid_utf8(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe bad"}\n')
    with pytest.raises(DataError, match="not valid UTF-8") as err:
        PretrainDataset(path, tokenizer)
    assert str(path) in str(err.value) and "line 2" in str(err.value)


def test_data_error_is_value_error() -> None:
    assert issubclass(DataError, ValueError)


def test_max_length_too_small(tmp_path: Path, tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="max_length"):
        PretrainDataset(write_jsonl(tmp_path / "d.jsonl", ["a"]), tokenizer, max_length=1)
