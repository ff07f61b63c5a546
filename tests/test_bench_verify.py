"""Smoke test of benchmarks/bench_verify.py: runs at toy size (alone and through run_all) and reports sane numbers.

Speed is never asserted (a --quick run on a shared machine means nothing); only that every variant
was measured, the table and JSON agree, verify_file read the file about once, and the generated
checkpoint was deleted.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT, cli_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def positive(s: dict) -> bool:
    return 0 < s["min"] <= s["median"] <= s["max"] and len(s["values"]) == s["n"] >= 1


def leftovers() -> set[str]:
    return {p.name for p in (ROOT / ".cache").glob("bench-verify-*")}


@pytest.mark.bench  # a benchmark's smoke run (make test-bench)
def test_bench_verify_quick(tmp_path: Path) -> None:
    before = leftovers()
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_verify", "--quick", "--results-dir", str(out)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((out / "verify.json").read_text())
    assert data["benchmark"] == "verify" and data["quick"] is True and data["reps"] >= 2
    assert data["table"] in proc.stdout
    assert (out / "verify.png").read_bytes()[:8] == PNG_MAGIC
    assert set(data["results"]) == {"hot", "cold"}
    assert set(data["speed_ratio_verify_vs_baseline"]) == {"hot", "cold"}
    for cache, variants in data["results"].items():
        assert {"verify_file", data["baseline"]} <= set(variants)
        baseline_s = variants[data["baseline"]]["s"]["values"]
        for r in variants.values():
            assert positive(r["s"]) and positive(r["gb_per_s"]) and positive(r["speed_vs_baseline"])
            assert r["s"]["n"] == data["reps"]
            # derived from the measured seconds: speed = the baseline's seconds / the variant's within each
            # repetition (the median of those ratios), GB/s = the file's bytes / seconds
            speeds = [b / s for b, s in zip(baseline_s, r["s"]["values"])]
            assert r["speed_vs_baseline"]["values"] == pytest.approx(speeds, rel=1e-9)
            assert r["speed_vs_baseline"]["median"] == pytest.approx(statistics.median(speeds), rel=1e-9)
            assert r["gb_per_s"]["values"] == pytest.approx([data["file_bytes"] / s / 1e9 for s in r["s"]["values"]],
                                                            rel=1e-9)
        # the headline ratio is verify_file's seconds against the baseline's, in this cache state
        verify_s = variants["verify_file"]["s"]["values"]
        assert data["speed_ratio_verify_vs_baseline"][cache]["median"] == pytest.approx(
            statistics.median(b / s for b, s in zip(baseline_s, verify_s)), rel=1e-9)
    assert 4 << 20 < data["file_bytes"] < 16 << 20 and data["records"] > 10
    if data["verify_bytes_read"] is not None:  # one pass: the file plus a few KiB of headers
        assert data["file_bytes"] <= data["verify_bytes_read"] < data["file_bytes"] + (64 << 10)
    assert all(v > 0 for v in data["crc32_in_memory_gb_per_s"].values())
    assert leftovers() == before  # the generated checkpoint is gone


def test_run_all_includes_verify(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--quick", "--only", "verify",
                           "--results-dir", str(out)], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = (out / "summary.md").read_text()
    data = json.loads((out / "verify.json").read_text())
    assert "### 4. Verifying a checkpoint without a manifest" in summary and data["table"] in summary
