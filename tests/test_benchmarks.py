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

from tests.helpers.runs import ROOT, cli_env

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


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
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
    for side in ("plain", "lightning"):  # stamped at the same hooks on both sides: the shared work is inside the batch
        assert all(positive(at[side][part]) for part in ("batch", "data", "forward", "backward", "step"))
        assert sum(at[side][p]["median"] for p in ("data", "forward", "backward", "step")) < at[side]["batch"]["median"]
    assert data["attribution_table"] in stdout


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_checkpoint_quick(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = load(out, "checkpoint")
    assert data["table"] in stdout and data["detail_table"] in stdout
    (r,) = data["results"]
    for key in ("bytes_ours", "bytes_minimind", "bytes_ratio_vs_minimind", "peak_extra_rss_bytes", "modes", "step_s"):
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
    assert set(r["modes"]) == {"sync", "async"}
    stats_ = [m[k] for m in r["modes"].values() for k in ("save_s", "save_and_write_s", "bare_torch_save_s",
                                                         "minimind_save_s", "stall_ratio")]
    assert all(positive(s) for s in stats_) and r["modes"]["async"]["save_s"]["n"] == data["reps"] >= 2
    assert r["step_s"] > 0 and r["slowdown_at_save_interval_1000"] > 0
    rss = r["peak_extra_rss_bytes"]  # VmHWM after minus RSS before: MiniMind's fp16 copy and our snapshot need memory
    assert rss["minimind"] > 0 and rss["ours_async"] > 0 and all(v < 4 * b["ours_ckpt"] for v in rss.values()), rss
    assert set(r["profile_s"]) == {"minimind", "ours_sync", "ours_async"} and r["profile_s"]["ours_sync"]["total"] > 0
    # the snapshot kept between asynchronous saves: about one checkpoint's tensors
    assert 0.5 * b["ours_ckpt"] < r["modes"]["async"]["snapshot_bytes"] < 1.5 * b["ours_ckpt"]


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
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
        phases = r["phases_median_s"]  # consecutive spans cut at the probe's hook events, launch -> first console line
        assert len(phases) == 5 and all(v > 0 for v in phases.values()), phases
        assert sum(phases.values()) == pytest.approx(r["total_s"]["median"], rel=1e-6)


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_data_quick(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = load(out, "data")
    assert data["table"] in stdout
    assert data["records"] == 5_000 and data["index_bytes"] == 8 * 5_000 + 128  # uint64 offsets + the .npy header
    assert data["first_build_s"] > 0 and data["cached_start_s"] > 0
    assert data["builds_first"] == [1] * data["reps"] and set(data["builds_cached"]) == {0}  # the cache is used
    assert data["ddp2"]["cold_builds"] == 1 and data["ddp2"]["cached_builds"] == 0  # one build per node
    assert all(v > 0 for v in data["loader_samples_per_s"].values())
    if "minimind" in data:  # only where a Python with `datasets` is at hand
        assert data["minimind"]["first_load"]["median"] > 0


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_remote_quick(quick_run: tuple[Path, str]) -> None:
    """Checkpoints on object storage: both upload variants and both stalls measured (moto on localhost)."""
    out, stdout = quick_run
    data = json.loads((out / "remote.json").read_text())
    assert data["benchmark"] == "remote" and data["quick"] is True and data["table"] in stdout
    assert positive(data["upload"]["mb_per_s"]["bare"]) and positive(data["upload"]["mb_per_s"]["ours"])
    assert positive(data["stall"]["stall_s"]["local"]) and positive(data["stall"]["stall_s"]["remote"])
    assert "### 6. Checkpoints on object storage" in (out / "summary.md").read_text()


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_restart_quick(quick_run: tuple[Path, str]) -> None:
    """The restart breakdown: its phases, cut at lines the resume start printed, add up to launch -> first
    optimizer step; imports dominate; the isolated parts and the bare import of torch and Lightning are measured."""
    out, stdout = quick_run
    data = load(out, "restart")
    assert data["table"] in stdout and "### 7. Restart breakdown" in (out / "summary.md").read_text()
    phases = {label: s["median"] for label, s in data["phases_s"].items()}
    assert len(phases) == 6 and all(v > 0 for v in phases.values()), phases
    total = data["launch_to_first_step_s"]["median"]
    assert sum(phases.values()) == pytest.approx(total, rel=1e-6)  # consecutive spans: nothing counted twice
    assert phases["imports (torch, Lightning, CLI)"] > 0.25 * total
    assert positive(data["import_torch_lightning_s"]) and positive(data["launch_to_first_step_plain_s"])
    assert all(positive(s) for s in data["isolated_parts_s"].values()) and len(data["isolated_parts_s"]) == 3
    assert {"torch", "lightning"} <= {i["name"] for i in data["top_imports_s"]}


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_chaos_quick(quick_run: tuple[Path, str]) -> None:
    """Goodput under chaos: the run was signalled and restarted, ended with the uninterrupted run's weights, and
    every measure is reported (MiniMind's side is left out without a checkout, and says so)."""
    out, stdout = quick_run
    data = load(out, "chaos")
    assert data["table"] in stdout and "### 8. Goodput under chaos" in (out / "summary.md").read_text()
    assert "no MiniMind checkout" in data["verdict"] and "minimind" not in data["baseline_s"]
    auto = data["by_mean"]["10"]["auto"]
    assert auto["weights"]["equal"] is True and auto["weights"]["max_abs_diff"] == 0
    assert 0 < auto["goodput"] <= 1.05 and auto["wall_s"] > data["baseline_s"]["ours"] * 0.95
    signals = auto["signals"]["SIGKILL"] + auto["signals"]["SIGTERM"]
    # every signal ended a start and the last start finished (one may land as it exits: counted, harmless)
    assert auto["starts"] >= 2 and auto["starts"] - 1 <= signals <= auto["starts"], auto
    assert auto["restart_s"]["n"] >= 1 and 0.5 < auto["restart_s"]["p50"] <= auto["restart_s"]["p95"] < 60
    assert auto["redone_after_term"] == 0  # a SIGTERM saves at the step boundary: nothing is trained twice
    assert 0 < auto["save_s"] < 5 and auto["tau_s"] > 0 and auto["young_daly"] is not None


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_summary_quick(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    text = (out / "summary.md").read_text()
    for heading in ("### 1. Port overhead", "### 2. Checkpoint cost", "### 3. Resume cost vs position",
                    "### 5. Data set-up at MiniMind's size"):
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


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_loop_phases_quick(quick_run: tuple[Path, str]) -> None:
    """Written by bench_overhead from its attribution runs: every stamped boundary of both loops shows up, the shared
    work is kept out of the loop totals."""
    out, stdout = quick_run
    data = json.loads((out / "loop_phases.json").read_text())
    assert data["benchmark"] == "loop_phases" and data["table"] in stdout
    light, plain = data["lightning"], data["plain"]
    shared = {"forward[ -> forward]", "backward[ -> backward]", "step[ -> step]"}
    assert set(light["shared_ms"]) == set(plain["shared_ms"]) == shared
    for phase in ("batch start -> forward[", "backward] -> step[", "batch end -> batch start"):
        assert phase in light["phases_ms"] and phase in plain["phases_ms"], phase
    # Lightning zeroes the gradients in its closure, before backward; MiniMind's loop after the step
    assert "forward] -> zero_grad" in light["phases_ms"] and "step] -> zero_grad" in plain["phases_ms"]
    assert 0 < plain["data_ms"] and 0 < light["data_ms"] and light["shared_total_ms"] > 0
    assert data["lightning_minus_plain_loop_ms"] == pytest.approx(light["loop_ms"] - plain["loop_ms"])


def test_benchmarks_are_callers_not_patches() -> None:
    """benchmarks/ imports nothing from tests/, no private product name, and patches no product class."""
    import re

    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) (tests|conftest)\b", text, re.M), path
        assert not re.search(r"^\s*from lit_minimind\S* import .*\b_[a-z]", text, re.M), path
        assert "setattr(" not in text and not re.search(r"^\s*\w+(\.\w+)+\.\w+ = ", text, re.M), path


def test_alternating_rotates_every_item_through_every_slot() -> None:
    from benchmarks.common import alternating

    orders = [alternating(["a", "b", "c"], rep) for rep in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [alternating(["x", "y"], rep) for rep in range(2)] == [["x", "y"], ["y", "x"]]


@pytest.mark.bench  # the quick run of every benchmark: minutes on 2 cores (make test-bench)
def test_overhead_quick_reports_loop_overhead_and_skips_compile(quick_run: tuple[Path, str]) -> None:
    out, stdout = quick_run
    data = load(out, "overhead")
    # the port's cost per micro-batch, at the top level: Lightning's loop minus the plain loop's
    assert data["loop_overhead_ms"] == data["attribution"]["lightning_minus_plain_loop_ms"]["median"]
    assert data["loop_overhead_target_ms"] == 0.6
    assert data["loop_overhead_target_met"] == (data["loop_overhead_ms"] <= 0.6)
    assert "loop overhead:" in stdout
    assert data["compile"] == {"skipped": "--quick"} and data["compile_table"] == ""  # a CPU compile takes a minute


@pytest.mark.bench  # torch.compile on CPU: about a minute (make test-bench)
def test_overhead_compile_measures_eager_and_compiled() -> None:
    from benchmarks.bench_overhead import Config, compile_measure, render
    from benchmarks.common import default_data, set_threads

    set_threads(1)
    data, tok = default_data()
    cfg = Config("compile smoke 64x1", 64, 1, 32, 4, 1, 1e-3, warmup_batches=3, timed_batches=4, log_interval=2)
    comp = compile_measure(cfg, data, tok, reps=1)
    for key in ("eager_tokens_per_s", "compiled_tokens_per_s", "speedup", "cpu_speedup"):
        assert positive(comp[key]), key
    assert comp["compile_s_estimate"] > 0  # the first compiled run compiled inside its warm-up
    assert comp["max_abs_last_loss_diff"] < 1e-3  # the same training, rounded differently at most
    assert comp["config"]["name"] in render([comp], compiled=True)


# --------------------------------------------------------------------------- bench_gpu (GPU; --quick on CPU)


@pytest.mark.bench  # about ten CLI processes: a minute on 2 cores (make test-bench)
def test_gpu_benchmark_quick_smoke(tmp_path: Path) -> None:
    """``bench_gpu --quick``: every part runs on the CPU and reports, without claiming GPU results."""
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--quick", "--results-dir", str(out)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert not (out / "gpu.json").exists()  # the GPU results file is never written by the smoke test
    data = json.loads((out / "gpu_quick.json").read_text())
    assert data["benchmark"] == "gpu" and data["quick"] is True and data["gpu_results"] is False
    assert data["table"] in proc.stdout and "CPU smoke test, not GPU results" in proc.stdout
    spec = data["spec"]
    a = data["throughput"]
    for side in ("plain", "port", "port_nondeterministic"):
        assert positive(a["sides"][side]["tokens_per_s"]) and a["sides"][side]["mfu"] is None  # no peak FLOPs on a CPU
    assert a["last_loss_diff_port_plain"] < 1e-4  # the plain loop and the CLI train the same model on the same batches
    assert a["sides"]["port"]["deterministic"] is True and a["sides"]["port_nondeterministic"]["deterministic"] is False
    assert positive(a["port_over_plain"]) and positive(a["nondeterministic_over_default"])
    ex = data["exactness"]
    assert set(ex["resume"]) == {label for label, _ in spec["precisions"]} and len(ex["resume"]) == 2
    for label, r in ex["resume"].items():  # killed after the first save, resumed with --ckpt_path last: bit for bit
        assert r["identical"], (label, r)
        assert r["killed_after_save_at_step"] == spec["save_interval"] and r["resumed_first_console_step"] is not None
        assert r["global_step"] == [spec["resume_steps"]] * 2 and r["console_lines_compared"] == spec["resume_steps"]
    for key in ("two_uninterrupted_runs", "async_vs_sync_save"):
        assert ex["determinism"][key]["identical"], (key, ex["determinism"][key])
    assert ex["determinism"]["deterministic_flags"] == {"deterministic": True, "deterministic_warn_only": False}
    assert data["errors"] == [] and spec["deadline_s"] > 0 and spec["child_timeout_s"] > 0
    stall = data["save_stall"]
    assert set(stall) == {"async", "sync"}
    for mode in stall.values():
        assert mode["saves"] >= 1 and positive(mode["held_s"]) and mode["slowdown_at_interval"] > 0
    assert data["all_identical"] is True


def test_gpu_benchmark_without_cuda_exits_2_with_one_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full benchmark would run")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--results-dir", str(tmp_path)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA device" in proc.stderr and "--quick" in proc.stderr
    assert not any(tmp_path.iterdir())


def test_gpu_peak_flops_table_and_bitwise_comparison() -> None:
    import torch

    from benchmarks.bench_gpu import bitwise_equal, peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA GeForce RTX 4090") is None  # unknown: tokens/s only, MFU null
    assert peak_flops("NVIDIA GeForce RTX 4090", 165.0) == 165e12  # --peak-tflops
    a = {"w": torch.tensor([0.0, 1.5]), "opt": [{"step": torch.tensor(3.0)}], "n": 1}
    assert bitwise_equal(a, {"w": torch.tensor([0.0, 1.5]), "opt": [{"step": torch.tensor(3.0)}], "n": 1})
    assert not bitwise_equal(a, {**a, "w": torch.tensor([-0.0, 1.5])})  # equal as numbers, not bit for bit
    assert not bitwise_equal(a, {**a, "w": torch.tensor([0.0, 1.5], dtype=torch.float64)})
    assert not bitwise_equal(a, {**a, "n": 2}) and not bitwise_equal(a, {"w": a["w"]})
