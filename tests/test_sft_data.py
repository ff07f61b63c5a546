"""SFT data: MiniMind's SFTDataset reproduced exactly, errors naming file and line, kind detection,
and augmentation drawn from (seed, epoch, index)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lit_minimind.data.chat_template import MINIMIND_CHAT_TEMPLATE, load_chat_template, render_chat
from lit_minimind.data.corpus import embedded_conversations, write_embedded_sft_corpus
from lit_minimind.data.datamodule import MiniMindDataModule
from lit_minimind.data.dataset import PretrainDataset, detect_kind
from lit_minimind.data.sampler import EpochShardSampler
from lit_minimind.data.sft import EMPTY_THINK, SYSTEM_PROMPTS, SFTDataset
from lit_minimind.data.tokenizer import load_tokenizer
from lit_minimind.errors import DataError

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "minimind"
TOKENIZER = SHARED / "tokenizer"
SFT_JSONL = SHARED / "sft" / "sft.jsonl"
EXPECTED = SHARED / "sft" / "dataset_expected.pth"

USER = {"role": "user", "content": "What is a list?"}
ANSWER = {"role": "assistant", "content": "A mutable sequence."}
GOOD = {"conversations": [USER, ANSWER]}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"reference data not found at {SHARED} (../shared is absent)")
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def expected() -> dict:
    if not EXPECTED.is_file():
        pytest.skip(f"reference data not found at {EXPECTED} (../shared is absent)")
    return torch.load(EXPECTED, weights_only=True)


def write(path: Path, *lines: object) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n"
                            for line in lines), encoding="utf-8")
    return path


# --- parity with MiniMind's SFTDataset -------------------------------------------------------


@pytest.mark.parametrize("think", [0, 1])
@pytest.mark.parametrize("max_len", [128, 512])
def test_samples_equal_minimind(tokenizer: Tokenizer, expected: dict, think: int, max_len: int) -> None:
    dataset = SFTDataset(SFT_JSONL, tokenizer, max_length=max_len, chat_template=load_chat_template(TOKENIZER),
                         add_system_ratio=0.0, empty_think_ratio=float(think))
    want = expected[f"think{think}_len{max_len}"]
    assert len(dataset) == len(want["input_ids"]) == 48
    samples = [dataset[i] for i in range(len(dataset))]
    assert torch.equal(torch.stack([s[0] for s in samples]), want["input_ids"])
    assert torch.equal(torch.stack([s[1] for s in samples]), want["labels"])


def test_tokenizer_template_is_minimind() -> None:
    if not TOKENIZER.is_dir():
        pytest.skip("../shared is absent")
    assert load_chat_template(TOKENIZER) == MINIMIND_CHAT_TEMPLATE


def test_labels_cover_answers_only(tokenizer: Tokenizer, tmp_path: Path) -> None:
    record = {"conversations": [USER, ANSWER, {"role": "user", "content": "And a tuple?"},
                                {"role": "assistant", "content": "An immutable one.", "reasoning_content": "easy"}]}
    dataset = SFTDataset(write(tmp_path / "d.jsonl", record), tokenizer, max_length=96,
                         add_system_ratio=0.0, empty_think_ratio=0.0)
    input_ids, labels = dataset[0]
    kept = [t for t, y in zip(input_ids.tolist(), labels.tolist()) if y != -100]
    assert tokenizer.decode(kept, skip_special_tokens=False) == (
        "A mutable sequence.<|im_end|>\n<think>\neasy\n</think>\n\nAn immutable one.<|im_end|>\n")
    assert torch.equal(labels[labels != -100], input_ids[labels != -100])
    assert (input_ids[-1] == 0) and (labels[input_ids == 0] == -100).all()


def test_tool_call_record_renders_as_minimind(tokenizer: Tokenizer, tmp_path: Path) -> None:
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    calls = [{"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC"}}}]
    record = {"conversations": [
        {"role": "system", "content": "Use tools.", "tools": json.dumps(tools)},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": json.dumps(calls)},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "Noon."},
    ]}
    dataset = SFTDataset(write(tmp_path / "d.jsonl", record), tokenizer, max_length=400,
                         add_system_ratio=1.0, empty_think_ratio=0.0)
    text = dataset.prompt(0)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n")  # no system prompt added to tool use
    assert '\n<tools>\n{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}\n</tools>' in text
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nNoon.<|im_end|>\n")
    input_ids, labels = dataset[0]
    kept = [t for t, y in zip(input_ids.tolist(), labels.tolist()) if y != -100]
    assert tokenizer.decode(kept, skip_special_tokens=False) == (
        '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>\nNoon.<|im_end|>\n')


def test_render_generation_prompt() -> None:
    assert render_chat([USER], add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render_chat([USER], add_generation_prompt=True, open_thinking=True).endswith("assistant\n<think>\n")


# --- bad records ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"conversations": [', "not valid JSON"),
        ('["conversations"]', "expected a JSON object, got array"),
        ('{"conversations": {"role": "user"}}', '"conversations" must be an array of messages, got object'),
        ('{"conversations": []}', '"conversations" is empty'),
        ('{"conversations": ["hi"]}', "conversations[0]: expected a message object, got string"),
        ('{"conversations": [{"role": "bot", "content": "x"}]}', "conversations[0]: unknown role 'bot'"),
        ('{"conversations": [{"content": "x"}]}', "conversations[0]: unknown role null"),
        ('{"conversations": [{"role": "user", "content": "q"}]}', "no assistant turn"),
        ('{"conversations": [{"role": "assistant", "content": 7}]}', '"content" must be a string, got number'),
        ('{"conversations": [{"role": "system", "content": "s", "tools": "[oops"}, {"role": "assistant", "content": "a"}]}',
         '"tools" is a string but not valid JSON'),
        ('{"text": "plain pretraining text"}', 'a pretraining record ("text") in an SFT (chat) data'),
        ('{"messages": []}', 'record has no "conversations" field'),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, tokenizer: Tokenizer, bad_line: str, problem: str) -> None:
    path = write(tmp_path / "d.jsonl", GOOD, "", bad_line, GOOD)  # line 2 blank: still counted
    with pytest.raises(DataError) as err:
        SFTDataset(path, tokenizer)
    message = str(err.value)
    assert f"{path}: line 3" in message and problem in message, message


def test_sft_record_in_pretraining_file(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = write(tmp_path / "d.jsonl", {"text": "a"}, {"text": "b"}, GOOD)
    with pytest.raises(DataError) as err:
        PretrainDataset(path, tokenizer)
    assert f"{path}: line 3" in str(err.value) and 'an SFT (chat) record ("conversations")' in str(err.value)


# --- kind detection ---------------------------------------------------------------------------


def test_detect_kind(tmp_path: Path) -> None:
    assert detect_kind(write(tmp_path / "a.jsonl", "", "  ", GOOD)) == "sft"
    assert detect_kind(write(tmp_path / "b.jsonl", {"text": "x"}, GOOD)) == "pretrain"  # the scan finds line 2
    with pytest.raises(DataError, match=r"c\.jsonl: line 2: record has neither"):
        detect_kind(write(tmp_path / "c.jsonl", "", {"prompt": "x"}))
    with pytest.raises(DataError, match="both"):
        detect_kind(write(tmp_path / "d.jsonl", {"text": "x", "conversations": []}))
    with pytest.raises(DataError, match="no records"):
        detect_kind(write(tmp_path / "e.jsonl", ""))


def datamodule(path: Path | None, tmp_path: Path, **kwargs) -> MiniMindDataModule:
    dm = MiniMindDataModule(data_path=str(path) if path else None, tokenizer_path=str(TOKENIZER), max_seq_len=64,
                            batch_size=2, cache_dir=str(tmp_path / "cache"), **kwargs)
    dm.setup("fit")
    return dm


def test_datamodule_kind(tmp_path: Path, tokenizer: Tokenizer) -> None:
    sft = write(tmp_path / "sft.jsonl", GOOD, GOOD)
    dm = datamodule(sft, tmp_path)
    assert dm.data_kind == "sft" and isinstance(dm.train_dataset, SFTDataset)
    assert dm.train_dataset.add_system_ratio == 0.2 and dm.train_dataset.empty_think_ratio == 0.2
    with pytest.raises(DataError, match=r"sft\.jsonl: line 1: an SFT \(chat\) record"):
        datamodule(sft, tmp_path, kind="pretrain")
    mixed = write(tmp_path / "mixed.jsonl", GOOD, {"text": "x"})
    with pytest.raises(DataError, match=r"mixed\.jsonl: line 2: a pretraining record"):
        datamodule(mixed, tmp_path)
    pretrain = write(tmp_path / "p.jsonl", {"text": "x"})
    assert isinstance(datamodule(pretrain, tmp_path).train_dataset, PretrainDataset)
    with pytest.raises(ValueError, match="kind"):
        MiniMindDataModule(kind="chat")
    with pytest.raises(ValueError, match="empty_think_ratio"):
        MiniMindDataModule(empty_think_ratio=1.5)


def test_embedded_sft_corpus(tmp_path: Path, tokenizer: Tokenizer) -> None:
    dm = datamodule(None, tmp_path, kind="sft", add_system_ratio=0.0)
    assert dm.data_kind == "sft" and len(dm.train_dataset) == len(embedded_conversations()) > 50
    assert dm.train_dataset.data_path == write_embedded_sft_corpus(tmp_path / "cache")  # cached, same file
    text = dm.train_dataset.prompt(0)
    assert text.startswith("<|im_start|>user\nWhat is ") and "<|im_start|>assistant\n" in text
    input_ids, labels = dm.train_dataset[0]
    assert (labels != -100).any()


# --- augmentation -----------------------------------------------------------------------------


def conversations_file(tmp_path: Path, n: int = 40) -> Path:
    records = [{"conversations": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(n)]
    return write(tmp_path / "d.jsonl", *records)


def test_augmentation_is_a_function_of_seed_epoch_index(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = conversations_file(tmp_path)
    a = SFTDataset(path, tokenizer, max_length=64, add_system_ratio=0.5, empty_think_ratio=0.5)
    b = SFTDataset(path, tokenizer, max_length=64, add_system_ratio=0.5, empty_think_ratio=0.5)
    order = list(range(len(a)))
    first = [a[i] for i in order]
    again = {i: b[i] for i in reversed(order)}  # another instance, another access order
    assert all(torch.equal(first[i][0], again[i][0]) and torch.equal(first[i][1], again[i][1]) for i in order)
    worker_copy = pickle.loads(pickle.dumps(a))  # what a DataLoader worker gets
    assert all(torch.equal(worker_copy[i][0], first[i][0]) for i in order)

    prompts = [a.prompt(i) for i in order]
    with_system = [p.startswith("<|im_start|>system\n") for p in prompts]
    with_think = [EMPTY_THINK in p for p in prompts]
    assert 0 < sum(with_system) < len(order) and 0 < sum(with_think) < len(order)
    assert all(any(f"system\n{s}<|im_end|>" in p for s in SYSTEM_PROMPTS) for p, w in zip(prompts, with_system) if w)

    a.set_epoch(1)
    epoch1 = [a.prompt(i) for i in order]
    assert epoch1 != prompts  # new draws each epoch
    assert [b.prompt(i, epoch=1) for i in order] == epoch1
    other_seed = SFTDataset(path, tokenizer, max_length=64, add_system_ratio=0.5, empty_think_ratio=0.5, seed=7)
    assert [other_seed.prompt(i) for i in order] != prompts


def test_follow_epoch(tmp_path: Path, tokenizer: Tokenizer) -> None:
    path = conversations_file(tmp_path, n=16)
    dataset = SFTDataset(path, tokenizer, max_length=64, add_system_ratio=0.5, empty_think_ratio=0.5)
    sampler = EpochShardSampler(len(dataset))
    dataset.follow_epoch(sampler)
    sampler.set_epoch(3)  # what Lightning calls each epoch
    assert dataset.current_epoch == 3
    assert [dataset.prompt(i) for i in range(16)] == [dataset.prompt(i, epoch=3) for i in range(16)]
    assert pickle.loads(pickle.dumps(dataset)).current_epoch == 3
    dataset.set_epoch(5)
    sampler.set_epoch(4)
    assert dataset.current_epoch == 5


@pytest.mark.parametrize(("system", "think"), [(0.0, 0.0), (1.0, 1.0)])
def test_ratio_bounds_are_certain(tmp_path: Path, tokenizer: Tokenizer, system: float, think: float) -> None:
    path = write(tmp_path / "d.jsonl", GOOD, {"conversations": [{"role": "system", "content": "S"}, USER, ANSWER]})
    dataset = SFTDataset(path, tokenizer, max_length=64, add_system_ratio=system, empty_think_ratio=think)
    for epoch in range(20):
        dataset.set_epoch(epoch)
        first, second = dataset.prompt(0), dataset.prompt(1)
        assert first.startswith("<|im_start|>system\n") == bool(system)
        assert second.startswith("<|im_start|>system\nS<|im_end|>")  # an existing system prompt stays alone
        assert (EMPTY_THINK in first) == bool(think) and (EMPTY_THINK in second) == bool(think)
