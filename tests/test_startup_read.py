"""A resume reads its checkpoint once: verified once (one CRC pass), unpickled once, its manifest read
once; the wandb id, the console's state and Lightning's restore all come from that one read."""

from __future__ import annotations

import builtins
import io
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import LINE_RE, assert_resumed, need_shared, run_cli, steps_of, tiny_args


def test_a_resume_reads_its_checkpoint_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    need_shared()
    args = tiny_args(epochs=1, accumulate=2, save_interval=4)
    first = run_cli(tmp_path, args + ["--trainer.max_steps", "2"])  # stops after batch 4, saved there
    assert first.returncode == 0, first.stderr[-2000:]
    (chosen,) = (tmp_path / "checkpoints").glob("*_s4_*.ckpt")
    # _resume.pth is a hard link to it: the same bytes under another name count as the checkpoint too
    resume_link = tmp_path / "checkpoints" / "pretrain_64_resume.pth"
    assert os.path.samefile(resume_link, chosen)
    watched = {os.path.abspath(chosen): "checkpoint", os.path.abspath(resume_link): "checkpoint",
               os.path.abspath(f"{chosen}.manifest.json"): "manifest"}
    reads: Counter[str] = Counter()
    real_open, real_load = builtins.open, torch.load

    def counting_open(file, mode="r", *a, **k):  # noqa: ANN001, ANN002, ANN003
        if isinstance(file, (str, os.PathLike)) and "r" in mode and os.path.abspath(file) in watched:
            reads[f"open {watched[os.path.abspath(file)]}"] += 1
        return real_open(file, mode, *a, **k)

    def counting_load(f, *a, **k):  # noqa: ANN001, ANN002, ANN003
        if isinstance(f, (str, os.PathLike)) and os.path.abspath(f) in watched:
            reads["torch.load checkpoint"] += 1
        return real_load(f, *a, **k)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(torch, "load", counting_load)
    from lit_minimind.cli.fit import main

    assert main(args + ["--trainer.max_steps", "3", "--ckpt_path", "last"]) == 0
    # the file opened three times: the CRC pass, the zip check (its directory at the end: whether it can be
    # mapped) and torch.load's own open (it opens through Python's open); its bytes read once, by the CRC pass
    assert reads == {"open checkpoint": 3, "open manifest": 1, "torch.load checkpoint": 1}, reads
    out, err = capfd.readouterr()  # Lightning's info lines: on stderr, or in pytest's log capture
    # it resumed from that checkpoint (a fresh start reads nothing): at batch 5, and trained batches 5 and 6 only
    trained = steps_of(LINE_RE.findall(out))
    assert_resumed(out + err + caplog.text, 1, 5, lines=trained)
    assert sorted(trained) == [(1, 5), (1, 6)], sorted(trained)
