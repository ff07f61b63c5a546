"""What the benchmarks put into a training run (:class:`Probe`, a callback given on the CLI's command line:
``--trainer.callbacks+=benchmarks.probes.Probe``), and the plain PyTorch loop they compare it with (:func:`plain_loop`,
``python -m benchmarks.probes '{json}'``). Public hooks only (Lightning's callback hooks, torch's forward and optimizer
step hooks, ``ResumeCallback.manager.save_seconds`` / ``last_model_path``). Both print ``@@bench {json}`` lines (``t``:
``time.monotonic()``): ``init``, ``setup``, ``train_start``, the first ``batch_start`` (``reads``: dataset reads before
it, counted by ``sys.setprofile``) and ``batch_end``, ``committed`` (``kill_after_commit``: the first save is written,
the process group is SIGKILLed) and ``end`` (every batch's ``marks``, the saves, the last loss, the device's facts).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import sys
import time
from typing import Any

import lightning as L
import torch


def emit(name: str, **info: Any) -> None:
    print("@@bench " + json.dumps({"event": name, "t": time.monotonic(), **info}), flush=True)


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Marks:
    """Per-batch ``(name, perf_counter)`` stamps and ``(wall, process CPU)`` batch ends, kept the same on both sides."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, float]]] = [[]]
        self.ends: list[tuple[float, float]] = []

    def mark(self, name: str) -> None:
        self.batches[-1].append((name, time.perf_counter()))

    def end_batch(self) -> None:
        self.mark("batch end")
        self.ends.append((time.perf_counter(), time.process_time()))
        self.batches.append([])

    def hook(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.register_forward_pre_hook(lambda *_: self.mark("forward["))
        model.register_forward_hook(lambda *_: self.mark("forward]"))
        optimizer.register_step_post_hook(lambda *_: self.mark("step]"))

    def end(self, model: torch.nn.Module, loader: Any, data_batches: int, **info: Any) -> None:
        """The ``end`` event: the marks, :func:`data_ms` over ``loader`` (``data_batches`` > 0), the device's facts."""
        cuda, loader_ms = torch.cuda.is_available() and torch.cuda.is_initialized(), None
        if data_batches:
            loader_ms = data_ms(loader, data_batches)
        emit("end", marks=self.batches[:-1], ends=self.ends, data_ms=loader_ms,
             params=int(sum(p.numel() for p in model.parameters())),
             device=torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
             peak_memory_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
             deterministic=torch.are_deterministic_algorithms_enabled(),
             deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(), **info)


def data_ms(loader: Any, batches: int) -> float | None:
    """ms per batch of ``next()`` on a fresh iterator of ``loader`` after its first batch (the data work, alone)."""
    it = iter(loader)
    next(it)
    start, n = time.perf_counter(), 0
    for n, _ in zip(range(1, batches + 1), it):
        pass
    return 1000 * (time.perf_counter() - start) / n if n else None


class Probe(L.Callback):
    """``stamps``: the hook marks; ``warmup``: the device is synchronized at the end of that micro-batch and of the one
    reaching ``max_steps`` (and before a save, every ``sync_every`` steps); ``count_reads``; ``kill_after_commit``;
    ``data_batches``: at the end, :func:`data_ms` over the run's train dataloader."""

    def __init__(self, stamps: bool = False, warmup: int = 0, sync_every: int = 0, count_reads: bool = False,
                 kill_after_commit: bool = False, data_batches: int = 0) -> None:
        self.stamps, self.warmup, self.sync_every, self.count_reads = stamps, warmup, sync_every, count_reads
        self.kill_after_commit, self.data_batches = kill_after_commit, data_batches
        self.marks, self.saves, self.reads, self.tokens, self.last_path = Marks(), [], 0, 0, ""
        emit("init")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        emit("setup")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        emit("train_start")
        if self.stamps:
            self.marks.hook(pl_module.model, trainer.optimizers[0])
        if self.count_reads:  # calls of the dataset's __getitem__ until the first batch starts (a profile hook)
            code = type(trainer.datamodule.train_dataset).__getitem__.__code__

            def count(frame: Any, what: str, arg: Any) -> None:
                if what == "call" and frame.f_code is code:
                    self.reads += 1
            sys.setprofile(count)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.marks.ends:
            sys.setprofile(None)
            emit("batch_start", reads=self.reads, batch_idx=batch_idx)
        self.saved(trainer)
        self.marks.mark("batch start")

    on_before_backward = lambda self, *_: self.marks.mark("backward[")  # noqa: E731
    on_after_backward = lambda self, *_: self.marks.mark("backward]")  # noqa: E731
    on_before_optimizer_step = lambda self, *_: self.marks.mark("step[")  # noqa: E731  (then clipping, the update)
    on_before_zero_grad = lambda self, *_: self.marks.mark("zero_grad")  # noqa: E731

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Runs before the CLI's own callbacks (LightningCLI appends them after the command line's), ResumeCallback
        last: the console line and a save fall after this stamp."""
        step = trainer.global_step
        if len(self.marks.ends) + 1 == self.warmup or step == trainer.max_steps or (
                self.sync_every and step % self.sync_every == 0):
            sync()
        self.marks.end_batch()
        self.saved(trainer)
        self.tokens = int(batch[1].numel())
        if len(self.marks.ends) == 1:
            emit("batch_end", batch_idx=batch_idx)

    def saved(self, trainer: L.Trainer) -> None:
        """Record a save ResumeCallback took since the last look; with ``kill_after_commit``, die once it is written."""
        cb = trainer.checkpoint_callback
        if cb is None or not cb.last_model_path:
            return
        if cb.last_model_path != self.last_path:
            self.last_path = cb.last_model_path
            self.saves.append({"batch": len(self.marks.ends), "global_step": trainer.global_step,
                               "s": cb.manager.save_seconds[0], "async": bool(cb.manager.async_save), "path": cb.last_model_path})
        # the first save's files are written: its publish set save_seconds[1], or a second save began (one in flight)
        if self.kill_after_commit and (len(self.saves) > 1 or cb.manager.save_seconds[1] is not None):
            emit("committed", path=self.saves[0]["path"])
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.saved(trainer)
        self.marks.end(pl_module.model, trainer.train_dataloader, self.data_batches, saves=self.saves,
                       last_loss=float(pl_module.last_stats["loss"]), tokens_per_batch=self.tokens,
                       global_step=trainer.global_step, precision=str(trainer.precision))


def plain_loop(cfg: dict[str, Any]) -> None:
    """MiniMind's ``train_epoch`` in plain PyTorch: the same model (seed 42), batches (MiniMind's per-epoch
    permutation), AdamW (weight decay 0.01), LR rule (cosine per micro-batch), accumulation (loss / N), clipping (1.0)
    and console line as the port; ``precision`` ``32-true`` or ``bf16-mixed`` (autocast around forward and loss);
    deterministic algorithms, as the port's default. Stamps the :class:`Marks` :class:`Probe` does."""
    from torch.utils.data import DataLoader

    from lit_minimind.callbacks.console import format_minimind_line
    from lit_minimind.data.dataset import PretrainDataset
    from lit_minimind.data.sampler import SkipBatchSampler, epoch_permutation
    from lit_minimind.data.tokenizer import load_tokenizer
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.module import minimind_lr

    emit("init")
    batches, accumulate, device = cfg["batches"], cfg["accumulate"], "cuda" if cfg["accelerator"] == "gpu" else "cpu"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as the port's default Trainer(deterministic=True)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.manual_seed(42)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=cfg["hidden_size"],
                                               num_hidden_layers=cfg["num_hidden_layers"])).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["learning_rate"], weight_decay=0.01)
    dataset = PretrainDataset(cfg["data"], load_tokenizer(cfg["tokenizer"]), max_length=cfg["max_seq_len"])
    loader = DataLoader(dataset, batch_sampler=SkipBatchSampler(epoch_permutation(len(dataset), 0), cfg["batch_size"]),
                        num_workers=cfg["num_workers"], pin_memory=device == "cuda")
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if cfg["precision"] == "bf16-mixed" \
        else contextlib.nullcontext
    marks = Marks()
    if cfg["stamps"]:
        marks.hook(model, optimizer)
    iters, total = len(loader), min(len(loader), batches)  # the LR rule's T, as LitMiniMind computes it with max_steps
    model.train()
    epoch_start = time.perf_counter()
    for step, (x, y) in enumerate(loader, start=1):
        marks.mark("batch start")
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        lr = minimind_lr(step, total, cfg["learning_rate"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        with autocast():
            out = model(x, labels=y)
            loss = out.loss + out.aux_loss
        marks.mark("backward[")
        (loss / accumulate).backward()
        marks.mark("backward]")
        if step % accumulate == 0:
            marks.mark("step[")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            marks.mark("zero_grad")
            optimizer.zero_grad(set_to_none=True)
        if step % cfg["log_interval"] == 0:
            spent = time.perf_counter() - epoch_start
            print(format_minimind_line(0, 1, step, iters, loss.item(), out.loss.item(), float(out.aux_loss), lr,
                                       spent / step * (iters - step) // 60), flush=True)
        if device == "cuda" and step in (cfg["warmup_batches"], batches):
            sync()
        marks.end_batch()
        if step == 1:
            emit("batch_end", batch_idx=0)
        if step == batches:
            break
    marks.end(model, loader, cfg["data_batches"], saves=[], last_loss=float(loss.detach()),
              tokens_per_batch=int(y.numel()), global_step=step // accumulate, precision=cfg["precision"])


if __name__ == "__main__":
    plain_loop(json.loads(sys.argv[1]))
