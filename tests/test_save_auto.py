"""``--resume.save_every_minutes auto``: the Young/Daly save interval (lit_minimind/callbacks/schedule.py):
its rule in numbers, where its MTBF comes from, the line it prints, and real runs (saves at the
interval, a kill and resume still exact)."""

from __future__ import annotations

import json
import logging
import math
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_minimind.callbacks.schedule import DEFAULT_MTBF, SaveSchedule, run_mtbf, young_daly_interval
from tests.helpers.runs import assert_same_tensors, assert_steps_match, final_state, need_shared, run_cli, run_resuming, tiny_args

LINE = re.compile(r"save interval: every ([\d.e+-]+) s \(Young/Daly: save ([\d.e+-]+) s, MTBF ([\d.e+-]+) s (.*)\)")


def test_young_daly_interval_numbers() -> None:
    assert young_daly_interval(0.11, 600) == pytest.approx(math.sqrt(2 * 0.11 * 600))  # 11.5 s, above 20 x 0.11
    assert young_daly_interval(10, 3600) == pytest.approx(268.33, abs=0.01)  # sqrt(72000) > 200 (the floor)
    assert young_daly_interval(0.02, 1) == pytest.approx(0.4)  # sqrt(0.04) = 0.2 < 20 x 0.02: the 5 % floor
    assert young_daly_interval(5, 10) == pytest.approx(100)  # sqrt(100) = 10 s would spend half the loop saving
    assert young_daly_interval(0, 3600) == 0
    for s, m in ((0.02, 1), (0.11, 600), (10, 3600), (30, 50)):  # the loop never spends more than 5 % saving
        assert s / young_daly_interval(s, m) <= 0.05 + 1e-12
    with pytest.raises(ValueError):
        young_daly_interval(1, 0)
    with pytest.raises(ValueError):
        young_daly_interval(-1, 10)


def test_run_mtbf_is_seconds_per_interruption() -> None:
    assert run_mtbf(600, 3) == 200
    assert run_mtbf(600, 0) is None  # no interruption yet: the default (or --resume.mtbf)
    assert run_mtbf(0, 2) is None


def test_schedule_validation() -> None:
    with pytest.raises(ValueError, match=r"--resume.mtbf must be > 0"):
        SaveSchedule(10, "auto", 0)
    with pytest.raises(ValueError, match=r"--resume.mtbf must be > 0"):
        SaveSchedule(10, "auto", -5)
    with pytest.raises(ValueError, match=r"give both"):
        SaveSchedule(10, 5.0, 60)
    with pytest.raises(ValueError, match=r"'auto'"):
        SaveSchedule(10, "often")
    assert SaveSchedule(10, 2.0).interval() == 120  # a fixed cadence is unchanged


def fake_trainer() -> SimpleNamespace:
    return SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(broadcast=lambda value, src: value))


def test_auto_interval_sources_and_line(caplog: pytest.LogCaptureFixture) -> None:
    trainer = fake_trainer()
    born = time.monotonic()
    schedule = SaveSchedule(1000, "auto")
    assert schedule.interval() is None and schedule.by_time(trainer)  # no save cost measured: the first boundary saves
    schedule.saved(0.02)
    with caplog.at_level(logging.INFO):
        assert not schedule.by_time(trainer)
        schedule.by_time(trainer)  # unchanged: no second line
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("save interval")]
    assert lines == [f"save interval: every {young_daly_interval(0.02, DEFAULT_MTBF):.0f} s (Young/Daly: save 0.02 s, "
                     "MTBF 3600 s by default: no interruption in this run's history and no --resume.mtbf)"]
    caplog.clear()
    schedule.saved(0.05)
    schedule.saved(0.06)  # median of (0.02, 0.05, 0.06): 0.05, the interval moves by sqrt(2.5): a new line
    with caplog.at_level(logging.INFO):
        schedule.by_time(trainer)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("save interval")]
    assert len(lines) == 1 and "save 0.05 s" in lines[0] and lines[0].endswith("MTBF 3600 s by default)"), lines

    # a resumed run: its own history (checkpointed in the callback's state) gives the MTBF
    state = schedule.state_dict()
    assert state["starts"] == 1 and state["save_seconds"] == [0.02, 0.05, 0.06]
    assert 0 < state["exposure_seconds"] <= time.monotonic() - born  # this start's time so far, no more
    loaded = time.monotonic()
    resumed = SaveSchedule(1000, "auto")
    resumed.load_state_dict({**state, "exposure_seconds": 600.0, "starts": 3})
    mtbf, source = resumed.mtbf_now()
    assert mtbf == pytest.approx(200, abs=1) and source == "over this run's 3 interruptions"
    assert resumed.interval() == pytest.approx(young_daly_interval(0.05, mtbf))
    again = resumed.state_dict()
    assert again["starts"] == 4
    assert 600 < again["exposure_seconds"] <= 600 + time.monotonic() - loaded  # the earlier starts' plus this one's
    given = SaveSchedule(1000, "auto", mtbf=1)
    given.load_state_dict(state)
    assert given.mtbf_now() == (1, "by --resume.mtbf") and given.interval() == pytest.approx(1.0)  # 20 x 0.05
    SaveSchedule(1000, "auto").load_state_dict(None)  # a checkpoint without the history: none


def saved_at(ckpt_dir: Path) -> list[tuple[int, str]]:
    """(commit time in ns, checkpoint name) of every checkpoint, oldest first."""
    found = [(json.loads(m.read_text())["saved_at"], m.name.removesuffix(".manifest.json"))
             for m in ckpt_dir.glob("*.ckpt.manifest.json")]
    return sorted(found)


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_auto_interval_saves_at_young_daly_intervals(tmp_path: Path) -> None:
    need_shared()
    args = tiny_args(epochs=2, save_interval=1000) + ["--resume.save_every_minutes", "auto", "--resume.mtbf", "1",
                                                      "--resume.keep_last", "100"]
    run = run_cli(tmp_path, args)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = LINE.findall(run.stderr)
    assert lines, run.stderr[-3000:]
    for tau, cost, mtbf, source in lines:  # each line's interval is the rule of its numbers (printed rounded)
        assert float(mtbf) == 1 and source.startswith("by --resume.mtbf")
        assert float(tau) == pytest.approx(young_daly_interval(float(cost), 1.0), rel=0.1)
    saves = saved_at(tmp_path / "checkpoints")
    by_time = [(at, name) for at, name in saves if "_s12_" not in name]  # the epochs' ends save by save_interval's rule
    assert by_time[0][1].startswith("pretrain_64_e0_s2_"), saves  # the first boundary saves: it measures the cost
    assert len(by_time) >= 3, saves
    # a time-based save is due once tau passed since the previous save (of any kind) was snapshotted; the
    # commit times of the manifests lag their snapshots by a background write
    shortest = min(float(tau) for tau, *_ in lines)
    gaps = [(b - a) / 1e9 for (a, _), (b, name) in zip(saves, saves[1:]) if "_s12_" not in name]
    assert gaps and all(gap >= shortest - 0.15 for gap in gaps), (gaps, shortest)
    assert len(saves) < 12, "every optimizer step saved: the interval was not applied"


def test_auto_interval_mtbf_zero_is_one_error_line(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args() + ["--resume.save_every_minutes", "auto", "--resume.mtbf", "0"])
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: --resume.mtbf must be > 0"), run.stderr


@pytest.mark.slow  # make test's budget: in make test-slow
def test_auto_interval_kill_and_resume_is_exact(tmp_path: Path) -> None:
    """No --resume.mtbf: the first process uses the default (a 12 s interval here: no time-based save but the
    first), is SIGKILLed in epoch 2; the resumed one takes its MTBF from the run's own history (1 interruption)
    and ends as the uninterrupted run does."""
    need_shared()
    args = tiny_args(epochs=2) + ["--resume.save_every_minutes", "auto", "--resume.keep_last", "100"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    first = run_cli(run_dir, args, kill_after_lines=17)
    assert first.returncode == -9, first.stderr[-3000:]
    assert "by default: no interruption in this run's history" in first.stderr, first.stderr[-3000:]
    done = run_resuming(run_dir, args, "pretrain_64")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "over this run's 1 interruption" in done.stderr, done.stderr[-3000:]
    assert_steps_match([first, done], ref)
    ref_weights, ref_resume = final_state(ref_dir, False)
    weights, resume = final_state(run_dir, False)
    assert_same_tensors(weights, ref_weights)
    assert_same_tensors(resume["state_dict"], ref_resume["state_dict"])
    assert resume["callbacks"]["ResumeCallback"]["schedule"]["starts"] == 2
