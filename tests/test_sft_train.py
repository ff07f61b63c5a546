"""MiniMind's SFT stage (``trainer/train_full_sft.py``) on the same machinery as pretraining.

MiniMind's SFT training is its pretraining loop on SFT data (same loss: CE over the labelled
tokens + MoE aux loss; same AdamW and LR rule), so the port runs it unchanged; what differs is
the data, the file names (``full_sft``) and the starting weights (``--from_weight``).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import (
    MINIMIND,
    TOKENIZER,
    assert_resumed,
    assert_same_files,
    assert_steps_match,
    cli_env,
    need_shared,
    run_cli,
    run_until_done,
)

SFT = MINIMIND / "sft"
SFT_JSONL = SFT / "sft.jsonl"
PRETRAINED = MINIMIND / "original_run" / "out__pretrain_64.pth"
RUNS = json.loads((SFT / "runs.json").read_text()) if SFT.exists() else {}
PINNED = ["--data.add_system_ratio", "0", "--data.empty_think_ratio", "0"]  # MiniMind's augmentation as in think0
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def minimind_sft_argv(run: str) -> list[str]:
    """runs.json's argv of MiniMind's ``train_full_sft.py``, with the shared data and tokenizer."""
    argv = list(RUNS[run]["argv"][2:])  # without "python trainer/train_full_sft.py"
    argv[argv.index("--data_path") + 1] = str(SFT_JSONL)
    return argv + ["--tokenizer_path", str(TOKENIZER), *PINNED, *QUIET]


def assert_steps(got: dict, expected: list[dict]) -> None:
    assert sorted(got) == [(s["epoch"] + 1, s["step"]) for s in expected]
    for s in expected:
        loss, logits_loss, aux_loss, lr = (float(x) for x in got[(s["epoch"] + 1, s["step"])])
        assert abs(loss - s["loss"]) <= 2e-4, (s["step"], loss, s["loss"])
        assert abs(logits_loss - s["logits_loss"]) <= 2e-4
        assert abs(aux_loss - s["aux_loss"]) <= 2e-4
        assert abs(lr - s["lr"]) <= 1e-8, (s["step"], lr, s["lr"])


def test_minimind_sft_argv_reproduces_its_run_and_minimind_loads_the_export(tmp_path: Path) -> None:
    need_shared()
    (tmp_path / "out").mkdir()
    shutil.copy(PRETRAINED, tmp_path / "out" / "pretrain_64.pth")  # --from_weight pretrain: {save_dir}/pretrain_64.pth
    run = run_cli(tmp_path, minimind_sft_argv("sft_full"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SFT data: files named full_sft" in run.stdout
    assert "--from_weight: loaded 25 tensors from out/pretrain_64.pth" in run.stdout
    assert_steps(run.steps, RUNS["sft_full"]["steps"])

    # MiniMind's names; the pretrained weights it started from are untouched
    assert torch.equal(torch.load(tmp_path / "out" / "pretrain_64.pth")["lm_head.weight"],
                       torch.load(PRETRAINED)["lm_head.weight"])
    assert not list((tmp_path / "checkpoints").glob("pretrain*"))
    export = torch.load(tmp_path / "out" / "full_sft_64.pth", weights_only=True)
    resume = torch.load(tmp_path / "checkpoints" / "full_sft_64_resume.pth", weights_only=True)
    assert (resume["epoch"], resume["step"], resume["world_size"]) == (0, 12, 1)

    # what MiniMind does with them: its model (ours is key-for-key MiniMind's) loads them strictly
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    config = MiniMindConfig.from_dict(json.loads((MINIMIND / "parity" / "dense_config.json").read_text()))
    model = MiniMindForCausalLM(config)
    model.load_state_dict(export, strict=True)  # eval_llm.py / --from_weight full_sft
    model.load_state_dict(resume["model"], strict=True)  # train_full_sft.py --from_resume 1
    torch.optim.AdamW(model.parameters(), lr=1e-4).load_state_dict(resume["optimizer"])
    # and they are MiniMind's own final weights, to fp16 rounding
    original = torch.load(SFT / "out__full_sft_64.pth", weights_only=True)
    assert list(original) == list(export)
    for key, value in original.items():
        assert export[key].dtype == torch.float16
        assert torch.allclose(export[key].float(), value.float(), atol=2e-3, rtol=0), key


def test_from_resume_continues_minimind_sft_file(tmp_path: Path) -> None:
    need_shared()
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(SFT / "checkpoints__full_sft_64_resume.step5.pth", tmp_path / "checkpoints" / "full_sft_64_resume.pth")
    run = run_cli(tmp_path, minimind_sft_argv("sft_resumed"))  # ends in --from_resume 1
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--from_resume 1 -> --ckpt_path last" in run.stdout
    assert_resumed(run, 1, 6)
    assert_steps(run.steps, RUNS["sft_resumed"]["steps"])
    assert (tmp_path / "out" / "full_sft_64.pth").is_file()


@pytest.mark.slow  # make test-slow: keeps make test under its budget
@pytest.mark.parametrize("workers", [0, 2])
def test_kill_anywhere_on_sft_data_with_augmentation(tmp_path: Path, workers: int) -> None:
    """SIGKILLed after random console lines and inside saves, resumed with --ckpt_path last: the same
    per-step losses and final weights as a run never interrupted. The augmentation is on (MiniMind's
    0.2 ratios), over 2 epochs: the draws of a resumed run are those of the uninterrupted one, also
    when worker processes build the samples."""
    need_shared()
    args = ["--data.data_path", str(SFT_JSONL), "--data.tokenizer_path", str(TOKENIZER),
            "--model.hidden_size", "64", "--model.num_hidden_layers", "2", "--data.max_seq_len", "128",
            "--data.batch_size", "4", "--model.learning_rate", "1e-4", "--trainer.accumulate_grad_batches", "2",
            "--trainer.max_epochs", "2", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--log_interval", "1", "--resume.save_interval", "5", "--from_weight", str(PRETRAINED), "--data.num_workers", str(workers), *QUIET]
    ref_dir, kill_dir = tmp_path / "ref", tmp_path / "killed"
    ref_dir.mkdir(), kill_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert len(ref.steps) == 24  # 2 epochs x 12 batches of 4 conversations

    runs = run_until_done(kill_dir, args, random.Random(f"kill-sft-{workers}"), kills=3, total_lines=24,
                          stem="full_sft_64")
    assert len(runs) >= 2, "no kill happened"
    assert any("--from_weight" in r.stdout and "not used: resuming from" in r.stdout for r in runs[1:]), \
        "a resumed run must take the checkpoint's weights, not --from_weight's"
    assert_steps_match(runs, ref)
    assert_same_files(ref_dir, kill_dir, ["out/full_sft_64.pth", "checkpoints/full_sft_64_resume.pth"])


def test_default_ratios_augment_samples_in_both_epochs() -> None:
    """The kill test above is only meaningful if the augmentation changes samples in each epoch."""
    need_shared()
    from lit_minimind.data.chat_template import load_chat_template
    from lit_minimind.data.sft import SFTDataset
    from lit_minimind.data.tokenizer import load_tokenizer

    tokenizer, template = load_tokenizer(TOKENIZER), load_chat_template(TOKENIZER)
    plain = SFTDataset(SFT_JSONL, tokenizer, 128, template, add_system_ratio=0, empty_think_ratio=0)
    augmented = SFTDataset(SFT_JSONL, tokenizer, 128, template)  # MiniMind's 0.2 and 0.2
    changed = {epoch: {i for i in range(len(plain)) if plain.prompt(i, epoch) != augmented.prompt(i, epoch)}
               for epoch in (0, 1)}
    assert changed[0] and changed[1] and changed[0] != changed[1], changed


@pytest.mark.parametrize(
    ("extra", "weight"),
    [
        (["--data.data_path", "SFT"], "full_sft"),  # detected from the file
        (["--data.kind", "sft"], "full_sft"),  # the embedded chat corpus
        (["--data.data_path", "SFT", "--resume.weight", "pretrain"], "pretrain"),  # said explicitly
        (["--data.data_path", "SFT", "--save_weight", "my_sft"], "my_sft"),  # MiniMind's flag
        (["--data.data_path", "TINY"], "pretrain"),  # pretraining data
    ],
)
def test_weight_name_defaults_to_full_sft_on_sft_data(extra: list[str], weight: str) -> None:
    need_shared()
    from lit_minimind.cli.fit import DEFAULT_CONFIG, MiniMindCLI, ResumeCallback
    from lit_minimind.cli.flags import translate
    from lit_minimind.data.datamodule import MiniMindDataModule
    from lit_minimind.model.module import LitMiniMind
    from tests.helpers.runs import TINY_JSONL

    extra = [{"SFT": str(SFT_JSONL), "TINY": str(TINY_JSONL)}.get(a, a) for a in extra]
    args = translate(["--data.tokenizer_path", str(TOKENIZER), "--trainer.logger", "false", *extra]).args
    cli = MiniMindCLI(LitMiniMind, MiniMindDataModule, run=False, args=args, seed_everything_default=42,
                      parser_kwargs={"default_config_files": [str(DEFAULT_CONFIG)], "exit_on_error": False},
                      auto_configure_optimizers=False, save_config_callback=None)
    resume = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ResumeCallback))
    assert resume.weight == weight
    assert cli.config["resume.weight"] == weight  # the run's saved config.yaml says so too


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_embedded_sft_then_chat(tmp_path: Path) -> None:
    """The README's pretrain -> SFT -> chat, shortened: no download, the embedded chat corpus and
    tokenizer (MiniMind's chat template), files named full_sft, then generate --chat on the export."""
    run = run_cli(tmp_path, ["--data.kind", "sft", "--data.max_seq_len", "64", "--trainer.max_steps", "2",
                             "--trainer.enable_progress_bar", "false", "--log_interval", "1"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SFT data: files named full_sft" in run.stdout and len(run.steps) == 2
    assert (tmp_path / "out" / "full_sft_128.pth").is_file() and not (tmp_path / "out" / "pretrain_128.pth").exists()
    chat = subprocess.run([sys.executable, "-m", "lit_minimind.generate", "out/full_sft_128.pth", "--chat", "What is a list?",
                           "--system", "Be brief.", "--temperature", "0", "--max_new_tokens", "8"],
                          cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.strip() and "<|im_start|>" not in chat.stdout  # an answer, special tokens left out
