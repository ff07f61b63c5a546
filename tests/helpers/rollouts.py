"""A callback that writes every GRPO step's rollout to a jsonl file (test-only): the sampled token ids, the
rewards and the step's full-precision statistics, to compare with MiniMind's own (tests/fixtures/grpo)."""

from __future__ import annotations

import json
from typing import Any

import lightning as L


class RolloutLog(L.Callback):
    """One line per trained step: ``epoch`` (0-based), ``step`` (1-based), ``completion_ids``, ``rewards``, and
    the module's ``last_stats`` as floats."""

    def __init__(self, path: str = "rollouts.jsonl") -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        row = {"epoch": trainer.current_epoch, "step": batch_idx + 1,
               "completion_ids": pl_module.rollout_log["completion_ids"].tolist(),
               "rewards": pl_module.rollout_log["rewards"].tolist(),
               **{k: float(v) for k, v in pl_module.last_stats.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def rollout_rows(run_dir: Any, key: str | None = None) -> dict[tuple[int, int], Any]:
    """A run directory's ``rollouts.jsonl`` by (epoch, step): each row (or its ``key``); a step trained twice (its
    run killed after it, before its checkpoint) must be rolled out alike both times."""
    from pathlib import Path

    rows: dict[tuple[int, int], Any] = {}
    for line in (Path(run_dir) / "rollouts.jsonl").read_text().splitlines():
        row = json.loads(line)
        value = row if key is None else row[key]
        assert rows.setdefault((row["epoch"], row["step"]), value) == value, f"step {row['epoch']}/{row['step']} differs"
    return rows


def assert_minimind_loads_rl_resume(ours_path: Any, theirs_path: Any) -> None:
    """What train_grpo.py's and train_agent.py's ``--from_resume 1`` do with the port's resume file of a finished
    run: MiniMind's keys (``theirs_path``: one of its own resume files) all present; model, AdamW and
    CosineAnnealingLR (MiniMind's T_max) loaded strictly, the scheduler at T_max with the LR MiniMind's would hold,
    and one more step giving MiniMind's next LR."""
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.schedules import annealed_lr

    ours = torch.load(ours_path, map_location="cpu", weights_only=False)
    theirs = torch.load(theirs_path, map_location="cpu", weights_only=False)
    assert set(theirs) <= set(ours), f"MiniMind's keys missing: {set(theirs) - set(ours)}"
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2))
    model.load_state_dict(ours["model"])
    peak, total = theirs["scheduler"]["base_lrs"][0], theirs["scheduler"]["T_max"]
    opt = torch.optim.AdamW(model.parameters(), lr=peak)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=peak / 10)
    opt.load_state_dict(ours["optimizer"])
    sched.load_state_dict(ours["scheduler"])
    assert set(ours["optimizer"]["state"]) == set(theirs["optimizer"]["state"])
    assert sched.last_epoch == total, (sched.last_epoch, total)  # the run finished: every scheduler step taken
    assert abs(opt.param_groups[0]["lr"] - annealed_lr(total, total, peak)) < 1e-12
    opt.step()
    sched.step()
    assert abs(opt.param_groups[0]["lr"] - annealed_lr(total + 1, total, peak)) < 1e-10


def assert_sigterm_mid_rollout_resumes_exactly(tmp_path: Any, args: list[str], files: list[str], *, line: int,
                                               iters: int) -> tuple[int, int]:
    """SIGTERM after console line ``line`` of a rollout stage (``args``): the step finishes, is saved, the run exits
    0; rerun with ``--ckpt_path last`` it starts at the next step (``iters`` per epoch) and ends with the uninterrupted
    run's steps and ``files``. Returns the last step the stopped run trained, (epoch, step)."""
    import signal

    from tests.helpers.runs import assert_resumed, assert_same_files, at_line, run_cli

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "stopped"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    stopped = run_cli(run_dir, args, on_line=at_line(line, lambda run: run.send(signal.SIGTERM)))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "SIGTERM received" in stopped.stdout
    last = max(stopped.steps)
    resumed = run_cli(run_dir, [*args, "--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, *((last[0], last[1] + 1) if last[1] < iters else (last[0] + 1, 1)))
    assert {**stopped.steps, **resumed.steps} == ref.steps
    assert_same_files(ref_dir, run_dir, files)
    return last
