"""Port overhead: training tokens/s through Lightning vs a plain PyTorch loop of the same training.

Both sides train the same MiniMind model (same seed, so the same initial weights) on the same
batches (MiniMind's per-epoch permutation, batch for batch) with the same optimizer (AdamW,
weight decay 0.01), precision (fp32, as MiniMind on CPU), gradient accumulation (loss / N,
step every N micro-batches), LR rule (MiniMind's cosine, set per micro-batch) and clipping
(global norm 1.0). The Lightning side is the real thing: ``Trainer`` with
:class:`LitMiniMind`, :class:`MiniMindDataModule`, :class:`ResumeCallback` (save interval
larger than the run; the save where training stops, at ``max_steps``, falls after the timed
window), :class:`MiniMindConsole` and Lightning's default logger with ``log_every_n_steps=1``, as
``python -m lit_minimind.fit`` configures it. The plain loop is
MiniMind's ``train_epoch`` written out below.

Throughput is measured in steady state: from the end of the last warm-up micro-batch to the
end of the last timed one (everything either side does between two batches is inside the
window: data loading, hooks, logging, optimizer steps). Both sides run alternately in one
process; the headline is the median over repetitions of the per-pair ratio
``lightning / plain``, whose losses are also compared (they must be equal: same training).
The same ratio by process CPU time is given as a second opinion on a shared machine.

Then an attribution run on a small model (an optimizer step every batch) wraps timers around
the work both sides share (data, forward, backward, clipping, AdamW update) and around the
parts only Lightning has (``self.log``, the logger, our callbacks, ``training_step``); what
is left of a batch interval is the loop itself, and Lightning's minus the plain loop's is the
port's cost per micro-batch, independent of model size: ``loop_overhead_ms`` in ``overhead.json``
(target <= 0.6 ms).

Also (not with ``--quick``): tokens/s through Lightning with and without ``--model.compile true``
(``LitMiniMind(compile=True)``, ``torch.compile`` of the model's forward) on the tiny default, the
compile kept out of the timed window by the warm-up batches: ``compile`` in ``overhead.json``.

``python -m benchmarks.bench_overhead [--quick] [--reps N] [--threads N] [--profile] [--no-compile]``
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    alternating,
    bench_parser,
    cache_dir,
    default_data,
    environment,
    fmt_num,
    pyplot,
    quiet,
    rel,
    save_figure,
    say,
    set_threads,
    stats,
    table,
    write_json,
    write_text,
)

TARGET_RATIO = 0.97


@dataclass
class Config:
    name: str
    hidden_size: int
    num_hidden_layers: int
    max_seq_len: int
    batch_size: int
    accumulate: int
    learning_rate: float
    warmup_batches: int  # micro-batches run before the timed window (multiple of accumulate)
    timed_batches: int  # micro-batches in the timed window (multiple of accumulate)
    log_interval: int = 10
    note: str = ""

    @property
    def batches(self) -> int:
        return self.warmup_batches + self.timed_batches

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.max_seq_len


FULL_CONFIGS = [
    # conf/default.yaml: the tiny default
    Config("tiny default 128x2", 128, 2, 128, 16, 1, 2e-3, warmup_batches=4, timed_batches=24,
           note="conf/default.yaml model and data shape; 4 warm-up + 24 timed micro-batches per run"),
    # the larger model the issue asks for; batch and steps kept small so it finishes on a CPU
    Config("512x8 seq256", 512, 8, 256, 2, 2, 5e-4, warmup_batches=2, timed_batches=10,
           note="small on purpose for a CPU: batch 2, accumulation 2, 2 warm-up + 10 timed micro-batches per run"),
]
QUICK_CONFIGS = [Config("quick 64x1", 64, 1, 32, 4, 2, 1e-3, warmup_batches=2, timed_batches=6, log_interval=2)]
# where the per-batch cost of the port goes: a small model, an optimizer step (so every hook) each batch
ATTRIBUTION = Config("64x1 seq32 batch4", 64, 1, 32, 4, 1, 1e-3, warmup_batches=8, timed_batches=64, log_interval=10)
QUICK_ATTRIBUTION = Config("quick 64x1", 64, 1, 32, 4, 1, 1e-3, warmup_batches=2, timed_batches=6, log_interval=2)
# the port's cost per micro-batch (attribution: Lightning's loop - the plain loop's), target in ms
TARGET_LOOP_OVERHEAD_MS = 0.6
# --model.compile true vs eager, through Lightning; the first compiled run compiles (about a minute on
# a CPU) inside its warm-up batches, later runs in the process reuse the compiled kernels
COMPILE = Config("tiny default 128x2", 128, 2, 128, 16, 1, 2e-3, warmup_batches=6, timed_batches=16,
                 note="conf/default.yaml shape; 6 warm-up (the compile) + 16 timed micro-batches per run")
COMPILE_REPS = 3


class Timers:
    """Per-batch time spent inside wrapped functions (for the attribution only).

    The same work is wrapped on both sides: data (``PretrainDataset.__getitem__``), forward,
    backward, clipping and the AdamW update; on the Lightning side also ``self.log``/
    ``self.log_dict``, the logger, our callbacks and ``training_step``. Times are exclusive:
    a wrapped call made inside another (forward inside ``training_step``, the logger inside
    ``MiniMindConsole``) counts only under its own key.
    """

    SHARED = ("data", "forward", "backward", "clip", "AdamW update")

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.batches: list[dict[str, float]] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self._nested: list[float] = []  # per open timer: time spent in timers opened inside it

    def wrap(self, owner: Any, name: str, key: str) -> None:
        """Time ``owner.name`` under ``key``, exclusive of the wrapped calls it makes (a logger
        called from our callback counts as logger, not twice)."""
        original = getattr(owner, name)
        acc, nested = self.acc, self._nested

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            nested.append(0.0)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = nested.pop()
                acc[key] = acc.get(key, 0.0) + elapsed - inner
                if nested:
                    nested[-1] += elapsed

        self._undo.append((owner, name, owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING))
        setattr(owner, name, timed)

    def wrap_shared(self, model: Any) -> None:
        """Wrap the work both loops share: ``__getitem__``, ``model.forward`` (an instance or the
        class), backward, clipping and AdamW's update."""
        import importlib

        import torch

        from lit_minimind.data.dataset import PretrainDataset

        adam_module = importlib.import_module("torch.optim.adam")  # torch.optim hides the submodule name

        self.wrap(PretrainDataset, "__getitem__", "data")
        self.wrap(model, "forward", "forward")
        self.wrap(torch.Tensor, "backward", "backward")
        self.wrap(torch.nn.utils, "clip_grad_norm_", "clip")
        self.wrap(adam_module, "adam", "AdamW update")  # AdamW.step's update (Adam.step calls it)

    def batch_end(self) -> None:
        self.batches.append(dict(self.acc))
        self.acc.clear()

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()


_MISSING = object()


# --------------------------------------------------------------------------- the two sides


def plain_run(cfg: Config, data: Path, tok: Path, timers: Timers | None = None, *, device: str = "cpu",
              precision: str = "32-true", num_workers: int = 0, deterministic: bool | str | None = None) -> dict[str, Any]:
    """MiniMind's training loop in plain PyTorch; returns batch-end times and the last loss.

    ``device``, ``precision`` (``32-true`` or ``bf16-mixed``: autocast around forward and loss, as
    Lightning and MiniMind do), ``num_workers`` and ``deterministic`` (``True``/``"warn"``/``False``,
    as Lightning's ``Trainer(deterministic=...)``; ``None`` leaves torch's setting alone) are for
    :mod:`benchmarks.bench_gpu`. On CUDA the device is synchronized at the end of the warm-up and of
    the last batch, so the timed window holds the GPU work of the timed batches.
    """
    import contextlib

    import torch
    from torch.utils.data import DataLoader

    from lit_minimind.callbacks.console import format_minimind_line
    from lit_minimind.data.dataset import PretrainDataset
    from lit_minimind.data.sampler import SkipBatchSampler, epoch_permutation
    from lit_minimind.data.tokenizer import load_tokenizer
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.module import minimind_lr

    if precision not in ("32-true", "bf16-mixed"):
        raise ValueError(f"plain_run: precision {precision!r} (32-true or bf16-mixed)")
    start = (time.perf_counter(), time.process_time())
    if deterministic is not None:  # what Lightning's Trainer(deterministic=...) sets
        torch.use_deterministic_algorithms(bool(deterministic), warn_only=deterministic == "warn")
        torch.backends.cudnn.deterministic = bool(deterministic)
        if deterministic:
            torch.backends.cudnn.benchmark = False
    cuda = torch.device(device).type == "cuda"
    torch.manual_seed(42)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.01)
    dataset = PretrainDataset(data, load_tokenizer(tok), max_length=cfg.max_seq_len)
    loader = DataLoader(dataset, batch_sampler=SkipBatchSampler(epoch_permutation(len(dataset), 0), cfg.batch_size),
                        num_workers=num_workers, pin_memory=cuda)
    autocast = (lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16)) if precision == "bf16-mixed" \
        else contextlib.nullcontext
    if timers:
        timers.wrap_shared(model)
    iters = len(loader)
    total = min(iters, cfg.batches)  # the LR rule's T, as LitMiniMind computes it with max_steps
    ends: list[tuple[float, float]] = []
    loss = torch.zeros(())
    model.train()
    epoch_start = time.perf_counter()
    for step, (x, y) in enumerate(loader, start=1):
        if cuda:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        lr = minimind_lr(step, total, cfg.learning_rate)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast():
            out = model(x, labels=y)
            loss = out.loss + out.aux_loss
        (loss / cfg.accumulate).backward()
        if step % cfg.accumulate == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step % cfg.log_interval == 0:
            spent = time.perf_counter() - epoch_start
            print(format_minimind_line(0, 1, step, iters, loss.item(), out.loss.item(), float(out.aux_loss), lr,
                                       spent / step * (iters - step) // 60), flush=True)
        if cuda and step in (cfg.warmup_batches, cfg.batches):
            torch.cuda.synchronize()
        ends.append((time.perf_counter(), time.process_time()))
        if timers:
            timers.batch_end()
        if step == cfg.batches:
            break
    return {"start": start, "ends": ends, "last_loss": float(loss.detach())}


def lightning_run(cfg: Config, data: Path, tok: Path, workdir: Path, timers: Timers | None = None,
                  compile: bool = False) -> dict[str, Any]:
    """The same training through Lightning with our module, data module and callbacks
    (``compile``: ``LitMiniMind(compile=True)``, i.e. ``--model.compile true``)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lit_minimind.callbacks import MiniMindConsole, ResumeCallback
    from lit_minimind.data.datamodule import MiniMindDataModule
    from lit_minimind.model.module import LitMiniMind

    class BatchClock(Callback):  # first in the list: the save where training stops (max_steps, in the last
        # batch's on_train_batch_end) comes after the last stamp, outside the timed window; between two
        # stamps lies all of one batch's work, the other callbacks' included
        def __init__(self) -> None:
            self.ends: list[tuple[float, float]] = []

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append((time.perf_counter(), time.process_time()))
            if timers:
                timers.batch_end()

    start = (time.perf_counter(), time.process_time())
    L.seed_everything(42, verbose=False)
    module = LitMiniMind(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers, learning_rate=cfg.learning_rate,
                         compile=compile)
    datamodule = MiniMindDataModule(data_path=str(data), tokenizer_path=str(tok), max_seq_len=cfg.max_seq_len,
                                    batch_size=cfg.batch_size, num_workers=0)
    clock = BatchClock()
    ours = [
        ResumeCallback(save_interval=10**9, out_dir=str(workdir / "out"), ckpt_dir=str(workdir / "checkpoints")),
        MiniMindConsole(log_interval=cfg.log_interval),
    ]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_epochs=1,
        max_steps=cfg.batches // cfg.accumulate, accumulate_grad_batches=cfg.accumulate, gradient_clip_val=1.0,
        callbacks=[clock, *ours], default_root_dir=str(workdir),
        # as lit_minimind.fit's trainer_defaults; logger=True is Lightning's default logger
        use_distributed_sampler=False, log_every_n_steps=1, logger=True,
        enable_progress_bar=False, enable_model_summary=False,
    )
    if timers:
        timers.wrap_shared(module.model)
        timers.wrap(module, "training_step", "training_step")  # encloses forward and self.log
        timers.wrap(module, "log", "self.log")
        timers.wrap(module, "log_dict", "self.log")
        for logger in trainer.loggers:
            timers.wrap(logger, "log_metrics", "logger")
            timers.wrap(logger, "save", "logger")
        for callback in ours:
            timers.wrap(callback, "on_train_batch_end", "our callbacks")
    trainer.fit(module, datamodule=datamodule)
    assert len(clock.ends) == cfg.batches, (len(clock.ends), cfg.batches)
    return {"start": start, "ends": clock.ends, "last_loss": float(module.last_stats["loss"]),
            "logger": type(trainer.logger).__name__ if trainer.logger else None}


def throughput(cfg: Config, run: dict[str, Any], clock: int) -> float:
    """Tokens/s over the timed window by wall clock (``clock=0``) or by this process's CPU time (1)."""
    ends = run["ends"]
    first = ends[cfg.warmup_batches - 1] if cfg.warmup_batches else run["start"]
    return cfg.timed_batches * cfg.tokens_per_batch / (ends[cfg.batches - 1][clock] - first[clock])


def one(side: str, cfg: Config, data: Path, tok: Path, timers: Timers | None = None) -> dict[str, Any]:
    """One run of ``side``: ``plain``, ``lightning`` or ``compiled`` (Lightning with ``--model.compile true``)."""
    with quiet(), tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        try:
            if side == "plain":
                run = plain_run(cfg, data, tok, timers)
            else:
                run = lightning_run(cfg, data, tok, Path(tmp), timers, compile=side == "compiled")
        finally:
            if timers:
                timers.restore()
    run["tokens_per_s"] = throughput(cfg, run, 0)
    run["cpu_tokens_per_s"] = throughput(cfg, run, 1)
    run["start_to_first_batch_s"] = run["ends"][0][0] - run["start"][0]
    return run


# --------------------------------------------------------------------------- benchmark


def measure(cfg: Config, data: Path, tok: Path, reps: int) -> dict[str, Any]:
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    params = MiniMindForCausalLM(MiniMindConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers)).num_parameters()
    sides = ("plain", "lightning")
    say(f"  [{cfg.name}] warm-up run of each side ...")
    for side in sides:
        one(side, cfg, data, tok)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    ratios, cpu_ratios, loss_diffs = [], [], []
    for rep in range(reps):
        for side in alternating(sides, rep):
            runs[side].append(one(side, cfg, data, tok))
        p, lt = runs["plain"][-1], runs["lightning"][-1]
        ratios.append(lt["tokens_per_s"] / p["tokens_per_s"])
        cpu_ratios.append(lt["cpu_tokens_per_s"] / p["cpu_tokens_per_s"])
        loss_diffs.append(abs(lt["last_loss"] - p["last_loss"]))
        say(f"  [{cfg.name}] rep {rep + 1}/{reps}: plain {p['tokens_per_s']:,.0f} tok/s, "
            f"lightning {lt['tokens_per_s']:,.0f} tok/s, ratio {ratios[-1]:.3f} (CPU-time ratio {cpu_ratios[-1]:.3f})")
    ratio = stats(ratios)
    return {
        "config": asdict(cfg),
        "params": params,
        "torch_threads": torch.get_num_threads(),
        "plain_tokens_per_s": stats([r["tokens_per_s"] for r in runs["plain"]]),
        "lightning_tokens_per_s": stats([r["tokens_per_s"] for r in runs["lightning"]]),
        "ratio": ratio,
        "plain_cpu_tokens_per_s": stats([r["cpu_tokens_per_s"] for r in runs["plain"]]),
        "lightning_cpu_tokens_per_s": stats([r["cpu_tokens_per_s"] for r in runs["lightning"]]),
        "cpu_ratio": stats(cpu_ratios),
        "plain_start_to_first_batch_s": stats([r["start_to_first_batch_s"] for r in runs["plain"]]),
        "lightning_start_to_first_batch_s": stats([r["start_to_first_batch_s"] for r in runs["lightning"]]),
        "plain_ms_per_batch": 1000 * cfg.tokens_per_batch / stats([r["tokens_per_s"] for r in runs["plain"]])["median"],
        "lightning_ms_per_batch": 1000 * cfg.tokens_per_batch / stats([r["tokens_per_s"] for r in runs["lightning"]])["median"],
        "max_abs_last_loss_diff": max(loss_diffs),
        "target_ratio": TARGET_RATIO,
        "target_met": ratio["median"] >= TARGET_RATIO,
    }


def attribution(cfg: Config, data: Path, tok: Path, reps: int) -> dict[str, Any]:
    """Where each side's time per micro-batch goes, from timers around the same work on both sides.

    Per run: the median over the timed batches of each part; ``loop`` is the batch interval
    minus the shared work (data, forward, backward, clipping, AdamW update), i.e. what the
    training loop itself costs. Reported: the median over the (alternating) runs.
    """
    sides = ("plain", "lightning")
    say(f"  [attribution {cfg.name}] warm-up run of each side ...")
    for side in sides:
        one(side, cfg, data, tok, Timers())
    per_run: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    for rep in range(reps):
        for side in alternating(sides, rep):
            timers = Timers()
            run = one(side, cfg, data, tok, timers)
            ends = [e[0] for e in run["ends"]]
            rows = []
            for i in range(cfg.warmup_batches, cfg.batches):
                got = timers.batches[i]
                parts = {k: got.get(k, 0.0) for k in (*Timers.SHARED, "self.log", "logger", "our callbacks")}
                interval = ends[i] - ends[i - 1]
                parts["loop"] = interval - sum(parts[k] for k in Timers.SHARED)
                # LR setting, loss bookkeeping in LitMiniMind.training_step (exclusive of forward and self.log)
                parts["training_step extras"] = got.get("training_step", 0.0)
                parts["Lightning loop, hooks, closure"] = (parts["loop"] - parts["self.log"] - parts["logger"]
                                                           - parts["our callbacks"] - parts["training_step extras"])
                parts["batch"] = interval
                rows.append(parts)
            per_run[side].append({k: 1000 * statistics.median(r[k] for r in rows) for k in rows[0]})
            # the mean counts what happens every log_interval batches only (the console's one transfer
            # and logger rows), which the median per batch leaves out; more exposed to machine noise
            per_run[side][-1]["loop (mean)"] = 1000 * statistics.fmean(r["loop"] for r in rows)
        say(f"  [attribution {cfg.name}] rep {rep + 1}/{reps}: loop ms/batch plain "
            f"{per_run['plain'][-1]['loop']:.2f}, lightning {per_run['lightning'][-1]['loop']:.2f}")
    ms = {side: {k: stats([r[k] for r in runs]) for k in runs[0]} for side, runs in per_run.items()}
    overhead = [lt["loop"] - p["loop"] for p, lt in zip(per_run["plain"], per_run["lightning"])]
    overhead_mean = [lt["loop (mean)"] - p["loop (mean)"] for p, lt in zip(per_run["plain"], per_run["lightning"])]
    return {"config": asdict(cfg), "ms_per_batch": ms, "lightning_minus_plain_loop_ms": stats(overhead),
            "lightning_minus_plain_loop_mean_ms": stats(overhead_mean)}


def compile_measure(cfg: Config, data: Path, tok: Path, reps: int) -> dict[str, Any]:
    """Lightning eager vs ``--model.compile true`` (``LitMiniMind(compile=True)``), alternating.

    The compile happens in the warm-up batches, outside the timed window; its cost is estimated as
    the compiled side's start -> first batch minus the eager side's, in the first repetition: a cold
    compile, in a fresh ``TORCHINDUCTOR_CACHE_DIR`` (later compiled runs reuse its kernels).
    """
    import os

    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench-inductor-", dir=cache_dir()) as inductor:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor
        try:
            return _compile_measure(cfg, data, tok, reps)
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def _compile_measure(cfg: Config, data: Path, tok: Path, reps: int) -> dict[str, Any]:
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    params = MiniMindForCausalLM(MiniMindConfig(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers)).num_parameters()
    sides = ("lightning", "compiled")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    speedups, cpu_speedups, loss_diffs = [], [], []
    for rep in range(reps):
        for side in alternating(sides, rep):
            if side == "compiled" and rep == 0:
                say(f"  [compile {cfg.name}] first compiled run (compiles; about a minute on a CPU) ...")
            runs[side].append(one(side, cfg, data, tok))
        e, c = runs["lightning"][-1], runs["compiled"][-1]
        speedups.append(c["tokens_per_s"] / e["tokens_per_s"])
        cpu_speedups.append(c["cpu_tokens_per_s"] / e["cpu_tokens_per_s"])
        loss_diffs.append(abs(c["last_loss"] - e["last_loss"]))
        say(f"  [compile {cfg.name}] rep {rep + 1}/{reps}: eager {e['tokens_per_s']:,.0f} tok/s, compiled "
            f"{c['tokens_per_s']:,.0f} tok/s, speed-up {speedups[-1]:.3f} (CPU time {cpu_speedups[-1]:.3f})")
    first = {s: runs[s][0]["start_to_first_batch_s"] for s in sides}
    return {
        "config": asdict(cfg),
        "params": params,
        "torch_threads": torch.get_num_threads(),
        "eager_tokens_per_s": stats([r["tokens_per_s"] for r in runs["lightning"]]),
        "compiled_tokens_per_s": stats([r["tokens_per_s"] for r in runs["compiled"]]),
        "speedup": stats(speedups),
        "cpu_speedup": stats(cpu_speedups),
        "eager_start_to_first_batch_s": stats([r["start_to_first_batch_s"] for r in runs["lightning"]]),
        "compiled_start_to_first_batch_s": stats([r["start_to_first_batch_s"] for r in runs["compiled"]]),
        "compile_s_estimate": first["compiled"] - first["lightning"],
        "max_abs_last_loss_diff": max(loss_diffs),  # inductor's fused kernels round differently: small, not 0
    }


def render_compile(comp: dict[str, Any]) -> str:
    c, e, k, q = comp["config"], comp["eager_tokens_per_s"], comp["compiled_tokens_per_s"], comp["speedup"]
    return table(
        ["config", "params", "batch", "eager tok/s med (min–max)", "compiled tok/s med (min–max)",
         "compiled / eager med (min–max)", "CPU-time ratio med", "cold compile s", "Δ last loss"],
        [[c["name"], f"{comp['params'] / 1e6:.1f}M", f"{c['batch_size']}x{c['max_seq_len']}, acc {c['accumulate']}",
          f"{fmt_num(e['median'])} ({fmt_num(e['min'])}–{fmt_num(e['max'])})",
          f"{fmt_num(k['median'])} ({fmt_num(k['min'])}–{fmt_num(k['max'])})",
          f"**{q['median']:.3f}** ({q['min']:.3f}–{q['max']:.3f})", f"{comp['cpu_speedup']['median']:.3f}",
          f"{comp['compile_s_estimate']:.0f}", f"{comp['max_abs_last_loss_diff']:.1e}"]])


def render_attribution(at: dict[str, Any]) -> str:
    keys = ["batch", *Timers.SHARED, "loop", "self.log", "logger", "our callbacks", "training_step extras",
            "Lightning loop, hooks, closure"]
    rows = []
    for key in keys:
        p, lt = at["ms_per_batch"]["plain"][key], at["ms_per_batch"]["lightning"][key]
        shown = {"batch": "whole micro-batch", "loop": "loop = whole − (data + forward + backward + clip + AdamW)"}.get(
            key, key if key in Timers.SHARED else f"  of which: {key}")
        rows.append([shown, f"{p['median']:.3f}" if key in Timers.SHARED + ("batch", "loop") else "–",
                     f"{lt['median']:.3f} ({lt['min']:.3f}–{lt['max']:.3f})"])
    o = at["lightning_minus_plain_loop_ms"]
    rows.append(["**port overhead = Lightning loop − plain loop**", "", f"**{o['median']:+.3f}** ({o['min']:+.3f}–{o['max']:+.3f})"])
    return table(["ms per micro-batch (median)", "plain", "Lightning med (min–max over runs)"], rows)


def render(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        c, p, lt, q = r["config"], r["plain_tokens_per_s"], r["lightning_tokens_per_s"], r["ratio"]
        rows.append([
            c["name"], f"{r['params'] / 1e6:.1f}M", f"{c['batch_size']}x{c['max_seq_len']}, acc {c['accumulate']}",
            f"{fmt_num(p['median'])} ({fmt_num(p['min'])}–{fmt_num(p['max'])})",
            f"{fmt_num(lt['median'])} ({fmt_num(lt['min'])}–{fmt_num(lt['max'])})",
            f"**{q['median']:.3f}** ({q['min']:.3f}–{q['max']:.3f})",
            f"{r['cpu_ratio']['median']:.3f} ({r['cpu_ratio']['min']:.3f}–{r['cpu_ratio']['max']:.3f})",
            f"≥ {r['target_ratio']}: {'yes' if r['target_met'] else 'NO'}",
            f"{r['max_abs_last_loss_diff']:.1e}",
        ])
    return table(["config", "params", "batch", "plain tok/s med (min–max)", "Lightning tok/s med (min–max)",
                  "ratio med (min–max)", "CPU-time ratio med (min–max)", "target", "Δ last loss"], rows)


def plot(results: list[dict[str, Any]], at: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1.2, 1, 1]})
    names = [r["config"]["name"] for r in results]
    for i, r in enumerate(results):
        for j, (side, color) in enumerate((("plain", "tab:gray"), ("lightning", "tab:purple"))):
            s = r[f"{side}_tokens_per_s"]
            ax1.bar(i + (j - 0.5) * 0.38, s["median"], 0.36, color=color,
                    yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]], capsize=3,
                    label=side if i == 0 else None)
        ax2.plot([i] * len(r["ratio"]["values"]), r["ratio"]["values"], "o", color="tab:purple", alpha=0.5)
        ax2.plot([i - 0.2, i + 0.2], [r["ratio"]["median"]] * 2, "-", color="black")
    for i, r in enumerate(results):
        for j, side in enumerate(("plain", "lightning")):
            s = r[f"{side}_tokens_per_s"]
            ax1.annotate(f"{s['median']:,.0f}", (i + (j - 0.5) * 0.38, s["median"]), ha="center", va="bottom", fontsize=7)
    ax1.set_yscale("log")
    ax1.set_xticks(range(len(names)), names)
    ax1.set_ylabel("tokens/s (median, min–max)")
    ax1.legend(fontsize=8)
    ax1.set_title("training throughput")
    ax2.axhline(TARGET_RATIO, color="tab:red", ls="--", lw=1, label=f"target {TARGET_RATIO}")
    ax2.set_xticks(range(len(names)), names)
    ax2.set_xlim(-0.5, len(names) - 0.5)
    ax2.set_ylabel("Lightning / plain (per pair)")
    ax2.legend(fontsize=8)
    ax2.set_title("port overhead")
    parts = ["self.log", "logger", "our callbacks", "training_step extras", "Lightning loop, hooks, closure"]
    ms = at["ms_per_batch"]
    ax3.bar(0, ms["plain"]["loop"]["median"], 0.5, color="tab:gray", label="plain loop")
    bottom = 0.0
    for part in parts:
        value = max(0.0, ms["lightning"][part]["median"])
        ax3.bar(1, value, 0.5, bottom=bottom, label=part)
        bottom += value
    ax3.set_xticks([0, 1], ["plain", "Lightning"])
    ax3.set_ylabel("ms per micro-batch (median)")
    ax3.set_title(f"loop cost beyond the shared work\n({at['config']['name']})", fontsize=9)
    ax3.set_ylim(0, max(bottom, ms["plain"]["loop"]["median"]) * 2.0)
    ax3.legend(fontsize=7, loc="upper left")
    return save_figure(fig, path)


def profile_lightning(cfg: Config, data: Path, tok: Path, top: int = 25) -> str:
    """cProfile of one Lightning run and one plain run: where the extra per-batch time goes."""
    out = []
    for side in ("plain", "lightning"):
        one(side, cfg, data, tok)  # warm
        prof = cProfile.Profile()
        prof.enable()
        one(side, cfg, data, tok)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        out.append(f"===== {side}: {cfg.name} =====\n{buf.getvalue()}")
    return "\n".join(out)


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None, profile: bool = False,
        threads: int | None = None, compile: bool | None = None) -> dict[str, Any]:
    """``compile``: also measure ``--model.compile true`` (default: yes, except with ``quick``)."""
    threads = set_threads(threads)
    configs = QUICK_CONFIGS if quick else FULL_CONFIGS
    reps = reps or (2 if quick else 5)
    compile = not quick if compile is None else compile
    data, tok = default_data()
    say(f"== port overhead: Lightning vs plain PyTorch ({reps} alternating repetitions after warm-up, "
        f"{threads} torch thread(s)) ==")
    results = [measure(cfg, data, tok, reps) for cfg in configs]
    comp = compile_measure(COMPILE, data, tok, min(reps, COMPILE_REPS)) if compile else None
    at = attribution(QUICK_ATTRIBUTION if quick else ATTRIBUTION, data, tok, reps)  # last: the loop cost
    text = render(results)
    attribution_text = render_attribution(at)
    compile_text = render_compile(comp) if comp else ""
    notes = [f"- {r['config']['name']}: {r['config']['note']}" for r in results if r["config"]["note"]]
    say(text)
    for n in notes:
        say(n)
    if comp:
        say(f"\n--model.compile true vs eager, through Lightning ({len(comp['speedup']['values'])} alternating repetitions):")
        say(compile_text)
    say(f"\nwhere the time of a micro-batch goes ({at['config']['name']}, {reps} alternating repetitions):")
    say(attribution_text)
    overhead = at["lightning_minus_plain_loop_ms"]["median"]
    say(f"loop overhead: {overhead:+.3f} ms per micro-batch (target <= {TARGET_LOOP_OVERHEAD_MS}: "
        f"{'yes' if overhead <= TARGET_LOOP_OVERHEAD_MS else 'NO'}); by the mean over batches, which includes "
        f"the work done every log_interval: {at['lightning_minus_plain_loop_mean_ms']['median']:+.3f} ms")
    payload = {"benchmark": "overhead", "quick": quick, "reps": reps, "threads": threads, "environment": environment(),
               "data": rel(data), "tokenizer": rel(tok),
               # the port's cost per micro-batch over the plain loop (attribution run: Lightning's loop - plain's)
               "loop_overhead_ms": overhead, "loop_overhead_mean_ms": at["lightning_minus_plain_loop_mean_ms"]["median"],
               "loop_overhead_target_ms": TARGET_LOOP_OVERHEAD_MS,
               "loop_overhead_target_met": overhead <= TARGET_LOOP_OVERHEAD_MS,
               "results": results, "table": text, "notes": notes,
               "attribution": at, "attribution_table": attribution_text,
               "compile": comp if comp else {"skipped": "--quick" if quick else "--no-compile"},
               "compile_table": compile_text}
    write_json(results_dir / "overhead.json", payload)
    plot(results, at, results_dir / "overhead.png")
    if profile:
        report = "\n".join(profile_lightning(cfg, data, tok) for cfg in configs)
        write_text(results_dir / "overhead_profile.txt", report)
        say(f"profile written to {results_dir / 'overhead_profile.txt'}")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "alternating repetitions (default 5, quick 2)")
    parser.add_argument("--profile", action="store_true", help="also write a cProfile of each side")
    parser.add_argument("--no-compile", action="store_true", help="skip the --model.compile true runs (a minute of compiling)")
    args = parser.parse_args(argv)
    run(args.quick, args.results_dir, args.reps, args.profile, args.threads, compile=False if args.no_compile else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
