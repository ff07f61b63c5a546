"""Fault injection: kills at random moments (inside saves too), bad files, full disks, hostile pickles, guards."""

from __future__ import annotations

import os
import pickle
import random
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.faults import SAVE_FILES
from tests.helpers.runs import ROOT, assert_resumed, cli_env, expected_resume, need_shared, run_cli, tiny_args


def seeded_trials() -> list[tuple[str, int | str]]:
    """Ten kills, alternating: at a random console line, inside a random file commit of one of the first seven
    saves (``N:KIND``, tests/helpers/faults.py; seed 1234)."""
    rng = random.Random(1234)
    return [(("save", f"{rng.randint(1, 7)}:{rng.choice(SAVE_FILES)}") if trial % 2 else ("line", rng.randint(1, 23)))
            for trial in range(10)]


def run_kill_trials(tmp_path: Path, trials: list[tuple[str, int | str]]) -> None:
    """Each trial: killed once as ``trials`` says, resumed with ``--ckpt_path last``; ends bit-identical."""
    need_shared()
    args = tiny_args(epochs=2, accumulate=2, save_interval=3)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0
    ref_out = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    in_save = resumed = 0
    for trial, (kind, where) in enumerate(trials):
        run_dir = tmp_path / f"t{trial}"
        run_dir.mkdir()
        if kind == "save":
            env = cli_env(LIT_MINIMIND_TEST_STOP_IN_SAVE=str(where))
            killed = run_cli(run_dir, args + ["--ckpt_path", "last"], env=env)
            in_save += "@@stopped-in-save" in killed.stdout
        else:
            killed = run_cli(run_dir, args + ["--ckpt_path", "last"], kill_after_lines=where)
        assert killed.returncode == -9
        assert not list(run_dir.glob("checkpoints/*.tmp")) or "@@stopped-in-save" in killed.stdout
        want = expected_resume(run_dir)  # what `last` names now
        done = run_cli(run_dir, args + ["--ckpt_path", "last"])
        assert done.returncode == 0, done.stderr[-3000:]
        if want is not None:
            assert_resumed(done, *want)
        else:  # killed before its first save: a fresh start, every step
            assert "resuming" not in done.stderr and min(done.steps) == (1, 1)
        resumed += want is not None
        for key, values in {**killed.steps, **done.steps}.items():
            assert values == ref.steps[key], (trial, key)
        out = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
        assert all(torch.equal(out[k], ref_out[k]) for k in ref_out), f"trial {trial} differs"
    assert in_save == sum(kind == "save" for kind, _ in trials)
    assert resumed, "no trial resumed: nothing was tested"


@pytest.mark.slow  # half a minute (make test-slow; keeps make test under its budget)
def test_seeded_kill_trials_each_end_bit_identical(tmp_path: Path) -> None:
    """The first 2 of the 10 seeded trials (one at a console line, one inside a file write)."""
    run_kill_trials(tmp_path, seeded_trials()[:2])


@pytest.mark.matrix
def test_seeded_kill_trials_each_end_bit_identical_rest(tmp_path: Path) -> None:
    """The other 8 of the 10 seeded trials (make test-matrix: more of the same kinds of kill)."""
    run_kill_trials(tmp_path, seeded_trials()[2:])


def _partial_run(tmp_path: Path, *extra: str) -> tuple[Path, list[str]]:
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=3) + list(extra)
    # saves fall due at 3, 6, 9 and are taken at their optimizer step (4, 6, 10); killed right after the
    # 9th file commit: the step-10 save's export (saves at 4, 6, 10 complete)
    killed = run_cli(tmp_path, args, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="3:export"))
    assert killed.returncode == -9 and "@@stopped-after-save" in killed.stdout and "pretrain_64.pth" in killed.stdout
    return tmp_path / "checkpoints", args


def test_last_falls_back_past_corrupted_and_truncated_checkpoints(tmp_path: Path) -> None:
    ckpt_dir, args = _partial_run(tmp_path, "--resume.keep_last", "3")
    by_step = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: int(p.name.split("_s")[1].split("_")[0]))
    newest, second = by_step[-1], by_step[-2]  # steps 10 and 6
    resume_pth = ckpt_dir / "pretrain_64_resume.pth"  # a hard link to the newest: the same bytes on disk
    assert os.path.samefile(resume_pth, newest)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))  # corrupted in place: both names see it
    second.write_bytes(second.read_bytes()[:1000])  # truncated
    run = run_cli(tmp_path, args + ["--ckpt_path", "last"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"skipping checkpoint checkpoints/{newest.name}: checksum (crc32) differs" in run.stderr
    assert f"skipping checkpoint checkpoints/{resume_pth.name}: checksum (crc32) differs" in run.stderr
    assert f"skipping checkpoint checkpoints/{second.name}: size" in run.stderr
    assert_resumed(run, 1, 5)


@pytest.mark.parametrize("kind", ["empty", "truncated", "foreign", "weights_only_export"])
def test_explicit_bad_checkpoint_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    need_shared()
    bad = tmp_path / f"{kind}.pth"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "truncated":
        good = ROOT.parent / "shared" / "minimind" / "original_run" / "checkpoints__pretrain_64_resume.step5.pth"
        bad.write_bytes(good.read_bytes()[:4096])
    elif kind == "foreign":
        torch.save({"hello": "world"}, bad)
    else:
        shutil.copy(ROOT.parent / "shared" / "minimind" / "original_run" / "out__pretrain_64.pth", bad)
    run = run_cli(tmp_path, tiny_args() + ["--ckpt_path", str(bad)])
    assert run.returncode == 2
    assert str(bad) in run.stderr
    expected = {"empty": "is empty", "truncated": "truncated or corrupted", "foreign": "not a lit-minimind",
                "weights_only_export": "model weights only"}[kind]
    assert expected in run.stderr
    assert not run.lines


class _Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    need_shared()
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil_resume.pth"
    torch.save({"model": {}, "optimizer": {}, "epoch": 0, "step": 1, "payload": _Hostile(str(marker))}, evil,
               pickle_protocol=pickle.DEFAULT_PROTOCOL)
    run = run_cli(tmp_path, tiny_args() + ["--ckpt_path", str(evil)])
    assert run.returncode == 2
    assert "refused to load" in run.stderr and str(evil) in run.stderr
    assert not marker.exists()
    inspect = subprocess.run([sys.executable, "-m", "lit_minimind.inspect", str(evil)], cwd=tmp_path, env=cli_env(),
                             capture_output=True, text=True, timeout=120)
    assert inspect.returncode != 0 and "refused to load" in inspect.stdout + inspect.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_resume_with_other_model_shape_or_data_fails_naming_fields(tmp_path: Path) -> None:
    ckpt_dir, args = _partial_run(tmp_path)
    run = run_cli(tmp_path, args + ["--ckpt_path", str(next(ckpt_dir.glob("*.ckpt"))), "--model.num_hidden_layers", "3",
                                    "--model.num_key_value_heads", "2"])
    assert run.returncode == 2
    assert "num_hidden_layers: checkpoint 2, this run 3" in run.stderr
    assert "num_key_value_heads: checkpoint 4, this run 2" in run.stderr
    assert not run.lines
    shorter = tmp_path / "short.jsonl"
    shorter.write_text("".join((ROOT.parent / "shared/minimind/original_run/tiny.jsonl").read_text().splitlines(True)[:40]))
    run = run_cli(tmp_path, args + ["--ckpt_path", "last", "--data.data_path", str(shorter)])
    assert run.returncode == 2 and "dataset length: checkpoint 48 samples, this run 40" in run.stderr


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (3_000_000, 3_000_000))


@pytest.mark.parametrize("async_save", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: make test's budget
def test_full_disk_stops_with_clear_error_and_keeps_previous_checkpoint(tmp_path: Path, async_save: bool) -> None:
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=3) + [f"--resume.async_save={str(async_save).lower()}"]
    proc = subprocess.run([sys.executable, "-m", "lit_minimind.fit", *args], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300, preexec_fn=_limit_file_size)
    # every checkpoint (> 3 MB) fails: the first save stops the run, non-zero, saying why
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "could not save the checkpoint at epoch 1 step 4" in proc.stderr  # due at 3, taken at its optimizer step
    assert "File too large" in proc.stderr or "No space" in proc.stderr
    # did not train on: a synchronous save stops at once; a background one at the next batch after it failed
    assert "Epoch:[1/1](5/12)" not in proc.stdout if not async_save else "Epoch:[1/1](12/12)" not in proc.stdout
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_read_only_checkpoint_dir_after_a_good_save_keeps_it(tmp_path: Path) -> None:
    ckpt_dir, args = _partial_run(tmp_path)
    before = {p.name: p.read_bytes() for p in ckpt_dir.iterdir()}
    command = [sys.executable, "-m", "lit_minimind.fit", *args, "--ckpt_path", "last"]
    if os.geteuid() == 0:  # root ignores permissions: a read-only bind mount in a private mount namespace
        if shutil.which("unshare") is None:
            pytest.skip("running as root without unshare(1): cannot make a read-only directory")
        script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
        command = ["unshare", "-m", "sh", "-c", script, str(ckpt_dir), *command]
    else:
        ckpt_dir.chmod(0o555)
    try:
        proc = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    finally:
        ckpt_dir.chmod(0o755)
    if "unshare failed" in proc.stderr or "mount:" in proc.stderr:
        pytest.skip(f"no privilege for a read-only bind mount: {proc.stderr[:200]}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    # the pre-flight check (callbacks/preflight.py) finds it before the first batch, not the step-12 save
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "--resume.ckpt_dir checkpoints: not writable" in error, error
    assert "read-only file system" in error or "permission denied" in error, error
    assert "Epoch:[" not in proc.stdout and "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in ckpt_dir.iterdir()} == before


@pytest.mark.slow  # make test-slow (budget)
def test_fresh_run_beside_an_older_runs_files_resumes_itself_and_keeps_them(tmp_path: Path) -> None:
    need_shared()
    old = run_cli(tmp_path, tiny_args(epochs=2, save_interval=5))
    assert old.returncode == 0
    old_ckpts = {p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")}
    args = tiny_args(epochs=2, save_interval=5) + ["--model.learning_rate", "1e-3"]
    # a fresh run, killed right after its second export: the step-10 save's
    new = run_cli(tmp_path, args, env=cli_env(LIT_MINIMIND_TEST_STOP_AFTER_SAVE="2:export"))
    assert new.returncode == -9 and "@@stopped-after-save" in new.stdout
    resumed = run_cli(tmp_path, args + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 11)
    assert old_ckpts <= {p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")}, "another run's files were pruned"


@pytest.mark.slow  # make test's budget: 14.6 min on a clean clone, 2026-12-03 (make test-slow)
def test_resume_with_other_batch_size_fails(tmp_path: Path) -> None:
    ckpt_dir, args = _partial_run(tmp_path)
    run = run_cli(tmp_path, args + ["--ckpt_path", "last", "--data.batch_size", "6"])
    assert run.returncode == 2 and "batch size: checkpoint 4, this run 6" in run.stderr


@pytest.mark.slow
def test_a_really_full_filesystem_stops_the_run_and_the_resume_is_exact(tmp_path: Path) -> None:
    """checkpoints/ on a 12 MB tmpfs (a private mount namespace): the step-4 save (7.5 MB; due at 3, taken
    at its optimizer step) fits, the step-6 one does not (ENOSPC from the kernel, no injection). The run
    stops with exit 2 naming it; the files on that filesystem, copied out, resume exactly from step 4."""
    need_shared()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private tmpfs")
    args = tiny_args(epochs=1, accumulate=2, save_interval=3)
    ref_dir, run_dir, kept = tmp_path / "ref", tmp_path / "run", tmp_path / "kept"
    for d in (ref_dir, run_dir / "checkpoints", kept):
        d.mkdir(parents=True)
    ref = run_cli(ref_dir, args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    script = ('mount -t tmpfs -o size=12m tmpfs "$0" || exit 97; "$@"; rc=$?; df -k "$0" | tail -1 >&2; '
              'cp -a "$0"/. "$KEPT"/; exit $rc')
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, str(run_dir / "checkpoints"), sys.executable, "-m",
                           "lit_minimind.fit", *args], cwd=run_dir, env=cli_env(KEPT=str(kept)), capture_output=True,
                          text=True, timeout=600)
    if proc.returncode == 97:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr[:200]}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "could not save the checkpoint at epoch 1 step 6" in error and "No space left on device" in error, error
    assert "Traceback" not in proc.stderr
    assert not list(kept.glob("*.tmp")), "the failed write left its tmp file"
    assert [p.name for p in kept.glob("*.ckpt")] and all("_s4_" in p.name for p in kept.glob("*.ckpt"))

    shutil.rmtree(run_dir / "checkpoints")
    shutil.copytree(kept, run_dir / "checkpoints")  # the full filesystem's files, now on a disk with room
    resumed = run_cli(run_dir, args + ["--ckpt_path", "last"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_resumed(resumed, 1, 5)
    assert resumed.steps == {key: values for key, values in ref.steps.items() if key >= (1, 5)}
    ref_out = torch.load(ref_dir / "out" / "pretrain_64.pth", weights_only=True)
    out = torch.load(run_dir / "out" / "pretrain_64.pth", weights_only=True)
    assert out.keys() == ref_out.keys() and all(torch.equal(out[k], ref_out[k]) for k in ref_out)
