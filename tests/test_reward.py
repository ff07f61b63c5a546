"""The reward model stage: a MiniMind backbone with a scalar head trained on preference pairs
(Bradley-Terry), its held-out pairwise accuracy, its files, and an exact resume."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.runs import (
    MINIMIND,
    POST,
    QUIET,
    SFT_EXPORT,
    TOKENIZER,
    assert_same_files,
    assert_steps_match,
    minimind_model,
    need_shared,
    run_cli,
    run_until_done,
)


def reward_args(*extra: str) -> list[str]:
    return ["--model.objective", "reward", "--from_weight", str(SFT_EXPORT), "--data.data_path", str(POST / "dpo.jsonl"),
            "--data.tokenizer_path", str(TOKENIZER), "--model.hidden_size", "64", "--model.num_hidden_layers", "2",
            "--data.max_seq_len", "128", "--data.batch_size", "4", "--model.learning_rate", "1e-3",
            "--trainer.max_epochs", "2", "--data.val_fraction", "0.25", "--trainer.accelerator", "cpu",
            "--trainer.devices", "1", "--log_interval", "1", "--resume.save_interval", "3", *QUIET, *extra]


def test_scores_are_read_at_the_last_answer_token() -> None:
    """The reward of a sequence is the head's value at its last answer token: padding after it changes
    nothing, the token itself does; the loss is -log sigmoid(r_chosen - r_rejected)."""
    from lit_minimind.model import MiniMindConfig
    from lit_minimind.model.reward import RewardModel, bradley_terry_loss

    torch.manual_seed(0)
    model = RewardModel(MiniMindConfig(hidden_size=64, num_hidden_layers=2)).eval()
    ids = torch.randint(3, 6400, (2, 12))
    mask = torch.zeros(2, 11, dtype=torch.long)
    mask[0, 4:8] = 1  # answer tokens ids[5..8]: the reward is read at ids position 8
    mask[1, 2:10] = 1
    batch = {"x_chosen": ids[:1, :-1], "y_chosen": ids[:1, 1:], "mask_chosen": mask[:1],
             "x_rejected": ids[1:, :-1], "y_rejected": ids[1:, 1:], "mask_rejected": mask[1:]}
    loss, stats = bradley_terry_loss(model, batch)
    values, _ = model.scores(ids)
    r_c, r_r = values[0, 8], values[1, 10]
    assert torch.allclose(loss, -F.logsigmoid(r_c - r_r), atol=1e-6)
    assert float(stats["rewards/accuracy"]) == float(r_c > r_r)
    after = {**batch, "y_chosen": batch["y_chosen"].clone()}
    after["y_chosen"][0, 9:] = 0  # tokens after the last answer token
    assert torch.allclose(bradley_terry_loss(model, after)[0], loss)
    changed = {**batch, "y_chosen": batch["y_chosen"].clone()}
    changed["y_chosen"][0, 7] = (changed["y_chosen"][0, 7] + 1) % 6400  # the last answer token (ids[8])
    assert not torch.allclose(bradley_terry_loss(model, changed)[0], loss)


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_reward_model_learns_the_pairs_and_reports_held_out_accuracy(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, reward_args())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reward model: files named reward" in run.stdout
    assert "Epoch:[2/2](7/7), loss: " in run.stdout and ", reward_loss: " in run.stdout
    rows = list(csv.DictReader(open(next(tmp_path.glob("lightning_logs/version_*/metrics.csv")))))
    held_out = [(float(r["val_loss"]), float(r["val_reward_accuracy"])) for r in rows if r.get("val_reward_accuracy")]
    assert len(held_out) == 2  # one per epoch, on the last 9 of the 36 pairs (val_fraction 0.25)
    shown = [line for line in run.stdout.splitlines() if line.startswith("validation after epoch ")]
    assert [f"{accuracy:.4f}" in line and "val_reward_accuracy" in line for (_, accuracy), line in zip(held_out, shown)] \
        == [True, True], shown  # the held-out accuracy of each epoch on the console
    assert held_out[1][0] < held_out[0][0] < 0.6931 and held_out[1][1] >= 0.75, held_out
    train = [r for r in rows if r.get("reward_loss")]
    assert len(train) == 14 and all(0 <= float(r["rewards/accuracy"]) <= 1 for r in train)
    export = torch.load(tmp_path / "out" / "reward_64.pth", weights_only=True)
    assert export["value_head.weight"].shape == (1, 64) and export["value_head.weight"].dtype == torch.float16
    result = minimind_model().load_state_dict(export, strict=False)  # MiniMind's loaders read the backbone
    assert result.missing_keys == [] and sorted(result.unexpected_keys) == ["value_head.bias", "value_head.weight"]


def test_objective_and_data_must_agree(tmp_path: Path) -> None:
    need_shared()
    args = reward_args("--data.data_path", str(MINIMIND / "sft" / "sft.jsonl"), "--trainer.max_steps", "1")
    run = run_cli(tmp_path, args)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == ("error: --model.objective reward trains on preference pairs: give "
                                                   "DPO data (--data.kind dpo, or a file of chosen/rejected records)")


@pytest.mark.slow  # make test-slow: keeps make test under its budget
def test_kill_anywhere_reward(tmp_path: Path) -> None:
    need_shared()
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir()
    kill_dir.mkdir()
    args = reward_args("--data.val_fraction", "0")
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 18
    runs = run_until_done(kill_dir, args, random.Random("kill-reward"), kills=3, total_lines=18, stem="reward_64", iters=9)
    assert len(runs) >= 2, "no kill happened"
    assert_steps_match(runs, ref)
    assert_same_files(ref_dir, kill_dir, ["out/reward_64.pth", "checkpoints/reward_64_resume.pth"])
