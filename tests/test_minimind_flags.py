"""A MiniMind user's first hour: MiniMind's own command lines, MiniMind's meanings, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.runs import MINIMIND, TINY_JSONL, TOKENIZER, assert_resumed, cli_env, need_shared, run_cli, tiny_args

RUNS = json.loads((MINIMIND / "original_run" / "runs.json").read_text()) if MINIMIND.exists() else {}
WEIGHTS = MINIMIND / "original_run" / "out__pretrain_64.pth"


def minimind_argv(run: str) -> list[str]:
    """runs.json's argv of MiniMind's ``train_pretrain.py`` with the shared data and tokenizer."""
    argv = list(RUNS[run]["argv"][2:])  # without "python trainer/train_pretrain.py"
    argv[argv.index("--data_path") + 1] = str(TINY_JSONL)
    return argv + ["--tokenizer_path", str(TOKENIZER)]


def assert_steps(got: dict, expected: list[dict]) -> None:
    assert sorted(got) == [(s["epoch"] + 1, s["step"]) for s in expected]
    for s in expected:
        loss, _, aux_loss, lr = (float(x) for x in got[(s["epoch"] + 1, s["step"])])
        assert abs(loss - s["loss"]) <= 2e-4, (s["step"], loss, s["loss"])
        assert abs(aux_loss - s["aux_loss"]) <= 2e-4
        assert abs(lr - s["lr"]) <= 1e-8, (s["step"], lr, s["lr"])


def test_minimind_argv_reproduces_its_run_then_resume_with_nothing_left(tmp_path: Path) -> None:
    need_shared()
    # the progress bar on, as a user sees it in a terminal (piped, the CLI prints plain progress lines unless asked)
    run = run_cli(tmp_path, minimind_argv("dense_full") + ["--trainer.enable_progress_bar", "true"])
    assert run.returncode == 0, run.stderr[-3000:]
    mapping = next(line for line in run.stdout.splitlines() if line.startswith("MiniMind flags: "))
    for pair in ["--epochs 1 -> --trainer.max_epochs 1", "--dtype float32 -> --trainer.precision 32-true",
                 "--device cpu -> --trainer.accelerator cpu --trainer.devices 1", "--use_moe 0 -> --model.use_moe false",
                 "--accumulation_steps 2 -> --trainer.accumulate_grad_batches 2",
                 "--save_interval 5 -> --resume.save_interval 5"]:
        assert pair in mapping
    assert_steps(run.steps, RUNS["dense_full"]["steps"])
    assert "Epoch 1/1: 100%" in run.stdout and "v_num" not in run.stdout  # the console's numbering
    assert "== lit-minimind summary ==" in run.stdout

    # MiniMind's --from_resume 1 after the run ended: nothing left to train, a summary, and the
    # checkpoint wins over --from_weight
    again = run_cli(tmp_path, minimind_argv("dense_full") + ["--from_resume", "1", "--from_weight", str(WEIGHTS)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--from_resume 1 -> --ckpt_path last" in again.stdout
    assert f"--from_weight {WEIGHTS} not used: resuming from" in again.stdout
    assert_resumed(again, 2, 1)  # after the only epoch
    assert not again.steps and "== lit-minimind summary ==" in again.stdout and "loss: -" in again.stdout


def test_from_resume_picks_up_minimind_resume_file(tmp_path: Path) -> None:
    need_shared()
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(MINIMIND / "original_run" / "checkpoints__pretrain_64_resume.step5.pth",
                tmp_path / "checkpoints" / "pretrain_64_resume.pth")
    run = run_cli(tmp_path, minimind_argv("dense_resumed") + ["--trainer.enable_progress_bar", "false"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert_resumed(run, 1, 6)
    assert_steps(run.steps, RUNS["dense_resumed"]["steps"])


def test_from_weight_name_starts_from_minimind_weights(tmp_path: Path) -> None:
    need_shared()
    (tmp_path / "out").mkdir()
    shutil.copy(WEIGHTS, tmp_path / "out" / "pretrain_64.pth")  # MiniMind's {save_dir}/{NAME}_{hidden}.pth
    run = run_cli(tmp_path, minimind_argv("dense_full") + ["--from_weight", "pretrain", "--trainer.max_steps", "1",
                                                          "--trainer.enable_progress_bar", "false"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("--from_weight: loaded 25 tensors from out/pretrain_64.pth; missing keys: none; unexpected keys: none"
            in run.stdout)
    first = float(run.steps[(1, 1)][0])
    assert abs(first - RUNS["dense_full"]["steps"][0]["loss"]) > 1e-2  # not a fresh start
    assert sorted(run.steps) == [(1, 1), (1, 2)] and "== lit-minimind summary ==" in run.stdout  # max_steps 1


def test_run_shorter_than_log_interval_prints_summary(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args("--trainer.max_steps", "2", "--log_interval", "20"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert not run.steps and "Traceback" not in run.stderr
    assert f"loss: first {RUNS['dense_full']['steps'][0]['loss']:.4f} -> last " in run.stdout


# ------------------------------------------------------------------ user errors: one line, exit 2
BAD = {  # id: (flags, what the error line must contain)
    "batch_size": (["--data.batch_size", "0"], "--data.batch_size must be >= 1 (got 0)"),
    "minimind_batch_size": (["--batch_size", "-2"], "--data.batch_size (--batch_size) must be >= 1 (got -2)"),
    "max_seq_len": (["--data.max_seq_len", "2"], "--data.max_seq_len must be >= 3 (got 2)"),
    "save_interval": (["--resume.save_interval", "0"], "--resume.save_interval must be >= 1 (got 0)"),
    "log_interval": (["--log_interval", "0"], "--log_interval must be >= 1 (got 0)"),
    "keep_last": (["--resume.keep_last", "0"], "--resume.keep_last must be >= 1 (got 0)"),
    "learning_rate": (["--learning_rate", "0"], "--model.learning_rate (--learning_rate) must be > 0"),
    "accumulation": (["--trainer.accumulate_grad_batches", "0"], "--trainer.accumulate_grad_batches must be >= 1"),
    "hidden_size": (["--model.hidden_size", "0"], "--model.hidden_size must be >= 1 (got 0)"),
    "num_hidden_layers": (["--num_hidden_layers", "0"], "--model.num_hidden_layers (--num_hidden_layers) must be >= 1"),
    "ckpt_path_dir": (["--ckpt_path", "."], "--ckpt_path . is a directory"),
    "config_missing": (["--config", "no_such_preset.yaml"], "--config: file does not exist"),
    "precision": (["--trainer.precision", "fp8"], "--trainer.precision must be one of"),
    "dtype": (["--dtype", "fp8"], "--dtype must be one of bfloat16, float16, float32 (got 'fp8')"),
    "unknown_flag": (["--epoch", "2"], "unknown flag --epoch (did you mean --epochs?)"),
    "from_weight_missing": (["--from_weight", "no_such.pth"], "--from_weight: no_such.pth: no such weight file"),
    "from_weight_shapes": (["--from_weight", str(WEIGHTS), "--model.hidden_size", "128"],
                           f"{WEIGHTS}: shapes do not match this model (--from_weight)"),
}


# each path to an error as the real command; the other cases call main() in one interpreter (torch imported once)
AS_COMMAND = ["unknown_flag", "minimind_batch_size", "from_weight_missing"]
DRIVER = r"""
import contextlib, io, json, sys, traceback
from lit_minimind.cli.fit import main
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = 1
    results[name] = [code, out.getvalue(), err.getvalue()]
print("@@results", json.dumps(results))
"""


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str]]:
    """``case -> (exit code, stdout, stderr)`` of every bad command line."""
    need_shared()
    cwd = tmp_path_factory.mktemp("bad")

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=300)

    in_driver = {case: tiny_args(*BAD[case][0]) for case in BAD if case not in AS_COMMAND}
    commands = [["-c", DRIVER, json.dumps(in_driver)]] + [["-m", "lit_minimind.fit", *tiny_args(*BAD[c][0])] for c in AS_COMMAND]
    with ThreadPoolExecutor(max_workers=2) as pool:
        driver, *procs = pool.map(run, commands)
    assert "@@results" in driver.stdout, driver.stderr[-3000:]
    results = {case: tuple(r) for case, r in json.loads(driver.stdout.split("@@results", 1)[1]).items()}
    return {**results, **{case: (p.returncode, p.stdout, p.stderr) for case, p in zip(AS_COMMAND, procs)}}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_value_is_one_error_line_and_exit_2(bad_runs: dict, case: str) -> None:
    (code, stdout, stderr), expected = bad_runs[case], BAD[case][1]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2, stderr[-3000:]
    assert len(errors) == 1 and expected in errors[0], stderr[-3000:]
    assert "Traceback" not in stderr + stdout and "usage:" not in stderr
    assert "lit-minimind summary" not in stdout  # stopped before training


def test_minimind_flags_parse_as_minimind_parses_them(tmp_path: Path) -> None:
    """``--flag=value`` and ``--flag value``; a repeated flag: the later one wins (argparse's rule);
    ``--device cuda:N`` (that device only); ``--use_wandb`` with ``--wandb_project`` (parsing only)."""
    import yaml

    argv = ["--epochs", "1", "--epochs=3", "--batch_size=8", "--device", "cuda:1", "--use_wandb",
            "--wandb_project", "P", "--wandb_project=Q", "--print_config"]
    run = subprocess.run([sys.executable, "-m", "lit_minimind.fit", *argv], cwd=tmp_path, env=cli_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    config = yaml.safe_load(run.stdout[run.stdout.index("seed_everything"):])
    trainer = config["trainer"]
    assert trainer["max_epochs"] == 3 and config["data"]["batch_size"] == 8
    assert trainer["accelerator"] == "gpu" and trainer["devices"] in ([1], "[1]")
    logger = trainer["logger"]
    logger = logger[0] if isinstance(logger, list) else logger
    assert logger["class_path"].endswith("WandbLogger") and logger["init_args"]["project"] == "Q"
