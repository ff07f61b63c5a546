"""Logged history loses nothing: wandb (real offline run files) and the default CSV logger after
real SIGKILLs at seeded moments (between saves, inside a save, right after one), and after a resume
on another number of processes, compared with an uninterrupted run."""

from __future__ import annotations

import csv
import math
import random
import time
from collections import deque
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lit_minimind.callbacks.console import MiniMindConsole
from lit_minimind.callbacks.log_history import continue_metrics_csv
from tests.helpers.runs import assert_resumed, cli_env, expected_resume, need_shared, resumed_at, run_cli, tiny_args
from tests.helpers.wandb_files import run_summary

KEYS = ("loss", "logits_loss", "aux_loss", "learning_rate")
BOTH_LOGGERS = """\
trainer:
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args: {save_dir: .}
    - class_path: lightning.pytorch.loggers.WandbLogger
      init_args: {project: lit-minimind, save_dir: .}
"""


def csv_rows(run_dir: Path) -> list[dict[str, str]]:
    (log_dir,) = (run_dir / "lightning_logs").iterdir()  # one log directory for the whole run
    with open(log_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def csv_by_step(rows: list[dict[str, str]]) -> dict[int, tuple[str, ...]]:
    """micro_step -> the logged values (full precision, as written); each step exactly once."""
    steps = [int(row["micro_step"]) for row in rows if row.get("micro_step")]
    assert len(steps) == len(set(steps)), f"metrics.csv repeats micro_steps: {sorted(steps)}"
    return {int(row["micro_step"]): tuple(row[k] for k in KEYS) for row in rows if row.get("micro_step")}


def wandb_by_step(run_dir: Path) -> tuple[set[str], dict[int, dict]]:
    """The run ids, and micro_step -> values over the history of every process; no step with two values."""
    runs = [run_summary(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]
    by_step: dict[int, dict] = {}
    for run in runs:
        for row in run["history"]:
            if "micro_step" in row and "loss" in row:
                values = {k: row[k] for k in KEYS}
                step = int(row["micro_step"])
                assert by_step.setdefault(step, values) == values, f"micro_step {step} logged with two values"
    # the id from the run directory's name: also a process killed before wandb wrote its run record has one
    return {r["id"] for r in runs}, by_step


def assert_derived_metrics(rows: list[dict[str, str]], run, iters: int = 12) -> None:
    """``perplexity`` is exp(logits_loss); ``tokens_per_s`` counts the batch's tokens (4 x 63) over the time
    since the previous batch (0 for a process's first); ``epoch_time`` is the console's estimate of the
    minutes left in the epoch (``iters`` batches), MiniMind's: whole minutes, none after its last batch."""
    rows = [r for r in rows if r.get("micro_step")]
    batch_tokens = 4 * 63
    for row in rows:
        assert math.isclose(float(row["perplexity"]), math.exp(float(row["logits_loss"])), rel_tol=1e-6), row
        minutes = float(row["epoch_time"])
        assert minutes.is_integer() and minutes < 10, row  # MiniMind floors to minutes; a 64x2 model's epoch: seconds
        if int(row["micro_step"]) % iters == 0:  # the epoch's last batch: nothing left of it
            assert minutes == 0, row
    speeds = [float(r["tokens_per_s"]) for r in rows]
    assert speeds[0] == 0 and all(batch_tokens / 600 < v < batch_tokens * 1e4 for v in speeds[1:]), speeds
    printed = [float(m[8]) for m in run.lines]
    assert printed == [round(float(r["epoch_time"]), 1) for r in rows], "the console's epoch_time is the logged one"


def wandb_means(run_dir: Path) -> dict[float, float]:
    """epoch -> mean_loss, over the histories of every process of a run."""
    runs = [run_summary(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]
    return {row["epoch"]: row["mean_loss"] for run in runs for row in run["history"] if "mean_loss" in row}


@pytest.mark.slow  # six runs with wandb: under a minute (make test-slow)
def test_seeded_sigkills_lose_no_logged_row_wandb_and_csv(tmp_path: Path) -> None:
    need_shared()
    (tmp_path / "loggers.yaml").write_text(BOTH_LOGGERS)
    args = tiny_args(epochs=3, accumulate=2, save_interval=4) + ["--config", str(tmp_path / "loggers.yaml"),
                                                                 "--ckpt_path", "last"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_csv = csv_by_step(csv_rows(ref_dir))
    _, ref_wandb = wandb_by_step(ref_dir)
    assert sorted(ref_csv) == sorted(ref_wandb) == list(range(1, 37))  # 3 epochs x 12 micro-batches
    assert_derived_metrics(csv_rows(ref_dir), ref)

    # five kills at seeded moments: SIGKILL (whole process group, wandb's service too) after the k-th
    # console line of a process, inside the first checkpoint commit, right after it
    rng = random.Random(20240611)
    plan = [("lines", rng.randint(3, 8)), ("in_save", "1:checkpoint"), ("lines", rng.randint(3, 8)),
            ("after_save", "1:checkpoint"), ("lines", rng.randint(3, 8))]
    rng.shuffle(plan)
    for kind, at in plan:
        want = expected_resume(run_dir)
        if kind == "lines":
            killed = run_cli(run_dir, args, kill_after_lines=at)
        else:
            env = cli_env(**{f"LIT_MINIMIND_TEST_STOP_{kind.upper()}": at})
            killed = run_cli(run_dir, args, env=env)
            assert f"@@stopped-{kind.replace('_', '-')}" in killed.stdout, (kind, killed.stdout[-2000:])
        assert killed.returncode == -9, (kind, at, killed.returncode, killed.stderr[-2000:])
        if want is not None and resumed_at(killed) is not None:  # (a kill may come before the resume line)
            assert_resumed(killed, *want)
    want = expected_resume(run_dir)
    assert want is not None, "no process saved a checkpoint"
    final = run_cli(run_dir, args)
    assert final.returncode == 0, final.stderr[-3000:]
    assert_resumed(final, *want)
    assert "wandb: continuing run" in final.stderr and "logs: continuing" in final.stderr

    run_ids, history = wandb_by_step(run_dir)
    assert len(run_ids) == 1, f"one wandb run id throughout, got {run_ids}"
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == len(plan) + 1
    assert {s: history[s] for s in sorted(history)} == ref_wandb, "the union of the histories is the uninterrupted run's"

    rows = csv_rows(run_dir)  # the same log directory continued by every process
    assert csv_by_step(rows) == ref_csv
    assert [int(r["micro_step"]) for r in rows if r.get("micro_step")] == list(range(1, 37)), "in order"
    per_epoch = [r["epoch"] for r in rows if r.get("mean_loss")]
    assert len(per_epoch) == len(set(per_epoch)), "one mean_loss row per epoch at most"
    # the epoch means (a checkpointed torchmetrics state) equal the uninterrupted run's, in both loggers
    ref_means = {r["epoch"]: r["mean_loss"] for r in csv_rows(ref_dir) if r.get("mean_loss")}
    assert len(ref_means) == 3 and {r["epoch"]: r["mean_loss"] for r in rows if r.get("mean_loss")} == ref_means
    assert wandb_means(run_dir) == wandb_means(ref_dir) and len(wandb_means(ref_dir)) == 3
    assert "\nlogs: ./lightning_logs/version_0\n" in final.stdout


@pytest.mark.slow  # make test-slow (budget)
def test_micro_step_continues_across_a_world_size_change(tmp_path: Path) -> None:
    """Two processes (DDP), SIGKILLed inside the epoch-end save; resumed on one: the step axis
    (``micro_step``, micro-batches trained so far) goes on from the checkpoint's, without a gap."""
    need_shared()
    two = tiny_args(epochs=2, accumulate=2, save_interval=4, devices=2) + ["--ckpt_path", "last"]
    one = tiny_args(epochs=2, accumulate=2, save_interval=4, devices=1) + ["--ckpt_path", "last"]
    half = run_cli(tmp_path, two, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="2:checkpoint"))  # step 4's save is complete
    assert half.returncode == -9 and "@@stopped-in-save" in half.stdout
    single = run_cli(tmp_path, one)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "world size changed (2→1): step 4 → 8" in single.stderr
    assert_resumed(single, 1, 9)
    rows = csv_rows(tmp_path)
    steps = [int(r["micro_step"]) for r in rows if r.get("micro_step")]
    # 4 micro-batches per rank on two processes, then 4 + 12 on one
    assert steps == list(range(1, 21)), steps
    epochs = [float(r["epoch"]) for r in rows if r.get("micro_step")]
    assert epochs == [0.0] * 8 + [1.0] * 12


def test_metrics_csv_is_cut_back_to_the_checkpoint_and_survives_a_kill_while_continuing(tmp_path: Path) -> None:
    log_dir = tmp_path / "lightning_logs" / "version_3"
    log_dir.mkdir(parents=True)
    header = "epoch,loss,mean_loss,micro_step,step\r\n"
    rows = ["0.0,2.5,,1,0\r\n", "0.0,2.4,,2,1\r\n", "0,,2.45,,1\r\n", "1.0,2.3,,3,1\r\n", "1.0,2.2,,4,2\r\n",
            "1.0,2.1,,5,2\r\n"]
    # a kill left only the file moved aside, its last line torn
    (log_dir / "metrics.csv.resume").write_text(header + "".join(rows) + "1.0,2.0,,6", newline="")
    logger = CSVLogger(tmp_path, version=3)
    kept, dropped = continue_metrics_csv(logger, micro_step=4, epochs_complete=1, global_step=2)
    assert (kept, dropped) == (5, 1)
    assert not (log_dir / "metrics.csv.resume").exists()
    assert (log_dir / "metrics.csv").read_bytes().decode() == header + "".join(rows[:5])
    logger.log_metrics({"loss": 2.15, "micro_step": 5, "epoch": 1.0}, step=2)
    logger.save()  # Lightning's writer appends under the same header
    with open(log_dir / "metrics.csv", newline="") as f:
        assert [r["micro_step"] for r in csv.DictReader(f)] == ["1", "2", "", "3", "4", "5"]


def test_checkpoint_carries_the_rows_since_the_save_before_the_previous_one_and_recent_ones(tmp_path: Path) -> None:
    def carried(state: dict) -> list[int]:
        return [row["metrics"]["micro_step"] for row in state["history"]]

    def log(console: MiniMindConsole, steps: range, at: float) -> None:
        console.history.rows.extend((at, s // 2, {"micro_step": s, "loss": 1.0 / s}) for s in steps)
        console.micro_step = steps[-1]

    def checkpoint(console: MiniMindConsole) -> dict:
        """Lightning's dump: the callback's state_dict (it changes nothing), then its checkpoint taken."""
        state, rows = console.state_dict(), list(console.history.rows)
        assert console.state_dict() == state and list(console.history.rows) == rows, "state_dict changed the state"
        console.history.saved(console.micro_step)
        return state

    console = MiniMindConsole()
    hour_ago = time.monotonic() - 3600  # durable in any logger by now
    for steps in (range(1, 5), range(5, 9), range(9, 13)):  # saves at micro_step 4, 8, 12
        log(console, steps, hour_ago)
        state = checkpoint(console)
    assert carried(state) == list(range(5, 13))

    # a real CSVLogger on a real Trainer (the one fit starts with) receives the carried rows
    restored, logger = MiniMindConsole(), CSVLogger(tmp_path, name="logs", version=0)
    trainer = L.Trainer(logger=logger, accelerator="cpu", devices=1, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    restored.load_state_dict(state)
    assert restored.micro_step == 12 and restored.history._saves == [4, 8, 12]
    restored.history.replay(trainer)  # at fit start
    logger.save()
    with open(tmp_path / "logs" / "version_0" / "metrics.csv", newline="") as f:
        rows = [(int(r["step"]), int(r["micro_step"])) for r in csv.DictReader(f)]
    assert rows == [(s // 2, s) for s in range(5, 13)]
    log(restored, range(13, 17), time.monotonic())
    assert carried(checkpoint(restored)) == list(range(5, 17))  # logged again just now: carried again
    # two minutes later (the rows aged, not the clock moved: longer ago than history_seconds()'s minute)
    restored.history.rows = deque(((when - 120, step, m) for when, step, m in restored.history.rows),
                                  maxlen=restored.history.rows.maxlen)
    log(restored, range(17, 21), time.monotonic() - 120)
    assert carried(checkpoint(restored)) == list(range(13, 21))  # since the save of 12


def test_a_run_ended_by_max_steps_keeps_its_epoch_row_when_run_again(tmp_path: Path) -> None:
    """``--trainer.max_steps`` ends the run inside its epoch, whose ``mean_loss`` row is logged after the last save; the
    same command again (a stopped pipeline stage rerun, a user's second try) has nothing to train and keeps that row
    (it was dropped as an unfinished epoch's, and nothing logged it again)."""
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=100) + ["--trainer.max_steps", "3", "--ckpt_path", "last"]
    first = run_cli(tmp_path, args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = [r for r in csv_rows(tmp_path) if r.get("mean_loss")]
    assert len(before) == 1 and before[0]["epoch"] == "0"
    again = run_cli(tmp_path, args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r for r in csv_rows(tmp_path) if r.get("mean_loss")] == before
