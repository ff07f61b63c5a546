"""Memory of a checkpoint saved inside an accumulation window under DDP (2 CPU processes, gloo).

A save inside a window carries every rank's partial gradients (unscaled) and RNG state, gathered to
global rank 0 only (``dist.gather_object``): rank 0 holds its own copy and the other ranks'; every
other rank holds one copy of its own while it is sent. An all-gather would hold ``world_size``
copies on *every* rank, and a list kept in the callback would stay there until the next save.

A real ``Trainer(strategy="ddp", devices=2)`` trains ``768x8`` (MiniMind's preset) with
accumulation 2; a probe callback calls :meth:`ResumeCallback.save` at micro-batch 3 (a warm-up: the
asynchronous snapshot allocates its buffers there, AdamW having its moments) and at micro-batch 5
(measured), both inside a window. Per rank: the gradient size, the peak extra RSS from the save's start until its files are
written (``VmHWM`` reset through ``/proc/self/clear_refs``), the snapshot buffers kept for the next
save (allocated by the warm-up, so not part of the peak), and how many gathered per-rank lists are
alive after it (a list of ``world_size`` dicts with ``rng`` and ``grads``).

``python -m benchmarks.bench_ddp_save [--quick] [--results-dir DIR] [--threads N]`` (``--quick``: 64x2)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.bench_checkpoint import _rss_bytes, _status_kb, _trim
from benchmarks.common import (
    RESULTS_DIR,
    bench_parser,
    default_data,
    environment,
    pyplot,
    save_figure,
    say,
    set_threads,
    table,
    write_json,
)

FULL_SIZE, QUICK_SIZE = (768, 8), (64, 2)
WORLD_SIZE = 2
MiB = 2**20


def _gathered_lists_alive(world_size: int) -> int:
    """Lists that look like a gather of every rank's training state (``[{"rng", "grads"}, ...]``)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, list) and len(o) == world_size
               and all(isinstance(x, dict) and "grads" in x and "rng" in x for x in o))


def _measured_save(trainer: Any, module: Any, callback: Any) -> dict[str, Any]:
    io = trainer.strategy.checkpoint_io
    grads = sum(p.grad.nelement() * p.grad.element_size() for p in module.parameters() if p.grad is not None)
    _trim()
    before = _rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    callback.save(trainer, module)
    io.wait()  # rank 0: until the files are written (asynchronous writer)
    peak = max(0, _status_kb("VmHWM") - before)
    return {"rank": trainer.global_rank, "grads_bytes": grads, "peak_extra_bytes": peak,
            "snapshot_bytes": getattr(io, "snapshot_bytes", 0),
            "gathered_lists_alive": _gathered_lists_alive(trainer.world_size)}


def worker(out: Path, hidden: int, layers: int) -> None:
    """One DDP run; Lightning's launcher starts rank 1 as this same command. Each rank writes
    ``rank{r}.json`` into ``out``."""
    import lightning as L

    from callbacks import ResumeCallback
    from lit_minimind.data.datamodule import MiniMindDataModule
    from lit_minimind.model.module import LitMiniMind
    from lit_minimind.resume.io import SafeCheckpointIO

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if batch_idx == 2:  # warm-up, inside the second window (AdamW holds its moments from here on)
                callback.save(trainer, pl_module)
                trainer.strategy.checkpoint_io.wait()
            elif batch_idx == 4:  # measured, inside the third window
                result = _measured_save(trainer, pl_module, callback)
                (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))

    data, tok = default_data()
    L.seed_everything(0, verbose=False)
    module = LitMiniMind(hidden_size=hidden, num_hidden_layers=layers)
    datamodule = MiniMindDataModule(data_path=str(data), tokenizer_path=str(tok), max_seq_len=16, batch_size=2)
    callback = ResumeCallback(save_interval=10**9, out_dir=str(out / "out"), ckpt_dir=str(out / "checkpoints"))
    trainer = L.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy="ddp", max_steps=3, accumulate_grad_batches=2,
                        callbacks=[callback, Probe()], plugins=[SafeCheckpointIO()], logger=False,
                        default_root_dir=str(out), use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, datamodule=datamodule)


def render(ranks: list[dict[str, Any]]) -> str:
    rows = [[r["rank"], f"{r['grads_bytes'] / MiB:.0f}", f"{r['peak_extra_bytes'] / MiB:.0f}",
             f"{r['peak_extra_bytes'] / r['grads_bytes']:.2f}", f"{r['snapshot_bytes'] / MiB:.0f}",
             r["gathered_lists_alive"],
             f"{WORLD_SIZE * r['grads_bytes'] / MiB:.0f}"] for r in ranks]
    return table(["rank", "own gradients MiB", "peak extra RSS during the save MiB", "÷ own gradients",
                  "snapshot kept between saves MiB",
                  "gathered per-rank lists alive after", "an all-gather would hold MiB"], rows)


def plot(ranks: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    x = [r["rank"] for r in ranks]
    ax.bar([i - 0.2 for i in x], [r["grads_bytes"] / MiB for r in ranks], 0.4, color="tab:gray", label="own gradients")
    ax.bar([i + 0.2 for i in x], [r["peak_extra_bytes"] / MiB for r in ranks], 0.4, color="tab:purple",
           label="peak extra RSS during the save")
    ax.axhline(WORLD_SIZE * ranks[0]["grads_bytes"] / MiB, color="tab:red", ls="--", lw=1, label="an all-gather, per rank")
    ax.set_xticks(x, [f"rank {i}" for i in x])
    ax.set_ylabel("MiB")
    ax.set_title("save inside an accumulation window, DDP", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    """Runs the DDP worker in its own process group (Lightning relaunches *that* command for rank 1)."""
    threads = set_threads(threads)
    hidden, layers = QUICK_SIZE if quick else FULL_SIZE
    say(f"== checkpoint inside an accumulation window, DDP {WORLD_SIZE} CPU processes, {hidden}x{layers} ==")
    default_data()  # built once here, not by two ranks at a time
    with tempfile.TemporaryDirectory(prefix="bench-ddp-save-") as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "benchmarks.bench_ddp_save", "--worker", str(out), "--size", f"{hidden}x{layers}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        files = sorted(out.glob("rank*.json"))
        if proc.returncode != 0 or len(files) != WORLD_SIZE:
            raise RuntimeError(f"DDP worker failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in files]
    text = render(ranks)
    say(text)
    payload = {"benchmark": "ddp_save", "quick": quick, "threads": threads, "environment": environment(),
               "model": f"{hidden}x{layers}", "world_size": WORLD_SIZE, "accumulate_grad_batches": 2,
               "ranks": ranks, "table": text}
    write_json(results_dir / "ddp_save.json", payload)
    plot(ranks, results_dir / "ddp_save.png")
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", type=Path, required=True)
        parser.add_argument("--size", default="768x8")
        args = parser.parse_args(argv)
        hidden, layers = (int(x) for x in args.size.split("x"))
        worker(args.worker, hidden, layers)
        return 0
    args = bench_parser(__doc__, "unused (one measured save per rank)").parse_args(argv)
    run(args.quick, args.results_dir, args.reps, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
