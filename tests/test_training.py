"""Training path end to end: LR rule, accumulation boundaries, CLI runs, errors, presets."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_minimind.checkpoint.names import (
    CHECKPOINT_SCHEMA,
    CONSOLE_STATE_KEY,
    MINIMIND_PPO_KEYS,
    PPO_STATE_KEY,
    RESUME_STATE_KEY,
    REWARD_MODEL_KEY,
    START_WEIGHTS_KEY,
    TEACHER_KEY,
)
from lit_minimind.model.module import minimind_lr
from tests.helpers.runs import (
    MINIMIND,
    ROOT,
    assert_resumed,
    assert_same_weights,
    cli_env,
    need_shared,
    run_cli,
    tiny_args,
)


def test_lr_rule_matches_formula_and_warmup() -> None:
    for t, total in [(1, 12), (6, 12), (12, 12), (100, 4000)]:
        assert minimind_lr(t, total, 5e-4) == 5e-4 * (0.1 + 0.45 * (1 + math.cos(math.pi * t / total)))
    assert minimind_lr(5, 100, 1e-3, warmup_steps=10) == pytest.approx(0.5 * minimind_lr(5, 100, 1e-3))
    assert minimind_lr(10, 100, 1e-3, warmup_steps=10) == minimind_lr(10, 100, 1e-3)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_uninterrupted_tiny_run_reproduces_minimind_run(tmp_path: Path, variant: str) -> None:
    """Same seed, data, config as MiniMind's own run: same init, batches, LR, updates -> same losses."""
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=1, accumulate=2, save_interval=5, moe=variant == "moe"))
    assert run.returncode == 0, run.stderr[-3000:]
    expected = json.loads((MINIMIND / "original_run" / "runs.json").read_text())[f"{variant}_full"]["steps"]
    assert [(1, s["step"]) for s in expected] == sorted(run.steps)
    for s in expected:
        loss, _, aux_loss, lr = (float(x) for x in run.steps[(1, s["step"])])
        assert abs(lr - s["lr"]) <= 1e-8
        assert abs(loss - s["loss"]) <= 2e-4, (s["step"], loss, s["loss"])
        assert abs(aux_loss - s["aux_loss"]) <= 2e-4
    suffix = "_moe" if variant == "moe" else ""
    ckpts = sorted(p.name.rsplit("_", 1)[0] for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert ckpts == [f"pretrain_64{suffix}_e0_s10_g5", f"pretrain_64{suffix}_e0_s12_g6"]  # keep_last 2
    # what the checkpoint holds is what checkpoint.names declares: every key, nothing else
    ckpt = torch.load(max((tmp_path / "checkpoints").glob("*_s12_*.ckpt")), weights_only=True)
    # LoRA, DPO, GRPO and PPO; distillation; GRPO and PPO with a reward model; PPO
    assert set(ckpt) == set(CHECKPOINT_SCHEMA) - {START_WEIGHTS_KEY, TEACHER_KEY, REWARD_MODEL_KEY, PPO_STATE_KEY,
                                                   *MINIMIND_PPO_KEYS}
    assert set(ckpt["callbacks"]) == {RESUME_STATE_KEY, CONSOLE_STATE_KEY}


def test_trailing_partial_window_is_flushed_like_minimind(tmp_path: Path) -> None:
    need_shared()
    # 48 samples / batch 5 = 10 batches; accumulation 3 -> steps after 3, 6, 9 and the flush at 10
    args = tiny_args(epochs=2, accumulate=3, save_interval=100) + ["--data.batch_size", "5"]
    run = run_cli(tmp_path, args)
    assert run.returncode == 0, run.stderr[-3000:]
    resume = torch.load(tmp_path / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert resume["global_step"] == 8
    assert (resume["epoch"], resume["step"]) == (1, 10)


@pytest.mark.slow  # the default CLI run: 1.5 min on 2 cores (make test-slow)
def test_default_cli_trains_embedded_corpus_and_loss_falls(tmp_path: Path) -> None:
    run = run_cli(tmp_path, [])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "== lit-minimind summary ==" in run.stdout
    first = float(run.stdout.split("loss: first ")[1].split()[0])
    last = float(run.stdout.split("-> last ")[1].split()[0])
    assert last <= 0.7 * first, (first, last)
    assert (tmp_path / "out" / "pretrain_128.pth").exists()
    assert (tmp_path / "checkpoints" / "pretrain_128_resume.pth").exists()
    # and the trained model writes text through `python -m lit_minimind.generate`
    gen = subprocess.run([sys.executable, "-m", "lit_minimind.generate", "out/pretrain_128.pth", "--prompt", "The ",
                          "--temperature", "0", "--max_new_tokens", "20"], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.startswith("The ") and len(gen.stdout.strip()) > len("The ") + 10


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "ok"}\nnot json\n', "line 2"),
        ('{"txt": "no text field"}\n', "line 1"),
        ("", "no records"),
    ],
)
def test_bad_data_fails_before_training_naming_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    need_shared()
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    run = run_cli(tmp_path, tiny_args() + ["--data.data_path", str(data)])
    assert run.returncode == 2
    assert str(data) in run.stderr and message in run.stderr
    assert not run.lines and not (tmp_path / "checkpoints").exists()


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_missing_tokenizer_and_checkpoint_are_clear_errors(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args() + ["--data.tokenizer_path", str(tmp_path)])
    assert run.returncode == 2 and "tokenizer.json" in run.stderr
    run = run_cli(tmp_path, tiny_args() + ["--ckpt_path", str(tmp_path / "nope.ckpt")])
    assert run.returncode == 2 and "nope.ckpt: no such checkpoint file" in run.stderr


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_ckpt_path_last_without_checkpoint_starts_fresh_and_a_resume_draws_no_initial_weights(tmp_path: Path) -> None:
    """``--ckpt_path`` builds the model without its random initialisation (the checkpoint overwrites every
    weight); when no checkpoint is found the model is initialised as without the flag, bit for bit."""
    need_shared()
    probe = ["--trainer.callbacks+=tests.helpers.init_draws.InitDraws"]
    drew = lambda d: json.loads((d / "init_draws.json").read_text())["drew"]  # noqa: E731
    plain, last = tmp_path / "plain", tmp_path / "last"
    plain.mkdir(), last.mkdir()
    run = run_cli(plain, tiny_args(*probe, "--trainer.max_steps", "2", save_interval=4))  # saved after batch 4
    assert run.returncode == 0, run.stderr[-3000:]
    assert drew(plain)  # the probe can tell: a plain start draws its initial weights
    run = run_cli(last, tiny_args(*probe, "--trainer.max_steps", "2", "--ckpt_path", "last", save_interval=4))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--ckpt_path last: no checkpoint for pretrain_64 in checkpoints/ yet; starting fresh" in run.stderr.splitlines()
    assert "Warning" not in run.stderr  # a plain line of its own, not a Python warning with a file and line number
    assert sorted(run.steps)[0] == (1, 1) and drew(last)
    assert_same_weights(plain, last)  # initialised as without --ckpt_path
    run = run_cli(plain, tiny_args(*probe, "--trainer.max_steps", "3", "--ckpt_path", "last", save_interval=4))
    assert run.returncode == 0, run.stderr[-3000:]
    assert_resumed(run, 1, 5)
    assert not drew(plain)  # no initial weights drawn for a resume


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "conf").glob("*.yaml")))
def test_presets_parse(preset: str) -> None:
    result = subprocess.run([sys.executable, "-m", "lit_minimind.fit", "--config", f"conf/{preset}", "--print_config"],
                            cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    import yaml

    given, used = yaml.safe_load((ROOT / "conf" / preset).read_text()), yaml.safe_load(result.stdout)
    assert given, f"{preset} sets nothing"
    assert_within(given, used, preset)


def assert_within(given: object, used: object, where: str) -> None:
    """Every value a preset sets is the value the run uses (the printed config adds defaults beside them)."""
    if isinstance(given, dict):
        assert isinstance(used, dict), f"{where}: {used!r} is not a mapping"
        for key, value in given.items():
            assert key in used, f"{where}.{key}: not in the run's config"
            assert_within(value, used[key], f"{where}.{key}")
    elif isinstance(given, list):
        assert isinstance(used, list) and len(used) == len(given), f"{where}: {used!r}"
        for i, (a, b) in enumerate(zip(given, used)):
            assert_within(a, b, f"{where}[{i}]")
    else:
        assert given == used or str(given) == str(used), f"{where}: preset {given!r}, run uses {used!r}"


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_validation_split_keeps_best_checkpoint(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=2, accumulate=1, save_interval=100) + ["--data.val_fraction", "0.25"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert max(run.steps) == (2, 9)  # 48 records - 12 held out = 36 -> 9 batches of 4
    assert run.stderr.count("new best val_loss") == 2  # loss falls: each epoch's validation is a new best
    best = torch.load(tmp_path / "checkpoints" / "pretrain_64_best.ckpt", weights_only=True)
    assert best["callbacks"]["ResumeCallback"]["best_val_loss"] is not None


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_bf16_mixed_runs_on_cpu(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=1) + ["--trainer.precision", "bf16-mixed"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.steps) == 12


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_time_based_save_cadence(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=1, save_interval=1000) +
                  ["--resume.save_every_minutes", "0.000001", "--resume.keep_last", "50"])
    assert run.returncode == 0, run.stderr[-3000:]
    steps = sorted(int(p.name.split("_s")[1].split("_")[0]) for p in (tmp_path / "checkpoints").glob("*.ckpt"))
    # every optimizer step is "due" by time (asked only at window boundaries: accumulation 2)
    assert steps == list(range(2, 13, 2))


@pytest.mark.slow
def test_stop_by_max_steps_saves_where_it_stopped(tmp_path: Path) -> None:
    need_shared()
    run_dir = tmp_path
    args = tiny_args(epochs=1, accumulate=2, save_interval=5)
    part = run_cli(run_dir, args + ["--trainer.max_steps", "3"])  # 6 batches: not a save point
    assert part.returncode == 0 and max(part.steps) == (1, 6)
    resume = torch.load(run_dir / "checkpoints" / "pretrain_64_resume.pth", weights_only=True)
    assert (resume["epoch"], resume["step"]) == (0, 6)
    # max_steps also shortens the LR schedule (T = max_steps x accumulation), so a longer run
    # continues from here on its own schedule: position, weights and optimizer carry over
    rest = run_cli(run_dir, args + ["--ckpt_path", "last"])
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert sorted(rest.steps) == [(1, s) for s in range(7, 13)]
    assert_resumed(rest, 1, 7)


def test_each_validation_is_shown_on_the_console(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args(epochs=1, accumulate=1, save_interval=100) + ["--data.val_fraction", "0.25"])
    assert run.returncode == 0, run.stderr[-3000:]
    shown = [line for line in run.stdout.splitlines() if line.startswith("validation after epoch 1 step 9/9: ")]
    assert len(shown) == 1, run.stdout[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.glob("lightning_logs/version_*/metrics.csv")))))
    val_loss = next(float(r["val_loss"]) for r in rows if r.get("val_loss"))
    assert f"val_loss {val_loss:.4f}" in shown[0] and "val_perplexity " in shown[0], shown


@pytest.mark.slow  # make test-slow (budget)
def test_validation_split_resume_at_epoch_end_keeps_each_validation(tmp_path: Path) -> None:
    need_shared()
    args = tiny_args(epochs=1, accumulate=1, save_interval=100) + ["--data.val_fraction", "0.25"]
    first = run_cli(tmp_path, args)
    assert first.returncode == 0 and first.stderr.count("new best val_loss") == 1
    more = [a if a != "1" or args[i - 1] != "--trainer.max_epochs" else "2" for i, a in enumerate(args)]
    second = run_cli(tmp_path, more + ["--ckpt_path", "last"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert_resumed(second, 2, 1)
    assert sorted(second.steps) == [(2, s) for s in range(1, 10)]
    assert second.stderr.count("new best val_loss") == 1  # epoch 2's validation ran (and beat epoch 1's)


def test_a_resume_with_another_epoch_count_says_how_the_lr_changes(tmp_path: Path) -> None:
    """The README's exercise from MiniMind (``--epochs 1``, then ``--epochs 2 --from_resume 1``): the LR rule's total
    steps change with the epochs, as in MiniMind; the resume says so in one line, with the LR of its first batch
    before and after, and that LR is the one trained with. The same epoch count again: no line."""
    need_shared()
    first = run_cli(tmp_path, tiny_args(epochs=1, accumulate=1, save_interval=100))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(tmp_path, tiny_args(epochs=2, accumulate=1, save_interval=100) + ["--from_resume", "1"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert_resumed(second, 2, 1)
    before, after = minimind_lr(13, 12, 5e-4), minimind_lr(13, 24, 5e-4)
    assert before != after
    line = (f"learning rate schedule: 12 -> 24 total steps (another epoch or step count than the checkpoint's run): "
            f"lr {before:.6g} -> {after:.6g} at epoch 2 step 1")
    assert line in second.stderr.splitlines(), second.stderr[-3000:]
    assert float(second.steps[(2, 1)][-1]) == pytest.approx(after, abs=1e-8)  # the console's lr: the new rule's
    again = run_cli(tmp_path, tiny_args(epochs=2, accumulate=1, save_interval=100) + ["--ckpt_path", "last"])
    assert again.returncode == 0 and "learning rate schedule" not in again.stderr, again.stderr[-3000:]
