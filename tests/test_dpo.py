"""MiniMind's DPO stage (``trainer/train_dpo.py``): its data, its loss and its runs, reproduced.

Fixtures: ``../shared/minimind/post`` (MiniMind commit d65ef2c, 64x2 model, CPU, fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import MINIMIND, TOKENIZER, need_shared

POST = MINIMIND / "post"
DPO_JSONL = POST / "dpo.jsonl"


@pytest.mark.parametrize("max_length", [128, 384])
def test_dpo_dataset_equals_minimind(max_length: int) -> None:
    """Both sides rendered with MiniMind's chat template, the assistant-token mask, the padding and the
    shift: MiniMind's DPODataset tensors, exactly."""
    need_shared()
    from lit_minimind.data.chat_template import load_chat_template
    from lit_minimind.data.dpo import DPODataset
    from lit_minimind.data.tokenizer import load_tokenizer

    dataset = DPODataset(DPO_JSONL, load_tokenizer(TOKENIZER), max_length, load_chat_template(TOKENIZER),
                         empty_think_ratio=0)
    expected = torch.load(POST / "dpo_dataset_expected.pth")[f"len{max_length}"]
    assert len(dataset) == expected["x_chosen"].shape[0]
    for key, tensor in expected.items():
        got = torch.stack([dataset[i][key] for i in range(len(dataset))])
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    assert expected["mask_chosen"].sum() > 0 and (expected["mask_chosen"] != expected["mask_rejected"]).any()


def test_dpo_kind_detected_and_bad_records_named(tmp_path: Path) -> None:
    need_shared()
    from lit_minimind.data.dataset import detect_kind
    from lit_minimind.data.dpo import DPODataset
    from lit_minimind.data.tokenizer import load_tokenizer
    from lit_minimind.errors import DataError

    assert detect_kind(DPO_JSONL) == "dpo"
    first = DPO_JSONL.read_text().splitlines()[0]
    cases = {
        '{"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}': 'line 2: DPO record without "rejected"',
        '{"text": "plain"}': 'line 2: a pretraining record ("text") in a DPO (preference pair) data',
        '{"chosen": [], "rejected": []}': 'line 2: chosen: "chosen" is empty',
        '{"chosen": [{"role": "bot", "content": "x"}], "rejected": [{"role": "user", "content": "x"}]}':
            "line 2: chosen: chosen[0]: unknown role 'bot'",
    }
    tokenizer = load_tokenizer(TOKENIZER)
    for line, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(first + "\n" + line + "\n")
        with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            DPODataset(path, tokenizer, 64)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"text": "x", "chosen": []}) + "\n")
    with pytest.raises(DataError, match='both "text" and "chosen"; cannot tell pretraining from DPO'):
        detect_kind(mixed)


def test_embedded_pairs_are_dpo_records() -> None:
    from lit_minimind.data.corpus import embedded_pairs
    from lit_minimind.data.dpo import check_dpo_record

    pairs = embedded_pairs()
    assert len(pairs) > 20
    for i, pair in enumerate(pairs):
        check_dpo_record(pair, f"pair {i}")
        assert pair["chosen"][0] == pair["rejected"][0] and pair["chosen"][1] != pair["rejected"][1]
