"""Another run's files are never touched, and a run that cannot write stops before it starts (issue 32).

Real CLI runs in subprocesses on real files: the pre-flight check of every directory a run writes
(a read-only mount, a full tmpfs, a file where a directory should be, a bucket that does not exist),
a resume of a copy of a finished run's checkpoints (a new log version, the original's rows untouched)
against a killed run's resume (its directory continued, the rows trained again dropped), a
``_resume.pth`` whose checkpoint was deleted, and ``--resume.keep_last`` / ``--resume.keep_runs``
across runs."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import (
    MINIMIND,
    S3,
    TINY_JSONL,
    TOKENIZER,
    assert_resumed,
    cli_env,
    free_port,
    need_shared,
    readme_script,
    run_cli,
    tiny_args,
)

MIB = 1 << 20
STEM = "pretrain_64"


def mount_command(mounts: list[tuple[str, Path]], command: list[str]) -> list[str]:
    """``command`` in a private mount namespace with each ``(options, dir)`` a fresh tmpfs there (root only)."""
    script = "".join(f'mount -t tmpfs -o {opts} tmpfs "{d}" || exit 97; ' for opts, d in mounts) + 'exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", *command]


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def run_fit(cwd: Path, args: list[str], mounts: list[tuple[str, Path]] | None = None,
            command: list[str] | None = None) -> subprocess.CompletedProcess:
    command = command or [sys.executable, "-m", "lit_minimind.fit", *args]
    if mounts:
        command = mount_command(mounts, command)
    proc = subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=300)
    if proc.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr[:200]}")
    return proc


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def written(root: Path, keep: set[str]) -> list[str]:
    """Every path under ``root`` but the directories a test made itself (and what they held before)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.relative_to(root).parts[0] not in keep)


def csv_rows(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def by_micro_step(rows: list[dict[str, str]]) -> dict[int, tuple[str, str]]:
    steps = [int(r["micro_step"]) for r in rows if r.get("micro_step")]
    assert len(steps) == len(set(steps)), f"a micro_step twice: {steps}"
    return {int(r["micro_step"]): (r["loss"], r["learning_rate"]) for r in rows if r.get("micro_step")}


# ---------------------------------------------------------------------------------------------- pre-flight
@pytest.mark.parametrize("target", ["--resume.ckpt_dir", "--resume.out_dir", "logs"])
def test_a_read_only_directory_stops_the_run_before_anything_is_written(tmp_path: Path, target: str) -> None:
    """A read-only mount (root ignores permission bits) or a 0o555 directory: one ``error:`` line naming the
    directory and why, exit 2, no batch, nothing written anywhere (no checkpoints/, out/, lightning_logs/)."""
    need_shared()
    ro = tmp_path / "ro"
    ro.mkdir()
    flags = {"--resume.ckpt_dir": ["--resume.ckpt_dir", "ro/checkpoints"], "--resume.out_dir": ["--resume.out_dir", "ro/out"],
             "logs": ["--trainer.logger.init_args.save_dir", "ro"]}[target]
    mounts = None
    if can_mount():
        mounts = [("ro,size=1m", ro)]
    elif os.geteuid() == 0:
        pytest.skip("running as root without unshare(1): no read-only directory can be made")
    else:
        ro.chmod(0o555)
    try:
        proc = run_fit(tmp_path, tiny_args(*flags), mounts)
    finally:
        ro.chmod(0o755)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (error,) = error_lines(proc.stderr)
    named = {"--resume.ckpt_dir": "--resume.ckpt_dir ro/checkpoints", "--resume.out_dir": "--resume.out_dir ro/out",
             "logs": "the CSVLogger's log directory ro/lightning_logs"}[target]
    assert named in error, error
    assert ("read-only file system" if mounts else "permission denied") in error, error
    assert "Traceback" not in proc.stderr and "Epoch:[" not in proc.stdout
    assert written(tmp_path, {"ro"}) == [], "the failed check left files behind"
    assert list(ro.iterdir()) == []


@pytest.mark.slow  # make test's budget: in make test-slow
def test_a_full_filesystem_stops_the_run_naming_free_and_needed_space(tmp_path: Path) -> None:
    """checkpoints/ on a 4 MB tmpfs, one checkpoint being 7.5 MB: refused before the first batch, with
    what is free and what one save needs; the estimate is at least what a save really writes."""
    need_shared()
    if not can_mount():
        pytest.skip("needs root and unshare(1) for a small tmpfs")
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    proc = run_fit(tmp_path, tiny_args(), [("size=4m", ckpt)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    (error,) = error_lines(proc.stderr)
    match = re.search(r"--resume.ckpt_dir checkpoints: ([\d.]+) MB free on its file system, ~([\d.]+) MB needed", error)
    assert match, error
    free, needed = float(match[1]), float(match[2])
    assert free <= 4.0 < needed
    assert "Epoch:[" not in proc.stdout and written(tmp_path, {"checkpoints"}) == []

    normal = run_fit(tmp_path, tiny_args())  # the same run on a disk with room passes the check
    assert normal.returncode == 0 and not error_lines(normal.stderr), normal.stderr[-3000:]
    biggest = max(p.stat().st_size for p in ckpt.glob("*.ckpt"))
    assert biggest <= needed * MIB < 1.5 * biggest + 2 * MIB, (biggest, needed)


def test_a_file_where_a_directory_should_be_is_one_line(tmp_path: Path) -> None:
    need_shared()
    (tmp_path / "notes").write_text("mine\n")
    proc = run_fit(tmp_path, tiny_args("--resume.out_dir", "notes/out"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    (error,) = error_lines(proc.stderr)
    assert "--resume.out_dir notes/out: not a directory" in error and "notes is a file" in error, error
    assert written(tmp_path, {"notes"}) == [] and (tmp_path / "notes").read_text() == "mine\n"


def test_own_script_with_a_read_only_checkpoint_dir_stops_at_setup_leaving_nothing(tmp_path: Path) -> None:
    """The docs' own script (no CLI): ResumeCallback.setup checks; the version directory Lightning's logger
    made before setup is removed again."""
    need_shared()
    if not can_mount():
        pytest.skip("needs root and unshare(1) for a read-only mount")
    (tmp_path / "ro").mkdir()
    (tmp_path / "train.py").write_text(readme_script(("ResumeCallback(save_interval=5)",
                                                      "ResumeCallback(save_interval=5, ckpt_dir='ro/ck')")))
    proc = run_fit(tmp_path, [], [("ro,size=1m", tmp_path / "ro")],
                   command=[sys.executable, "train.py", str(TINY_JSONL), str(TOKENIZER)])
    assert proc.returncode != 0
    assert "CheckpointError: --resume.ckpt_dir ro/ck: not writable: read-only file system" in proc.stderr, proc.stderr[-3000:]
    assert "Epoch:[" not in proc.stdout
    assert written(tmp_path, {"ro", "train.py"}) == [], "lightning_logs/version_0 left behind"


def test_a_bucket_that_does_not_exist_stops_a_fresh_run(tmp_path: Path) -> None:
    need_shared()
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    s3 = S3(free_port(), "no-such-bucket")
    s3.start()
    try:
        run = run_cli(tmp_path, tiny_args("--resume.ckpt_dir", s3.url("run", "checkpoints")), env=s3.env())
    finally:
        s3.stop()
    assert run.returncode == 2, run.stderr[-3000:]
    (error,) = error_lines(run.stderr)
    assert "--resume.ckpt_dir s3://no-such-bucket/run/checkpoints: the bucket no-such-bucket does not exist" in error
    assert not run.steps and not (tmp_path / "checkpoints").exists() and not (tmp_path / "lightning_logs").exists()


# ---------------------------------------------------------------------------------------------- log lineage
@pytest.mark.slow
def test_a_copy_of_a_finished_runs_checkpoints_branches_and_never_rewrites_its_logs(tmp_path: Path) -> None:
    """A finished 2-epoch run; its checkpoints copied, the newest dropped from the copy; resumed from the copy.
    The original's metrics.csv keeps every byte; the resume logs to version_1, branched from version_0,
    with version_0's rows up to the checkpoint and then its own (an exact resume: the same values)."""
    need_shared()
    args = tiny_args(epochs=2)
    first = run_cli(tmp_path, args)
    assert first.returncode == 0, first.stderr[-3000:]
    original = tmp_path / "lightning_logs" / "version_0"
    before = (original / "metrics.csv").read_bytes()
    shutil.copytree(tmp_path / "checkpoints", tmp_path / "copy")
    newest = max((tmp_path / "copy").glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    newest.unlink()
    Path(f"{newest}.manifest.json").unlink()

    resumed = run_cli(tmp_path, args + ["--ckpt_path", "last", "--resume.ckpt_dir", "copy"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 2, 11)
    assert (original / "metrics.csv").read_bytes() == before, "the finished run's rows were rewritten"
    assert "logs: continuing" not in resumed.stderr
    (line,) = [line for line in resumed.stderr.splitlines() if "branched from" in line]
    assert line.startswith("logs: ./lightning_logs/version_1, branched from version_0 at micro_step 22"), line
    assert newest.name in line
    assert "\nlogs: ./lightning_logs/version_1\n" in resumed.stdout
    ours, theirs = by_micro_step(csv_rows(tmp_path / "lightning_logs" / "version_1")), by_micro_step(csv_rows(original))
    assert sorted(ours) == list(range(1, 25)) and ours == theirs


@pytest.mark.slow  # make test's budget: in make test-slow
def test_a_finished_run_extended_continues_its_log_directory(tmp_path: Path) -> None:
    """Resuming a finished run at its newest save (one more epoch) is the same lineage: version_0 continued."""
    need_shared()
    first = run_cli(tmp_path, tiny_args(epochs=1))
    assert first.returncode == 0, first.stderr[-3000:]
    more = run_cli(tmp_path, tiny_args(epochs=2) + ["--ckpt_path", "last"])
    assert more.returncode == 0, more.stderr[-3000:]
    assert "logs: continuing ./lightning_logs/version_0" in more.stderr and "branched" not in more.stderr
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]
    assert sorted(by_micro_step(csv_rows(tmp_path / "lightning_logs" / "version_0"))) == list(range(1, 25))


@pytest.mark.slow  # make test's budget: in make test-slow
def test_a_run_killed_inside_a_save_continues_and_drops_the_rows_trained_again(tmp_path: Path) -> None:
    """SIGKILL inside the second checkpoint's commit (its line is in saves.jsonl, its .ckpt never renamed):
    the rows beyond the first checkpoint are this lineage's, trained again: dropped, version_0 continued."""
    need_shared()
    args = tiny_args(epochs=1) + ["--ckpt_path", "last"]
    killed = run_cli(tmp_path, args, env=cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE="2:checkpoint"))
    assert killed.returncode == -9 and "@@stopped-in-save" in killed.stdout
    log_dir = tmp_path / "lightning_logs" / "version_0"
    beyond = [s for s in by_micro_step(csv_rows(log_dir)) if s > 6]
    assert beyond, "no row beyond the first checkpoint (step 6) to drop"
    resumed = run_cli(tmp_path, args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 7)
    assert re.search(r"logs: continuing \./lightning_logs/version_0 \(metrics.csv: \d+ rows up to micro_step 6; "
                     r"\d+ later rows dropped, trained again\)", resumed.stderr), resumed.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]
    assert [int(r["micro_step"]) for r in csv_rows(log_dir) if r.get("micro_step")] == list(range(1, 13))


@pytest.mark.slow  # make test's budget: in make test-slow
def test_a_finished_run_resumed_from_an_older_checkpoint_by_path_branches(tmp_path: Path) -> None:
    need_shared()
    first = run_cli(tmp_path, tiny_args(epochs=1))
    assert first.returncode == 0, first.stderr[-3000:]
    before = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_bytes()
    (older,) = (tmp_path / "checkpoints").glob(f"{STEM}_e0_s10_*.ckpt")
    again = run_cli(tmp_path, tiny_args(epochs=1) + ["--ckpt_path", str(older)])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "logs: ./lightning_logs/version_1, branched from version_0 at micro_step 10" in again.stderr
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_bytes() == before


# ---------------------------------------------------------------------------------------------- _resume.pth
@pytest.mark.slow  # make test-slow (budget)
def test_a_resume_link_whose_checkpoint_was_deleted_is_no_live_run(tmp_path: Path) -> None:
    """A finished run's .ckpt files deleted, its _resume.pth (a hard link) left: --ckpt_path last says so in
    one line and starts fresh (every batch trained), instead of resuming that finished run with nothing to train."""
    need_shared()
    first = run_cli(tmp_path, tiny_args(epochs=1))
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = list((tmp_path / "checkpoints").glob("*.ckpt"))
    newest = max(ckpts, key=lambda p: p.stat().st_mtime_ns).name
    for path in ckpts:
        path.unlink()
        Path(f"{path}.manifest.json").unlink()
    again = run_cli(tmp_path, tiny_args(epochs=1) + ["--ckpt_path", "last"])
    assert again.returncode == 0, again.stderr[-3000:]
    (line,) = [line for line in again.stderr.splitlines() if "skipping" in line]
    assert f"skipping checkpoints/{STEM}_resume.pth: a link to {newest}, which no longer exists" in line, line
    assert "starting fresh" in again.stderr and len(again.steps) == 12


def test_minimind_own_resume_file_still_loads_and_is_named(tmp_path: Path) -> None:
    need_shared()
    (tmp_path / "checkpoints").mkdir()
    shutil.copy(MINIMIND / "original_run" / f"checkpoints__{STEM}_resume.step5.pth",
                tmp_path / "checkpoints" / f"{STEM}_resume.pth")
    run = run_cli(tmp_path, tiny_args(epochs=1) + ["--ckpt_path", "last"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert (f"--ckpt_path last: checkpoints/{STEM}_resume.pth is original MiniMind's resume checkpoint "
            "(no manifest, MiniMind's keys only)") in run.stderr
    assert_resumed(run, 1, 6)


# ---------------------------------------------------------------------------------------------- retention
def run_ids(ckpt_dir: Path) -> dict[str, int]:
    ids: dict[str, int] = {}
    for path in ckpt_dir.glob(f"{STEM}_e*_s*_g*_*.ckpt"):
        run_id = path.name.rsplit("_", 1)[1].removesuffix(".ckpt")
        ids[run_id] = ids.get(run_id, 0) + 1
    return ids


@pytest.mark.slow  # make test's budget: in make test-slow
def test_keep_last_is_per_run_and_keep_runs_bounds_the_runs_never_the_resumed_one(tmp_path: Path) -> None:
    """Without --resume.keep_runs every run keeps its own keep_last checkpoints; with it, the first save of a
    run removes the runs beyond the newest N, the run being resumed never (here the oldest, resumed by path)."""
    need_shared()
    for _ in range(3):
        run = run_cli(tmp_path, tiny_args(epochs=1))
        assert run.returncode == 0, run.stderr[-3000:]
    ckpt_dir = tmp_path / "checkpoints"
    ids = run_ids(ckpt_dir)
    assert sorted(ids.values()) == [2, 2, 2], ids  # keep_last 2, each run's own
    oldest = min(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    oldest_id = oldest.name.rsplit("_", 1)[1].removesuffix(".ckpt")
    resumed = run_cli(tmp_path, tiny_args(epochs=2) + ["--ckpt_path", str(oldest), "--resume.keep_runs", "1"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    others = sorted(set(ids) - {oldest_id})
    assert f"--resume.keep_runs 1: removed 4 checkpoint(s) of 2 older run(s) ({', '.join(others)})" in resumed.stdout
    assert set(run_ids(ckpt_dir)) == {oldest_id}
    assert not [p for p in ckpt_dir.glob("*.manifest.json") if not Path(str(p).removesuffix(".manifest.json")).exists()]

    fresh = run_cli(tmp_path, tiny_args(epochs=1) + ["--resume.keep_runs", "2"])  # two runs: nothing to remove
    assert fresh.returncode == 0 and "keep_runs" not in fresh.stdout, fresh.stderr[-3000:]
    assert len(run_ids(ckpt_dir)) == 2


def test_keep_runs_zero_is_refused(tmp_path: Path) -> None:
    need_shared()
    run = run_cli(tmp_path, tiny_args("--resume.keep_runs", "0"))
    assert run.returncode == 2 and "keep_runs must be >= 1" in run.stderr, run.stderr[-3000:]


def test_last_means_this_runs_data_and_says_whose_the_other_files_are(tmp_path: Path) -> None:
    """Issue 51's walk: a run (TINY_JSONL), another run on other data in the same directory (its newer files take
    MiniMind's names: the export's replacement is said), then the first command with ``--ckpt_path last``: it
    resumes its own newest checkpoint, passing over the other run's, said in one line. A third run's data, with only
    the others' checkpoints there: a line naming whose the newest is and the two ways on, then the restore's refusal
    (exit 2)."""
    need_shared()
    other = tmp_path / "my.jsonl"
    other.write_text("".join(TINY_JSONL.read_text().splitlines(keepends=True)[:24]))
    ours = tiny_args(epochs=1, accumulate=1, save_interval=100)
    first = run_cli(tmp_path, ours)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli(tmp_path, [*ours, "--data.data_path", str(other)])
    assert second.returncode == 0, second.stderr[-3000:]
    assert any(line.startswith(f"out/{STEM}.pth: replacing the fp16 export of another run (")
               for line in second.stderr.splitlines()), second.stderr[-3000:]

    again = run_cli(tmp_path, [*tiny_args(epochs=2, accumulate=1, save_interval=100), "--ckpt_path", "last"])
    assert again.returncode == 0, again.stderr[-3000:]
    passed = [line for line in again.stderr.splitlines() if line.startswith("--ckpt_path last: passing over")]
    assert len(passed) == 1 and f"data {other.resolve()}, batch size 4, 2 layers, saved " in passed[0], passed
    assert_resumed(again, 2, 1)  # its own epoch-end checkpoint, not the other run's
    copy = tmp_path / "elsewhere" / TINY_JSONL.name  # the same data at another path (another machine's): the same run
    copy.parent.mkdir()
    shutil.copyfile(TINY_JSONL, copy)
    moved = run_cli(tmp_path, [*tiny_args(epochs=2, accumulate=1, save_interval=100), "--data.data_path", str(copy),
                               "--ckpt_path", "last"])
    assert moved.returncode == 0 and moved.steps == {}, moved.stderr[-3000:]  # finished: nothing left to train
    assert "another run" not in moved.stderr, moved.stderr[-3000:]

    third_data = tmp_path / "third.jsonl"
    third_data.write_text("".join(TINY_JSONL.read_text().splitlines(keepends=True)[:32]))
    third = run_cli(tmp_path, [*ours, "--data.data_path", str(third_data), "--ckpt_path", "last"])
    assert third.returncode == 2 and third.steps == {}, third.stderr[-3000:]
    said = [line for line in third.stderr.splitlines()
            if line.startswith(f"--ckpt_path last: the newest checkpoint for {STEM} in checkpoints/ is another run's (")]
    assert len(said) == 1, third.stderr[-3000:]  # whose it is (the first run's, resumed above) and the two ways on
    assert f"Either resume that run with its flags (--data.data_path {TINY_JSONL.resolve()} --data.batch_size 4" in said[0]
    assert "or start this one fresh: run without --ckpt_path" in said[0]
    assert "dataset length: checkpoint 48 samples, this run 32" in third.stderr  # then the restore refuses it
