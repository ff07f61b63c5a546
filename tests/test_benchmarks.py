"""Smoke test of benchmarks/: every benchmark runs at toy size and writes a sane table, JSON and plot.

Speed targets are never asserted here (the numbers of a --quick run on a shared machine mean
nothing); only that the benchmarks run, measure what they claim and report it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench") / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--quick", "--results-dir", str(out)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc.stdout


def load(out: Path, name: str) -> dict:
    png = out / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size < 1 << 20
    data = json.loads((out / f"{name}.json").read_text())
    assert data["benchmark"] == name and data["quick"] is True
    return data


def positive(s: dict) -> bool:
    return 0 < s["min"] <= s["median"] <= s["max"] and len(s["values"]) == s["n"] >= 1


def test_overhead_quick(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = load(out, "overhead")
    assert data["table"] in stdout
    (r,) = data["results"]
    assert positive(r["plain_tokens_per_s"]) and positive(r["lightning_tokens_per_s"]) and positive(r["ratio"])
    assert r["ratio"]["n"] == data["reps"] >= 2
    # both sides train the same model on the same batches: the same losses (not a speed check)
    assert r["max_abs_last_loss_diff"] < 1e-4
    at = data["attribution"]["ms_per_batch"]
    for part in ("data", "forward", "backward", "AdamW update", "loop", "batch"):
        assert positive(at["plain"][part]) and positive(at["lightning"][part])
    assert positive(at["lightning"]["self.log"]) and positive(at["lightning"]["our callbacks"])
    assert data["attribution_table"] in stdout


def test_checkpoint_quick(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = load(out, "checkpoint")
    assert data["table"] in stdout and data["detail_table"] in stdout
    (r,) = data["results"]
    for key in ("bytes_ours", "bytes_minimind", "bytes_ratio_vs_minimind", "save_s", "bare_torch_save_s",
                "async_stall_ratio", "minimind_save_s", "peak_extra_rss_bytes", "modes", "save_mode"):
        assert key in r, key
    ratio = r["bytes_ratio_vs_minimind"]
    assert isinstance(ratio, float) and ratio > 0
    assert ratio == pytest.approx(r["bytes_ours"] / r["bytes_minimind"])
    # one save's bytes: the .ckpt and the export (+ manifests); _resume.pth is a hard link to the .ckpt, counted once
    b = r["bytes"]
    assert b["resume_is_hard_link_to_ckpt"]
    assert r["bytes_ours"] == b["ours_ckpt"] + b["ours_export"] + b["ours_manifests"]
    assert 0 < b["ours_export"] < b["ours_ckpt"] and 0 < b["ours_manifests"] < 4096
    assert sum(b["minimind_files"].values()) == r["bytes_minimind"] > 0
    assert set(r["modes"]) == ({"sync", "async"} if data["async_save_available"] else {"sync"})
    assert r["save_mode"] == ("async" if data["async_save_available"] else "sync")
    stats_ = [r["save_s"], r["bare_torch_save_s"], r["async_stall_ratio"], r["minimind_save_s"]]
    stats_ += [m[k] for m in r["modes"].values() for k in ("save_s", "save_and_write_s", "bare_torch_save_s",
                                                          "minimind_save_s", "stall_ratio")]
    assert all(positive(s) for s in stats_) and r["save_s"]["n"] == data["reps"] >= 2
    assert r["step_s"] > 0 and r["slowdown_at_save_interval_1000"] > 0
    assert all(v >= 0 for v in r["peak_extra_rss_bytes"].values())


def test_resume_quick(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = load(out, "resume")
    assert data["table"] in stdout
    positions = [r["position"] for r in data["results"]]
    assert len(positions) >= 3 and positions[-1] > positions[0] == 0
    for r in data["results"]:
        assert r["first_step"] == r["position"] + 1  # the CLI resumed exactly where the checkpoint says
        assert r["samples_read_before_first_batch"] == data["batch_size"]  # skipped batches were never read
        assert positive(r["total_s"]) and positive(r["cpu_s"])
        phases = r["phases_median_s"]  # sequential parts of the launch -> first batch time
        assert phases["python + imports"] > 0 and phases["jsonl scan"] > 0 and phases["checkpoint read"] > 0
        assert all(v > -0.05 for v in phases.values())


def test_summary_quick(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    text = (out / "summary.md").read_text()
    for heading in ("### 1. Port overhead", "### 2. Checkpoint cost", "### 3. Resume cost vs position"):
        assert heading in text
    assert sum(p.stat().st_size for p in out.iterdir()) < 1 << 20


def test_readme_tables_are_replaced_between_markers(tmp_path: Path) -> None:
    from benchmarks.run_all import END, START, update_readme

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold table\n{END}\nanalysis\n")
    assert update_readme("| new | table |", readme)
    assert readme.read_text() == f"intro\n{START}\n| new | table |\n{END}\nanalysis\n"
    (tmp_path / "plain.md").write_text("no markers\n")
    assert not update_readme("x", tmp_path / "plain.md")


def test_alternating_rotates_every_item_through_every_slot() -> None:
    from benchmarks.common import alternating

    orders = [alternating(["a", "b", "c"], rep) for rep in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [alternating(["x", "y"], rep) for rep in range(2)] == [["x", "y"], ["y", "x"]]
