"""Memory per rank of a checkpoint saved inside an accumulation window under DDP, and of its resume
(2 and 4 CPU processes, gloo).

Inside a window each rank writes its own partial gradients into its own shard beside the checkpoint
and, on resume, reads only its own (:mod:`lit_minimind.resume.rank_state`); global rank 0 also writes
the checkpoint and MiniMind's fp16 export. Target (issue 21): peak extra memory per rank during the
save and during the resume at most 1.2x its own gradients, beyond the fp16 export rank 0 writes.

A real ``Trainer(strategy="ddp", devices=N)`` (Lightning's launcher starts ranks 1.. as the same
command) trains ``512x8`` with accumulation 2; a probe callback calls :meth:`ResumeCallback.save` at
micro-batch 3 (a warm-up: the asynchronous snapshot allocates its buffers there, AdamW having its
moments) and at micro-batch 5 (measured), both inside a window. A second DDP run resumes from the
measured checkpoint. Per rank:

* ``grads_bytes``: its own gradients (every parameter's ``.grad``);
* ``peak_extra_bytes``: peak RSS from the save's start until its files are written (rank 0 waits for
  its background writer) minus RSS before it;
* ``export_bytes``: the fp16 export's tensors (tied ones once), which rank 0 builds during the save
  (0 elsewhere: only the writing rank builds it);
* ``resume_peak_extra_bytes``: peak RSS while the resumed rank reads its shard and sets its parameters'
  gradients (``ResumeCallback.on_train_start``) minus RSS before: the gradients become the
  parameters' ``.grad``, which an uninterrupted run holds at that point too.

RSS, not tracemalloc (which does not see tensors' memory): ``VmHWM`` of ``/proc/self/status`` reset to
the current RSS through ``/proc/self/clear_refs`` right before, after ``malloc_trim`` (freed heap given
back, so growth shows), so every CPU allocation of the process counts, the writer thread's included.

``python -m benchmarks.bench_ddp_save [--quick] [--results-dir DIR] [--threads N]`` (``--quick``: 64x2, 2 processes)
"""

from __future__ import annotations

import argparse
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

FULL_SIZE, QUICK_SIZE = (512, 8), (64, 2)
FULL_WORLDS, QUICK_WORLDS = (2, 4), (2,)
TARGET = 1.2  # peak extra per rank / own gradients (beyond the export)
MiB = 2**20
MEASURED = ("peak RSS (VmHWM reset through /proc/self/clear_refs after malloc_trim) minus RSS before, per process: "
            "every CPU allocation counts (tensors included, which tracemalloc does not see), the background writer's too")


class _Peak:
    """RSS before, and the peak above it since (``VmHWM`` reset)."""

    def __enter__(self) -> _Peak:
        _trim()
        self.before = _rss_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        return self

    def __exit__(self, *exc: Any) -> None:
        self.extra = max(0, _status_kb("VmHWM") - self.before)


def _grads_bytes(module: Any) -> int:
    return sum(p.grad.nelement() * p.grad.element_size() for p in module.parameters() if p.grad is not None)


def _trainer(world: int, out: Path, callbacks: list[Any], max_steps: int) -> Any:
    import lightning as L

    from lit_minimind.resume.io import SafeCheckpointIO

    return L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=max_steps, accumulate_grad_batches=2,
                     callbacks=callbacks, plugins=[SafeCheckpointIO()], logger=False, default_root_dir=str(out),
                     use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False)


def _module_and_data(hidden: int, layers: int) -> tuple[Any, Any]:
    import lightning as L

    from lit_minimind.data.datamodule import MiniMindDataModule
    from lit_minimind.model.module import LitMiniMind

    data, tok = default_data()
    L.seed_everything(0, verbose=False)
    module = LitMiniMind(hidden_size=hidden, num_hidden_layers=layers)
    return module, MiniMindDataModule(data_path=str(data), tokenizer_path=str(tok), max_seq_len=16, batch_size=2)


def save_worker(out: Path, world: int, hidden: int, layers: int) -> None:
    """Trains into a window and saves there; each rank writes ``save{r}.json``."""
    import lightning as L

    from lit_minimind.callbacks import ResumeCallback
    from lit_minimind.checkpoint.weights import fp16_weights

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            io = trainer.strategy.checkpoint_io
            if batch_idx == 2:  # warm-up, inside the second window (AdamW holds its moments from here on)
                callback.save(trainer, pl_module)
                io.wait()
            elif batch_idx == 4:  # measured, inside the third window
                grads = _grads_bytes(pl_module)
                with _Peak() as peak:
                    callback.save(trainer, pl_module)
                    io.wait()  # rank 0: until its files are written (asynchronous writer)
                weights = fp16_weights(pl_module.state_dict()) if trainer.is_global_zero else {}
                export = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                                                     for t in weights.values()}.values())
                result = {"rank": trainer.global_rank, "grads_bytes": grads, "peak_extra_bytes": peak.extra,
                          "export_bytes": export, "snapshot_bytes": getattr(io, "snapshot_bytes", 0)}
                (out / f"save{trainer.global_rank}.json").write_text(json.dumps(result))

    module, datamodule = _module_and_data(hidden, layers)
    callback = ResumeCallback(save_interval=10**9, out_dir=str(out / "out"), ckpt_dir=str(out / "checkpoints"),
                              keep_last=10)
    _trainer(world, out, [callback, Probe()], max_steps=3).fit(module, datamodule=datamodule)


def resume_worker(out: Path, world: int, hidden: int, layers: int) -> None:
    """Resumes from the measured checkpoint (micro-batch 5); each rank writes ``resume{r}.json``."""
    from lit_minimind.callbacks import ResumeCallback

    class Measured(ResumeCallback):
        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            with _Peak() as peak:
                super().on_train_start(trainer, pl_module)  # reads this rank's shard, sets the gradients
            result = {"rank": trainer.global_rank, "resume_peak_extra_bytes": peak.extra,
                      "resume_grads_bytes": _grads_bytes(pl_module)}
            (out / f"resume{trainer.global_rank}.json").write_text(json.dumps(result))

    ckpt = next((out / "checkpoints").glob("*_e0_s5_*.ckpt"))
    module, datamodule = _module_and_data(hidden, layers)
    callback = Measured(save_interval=10**9, out_dir=str(out / "out2"), ckpt_dir=str(out / "checkpoints2"))
    callback.resume_from(str(ckpt))
    _trainer(world, out, [callback], max_steps=3).fit(module, datamodule=datamodule, ckpt_path=str(ckpt))


def _launch(phase: str, out: Path, world: int, size: str) -> None:
    cmd = [sys.executable, "-m", "benchmarks.bench_ddp_save", "--worker", phase, "--out", str(out),
           "--world", str(world), "--size", size]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    files = sorted(out.glob(f"{phase}*.json"))
    if proc.returncode != 0 or len(files) != world:
        raise RuntimeError(f"DDP {phase} worker ({world} processes) failed (exit {proc.returncode}): {proc.stderr[-3000:]}")


def measure(world: int, hidden: int, layers: int) -> list[dict[str, Any]]:
    """One save run and one resume run on ``world`` processes: a dict per rank."""
    with tempfile.TemporaryDirectory(prefix="bench-ddp-save-") as tmp:
        out = Path(tmp)
        for phase in ("save", "resume"):
            _launch(phase, out, world, f"{hidden}x{layers}")
        ranks = []
        for rank in range(world):
            r = {**json.loads((out / f"save{rank}.json").read_text()), **json.loads((out / f"resume{rank}.json").read_text())}
            grads = r["grads_bytes"]
            r["save_ratio"] = round(max(0, r["peak_extra_bytes"] - r["export_bytes"]) / grads, 3)
            r["resume_ratio"] = round(r["resume_peak_extra_bytes"] / grads, 3)
            r["within_target"] = max(r["save_ratio"], r["resume_ratio"]) <= TARGET
            ranks.append(r)
    return ranks


def render(runs: list[dict[str, Any]]) -> str:
    rows = [[run["world_size"], r["rank"], f"{r['grads_bytes'] / MiB:.1f}", f"{r['peak_extra_bytes'] / MiB:.1f}",
             f"{r['export_bytes'] / MiB:.1f}", f"{r['save_ratio']:.2f}", f"{r['resume_peak_extra_bytes'] / MiB:.1f}",
             f"{r['resume_ratio']:.2f}", f"{run['world_size'] * r['grads_bytes'] / MiB:.0f}"]
            for run in runs for r in run["ranks"]]
    return table(["processes", "rank", "own gradients MiB", "save: peak extra MiB", "of it fp16 export MiB",
                  "save: (peak - export) ÷ gradients", "resume: peak extra MiB", "resume ÷ gradients",
                  "all ranks' gradients (gathered to rank 0 before) MiB"], rows)


def plot(runs: list[dict[str, Any]], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    labels, save, resume = [], [], []
    for run in runs:
        for r in run["ranks"]:
            labels.append(f"{run['world_size']}p r{r['rank']}")
            save.append(r["save_ratio"])
            resume.append(r["resume_ratio"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], save, 0.4, color="tab:purple", label="save: (peak - export) ÷ own gradients")
    ax.bar([i + 0.2 for i in x], resume, 0.4, color="tab:green", label="resume: peak ÷ own gradients")
    ax.axhline(TARGET, color="tab:red", ls="--", lw=1, label=f"target {TARGET}")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("× own gradients")
    ax.set_title("extra memory per rank, save inside an accumulation window, DDP", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    threads = set_threads(threads)
    hidden, layers = QUICK_SIZE if quick else FULL_SIZE
    worlds = QUICK_WORLDS if quick else FULL_WORLDS
    say(f"== checkpoint inside an accumulation window and its resume, DDP {'/'.join(map(str, worlds))} CPU processes, "
        f"{hidden}x{layers} ==")
    default_data()  # built once here, not by every rank at a time
    runs = [{"world_size": w, "ranks": measure(w, hidden, layers)} for w in worlds]
    text = render(runs)
    say(text)
    payload = {"benchmark": "ddp_save", "quick": quick, "threads": threads, "environment": environment(),
               "model": f"{hidden}x{layers}", "accumulate_grad_batches": 2, "target_ratio": TARGET,
               "within_target": all(r["within_target"] for run in runs for r in run["ranks"]),
               "measured": MEASURED, "runs": runs, "table": text}
    write_json(results_dir / "ddp_save.json", payload)
    plot(runs, results_dir / "ddp_save.png")
    return payload


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", choices=("save", "resume"), required=True)
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--world", type=int, required=True)
        parser.add_argument("--size", default="512x8")
        args = parser.parse_args(argv)
        hidden, layers = (int(x) for x in args.size.split("x"))
        (save_worker if args.worker == "save" else resume_worker)(args.out, args.world, hidden, layers)
        return 0
    args = bench_parser(__doc__, "unused (one measured save and resume per rank)").parse_args(argv)
    run(args.quick, args.results_dir, args.reps, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
