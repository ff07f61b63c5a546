"""Where the loop's own time goes, phase by phase: Lightning's training loop against the plain loop.

Complements ``bench_overhead``'s attribution (``loop_overhead_ms``): the same 64x1 run (an optimizer
step every micro-batch) with a timestamp at every boundary a user can see - the callback hooks
(``on_train_batch_start``, ``on_before_zero_grad``, ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``, ``on_train_batch_end``), ``training_step``'s entry and exit, and the
entry and exit of the work both sides share (``__getitem__``, forward, backward, clipping, the AdamW
update; on the plain side also ``zero_grad``). A phase is the time between two consecutive stamps,
its median over the timed micro-batches of all runs; the shared work's phases are left out of the
totals, so ``loop ms`` is what each loop adds around the same work. Lightning's callbacks here are
the port's (``ResumeCallback``, ``MiniMindConsole``) between a first and a last stamping callback.

``python -m benchmarks.loop_phases [--quick] [--reps N] [--results-dir DIR] [--threads N]`` (about a minute;
``--quick``: 16 timed micro-batches, one run, numbers mean nothing)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_overhead import _MISSING, ATTRIBUTION, Timers, plain_run
from benchmarks.common import RESULTS_DIR, bench_parser, default_data, environment, quiet, say, set_threads, table, write_json

SHARED = Timers.SHARED


class Stamps(Timers):
    """``(name, perf_counter)`` pairs; ``wrap`` stamps ``name[`` and ``name]`` around a function
    (``Timers``' wrapping of the shared work and its ``restore``)."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def stamped(*args: Any, **kwargs: Any) -> Any:
            self.mark(f"{name}[")
            try:
                return original(*args, **kwargs)
            finally:
                self.mark(f"{name}]")

        self._undo.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
        setattr(owner, attr, stamped)

    def phases(self, end: str, skip: int) -> dict[str, list[float]]:
        """ms per phase ``a -> b`` over the micro-batches after the first ``skip`` (split at ``end``)."""
        batches, current = [], []
        for mark in self.marks:
            current.append(mark)
            if mark[0] == end:
                batches.append(current)
                current = []
        out: dict[str, list[float]] = collections.defaultdict(list)
        for i in range(max(skip, 1), len(batches)):
            seq = [batches[i - 1][-1], *batches[i]]
            for (a, ta), (b, tb) in zip(seq, seq[1:]):
                out[f"{a} -> {b}"].append(1000 * (tb - ta))
        return out


def lightning_side(stamps: Stamps, cfg: Any, data: Path, tok: Path) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lit_minimind.callbacks import MiniMindConsole, ResumeCallback
    from lit_minimind.data.datamodule import MiniMindDataModule
    from lit_minimind.model.module import LitMiniMind

    mark = stamps.mark

    class First(Callback):
        def on_train_batch_start(self, *args: Any) -> None: mark("on_train_batch_start")
        def on_before_zero_grad(self, *args: Any) -> None: mark("on_before_zero_grad")
        def on_before_backward(self, *args: Any) -> None: mark("on_before_backward")
        def on_after_backward(self, *args: Any) -> None: mark("on_after_backward")
        def on_before_optimizer_step(self, *args: Any) -> None: mark("on_before_optimizer_step")
        def on_train_batch_end(self, *args: Any) -> None: mark("on_train_batch_end (first callback)")

    class Last(Callback):
        def on_train_batch_start(self, *args: Any) -> None: mark("on_train_batch_start (last callback)")
        def on_train_batch_end(self, *args: Any) -> None: mark("batch end")

    class Stamped(LitMiniMind):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            mark("training_step[")
            try:
                return super().training_step(batch, batch_idx)
            finally:
                mark("training_step]")

    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        L.seed_everything(42, verbose=False)
        module = Stamped(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers, learning_rate=cfg.learning_rate)
        datamodule = MiniMindDataModule(data_path=str(data), tokenizer_path=str(tok), max_seq_len=cfg.max_seq_len,
                                        batch_size=cfg.batch_size, num_workers=0)
        ours = [ResumeCallback(save_interval=10**9, out_dir=f"{tmp}/out", ckpt_dir=f"{tmp}/checkpoints"),
                MiniMindConsole(log_interval=cfg.log_interval)]
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_epochs=1, max_steps=cfg.batches,
                            gradient_clip_val=1.0, callbacks=[First(), *ours, Last()], default_root_dir=tmp,
                            use_distributed_sampler=False, log_every_n_steps=1, logger=True,
                            enable_progress_bar=False, enable_model_summary=False)
        stamps.wrap_shared(module.model)
        try:
            trainer.fit(module, datamodule=datamodule)
        finally:
            stamps.restore()


def plain_side(stamps: Stamps, cfg: Any, data: Path, tok: Path) -> None:
    import torch

    from lit_minimind.model import MiniMindForCausalLM

    class Clock:  # plain_run's timers interface: its batch ends
        def wrap_shared(self, model: Any) -> None: pass
        def batch_end(self) -> None: stamps.mark("batch end")

    stamps.wrap_shared(MiniMindForCausalLM)
    stamps.wrap(torch.optim.AdamW, "zero_grad", "zero_grad")
    try:
        plain_run(cfg, data, tok, Clock())
    finally:
        stamps.restore()


def measure(reps: int, quick: bool = False) -> dict[str, Any]:
    cfg = dataclasses.replace(ATTRIBUTION, timed_batches=16 if quick else 200)
    data, tok = default_data()
    sides = {"plain": plain_side, "lightning": lightning_side}
    phases: dict[str, dict[str, list[float]]] = {s: collections.defaultdict(list) for s in sides}
    for rep in range(reps + 1):  # the first run of each side warms up
        for side, fn in sides.items():
            stamps = Stamps()
            with quiet():
                fn(stamps, cfg, data, tok)
            if rep:
                for k, v in stamps.phases("batch end", cfg.warmup_batches).items():
                    phases[side][k] += v
    out: dict[str, Any] = {"config": dataclasses.asdict(cfg), "reps": reps}
    for side, got in phases.items():
        medians = {k: statistics.median(v) for k, v in got.items()}
        shared = {k: m for k, m in medians.items() if k.split(" -> ")[0].rstrip("[") in SHARED and k.split(" -> ")[0].endswith("[")}
        loop = {k: m for k, m in medians.items() if k not in shared}
        out[side] = {"phases_ms": loop, "shared_ms": shared, "loop_ms": sum(loop.values()), "shared_total_ms": sum(shared.values())}
    out["lightning_minus_plain_loop_ms"] = out["lightning"]["loop_ms"] - out["plain"]["loop_ms"]
    return out


def render(result: dict[str, Any]) -> str:
    rows = []
    for side in ("plain", "lightning"):
        for phase, ms in result[side]["phases_ms"].items():
            if ms >= 0.005:
                rows.append([side, phase, f"{ms:.3f}"])
        rows.append([side, "**loop ms (sum of the phases above, shared work excluded)**", f"**{result[side]['loop_ms']:.3f}**"])
    rows.append(["", "**Lightning − plain**", f"**{result['lightning_minus_plain_loop_ms']:+.3f}**"])
    return table(["side", "phase (between consecutive stamps; medians)", "ms per micro-batch"], rows)


def run(results_dir: Path = RESULTS_DIR, reps: int = 3, threads: int | None = None, quick: bool = False) -> dict[str, Any]:
    threads = set_threads(threads)
    say(f"== loop phases: Lightning vs plain, {ATTRIBUTION.name}, {reps} runs of each side after a warm-up ==")
    result = measure(reps, quick)
    text = render(result)
    say(text)
    payload = {"benchmark": "loop_phases", "quick": quick, "threads": threads, "environment": environment(), **result,
               "table": text}
    write_json(results_dir / "loop_phases.json", payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__, "runs of each side after a warm-up (default 3)").parse_args(argv)
    run(args.results_dir, args.reps or (1 if args.quick else 3), args.threads, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
