"""What the benchmarks share: paths, generated inputs, statistics, tables, plots and the one subprocess runner
(:func:`launch`). A benchmark module defines ``NAME``, a docstring (first line: its title; the rest: what it measures,
the intro of its section in ``summary.md``), ``run(quick, reps, **ARGS) -> payload`` (tables under keys ending in
``table``/``verdict``) and optionally ``plot(payload, path)``; :func:`benchmarks.run_all.main` runs it."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import atomic_open

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# MiniMind's console line: epoch, epochs, step, iters, loss, logits_loss, aux_loss, lr
CONSOLE_LINE_RE = re.compile(r"Epoch:\[(\d+)/(\d+)\]\((\d+)/(\d+)\), loss: ([\d.]+), logits_loss: ([\d.]+), "
                             r"aux_loss: ([\d.]+), lr: ([\d.]+)")
SOUP_WORDS = ("the model data token layer attention resume checkpoint step a of and in to is that for it with as was "
              "on 训练 数据 模型 语言 的 是 在 \"quoted\" tab\there line\nbreak back\\slash").split(" ")


class BenchError(RuntimeError):
    """A benchmark that cannot run here: one line on stderr, exit status 2."""


def cache_dir() -> Path:
    """Generated inputs (corpus, tokenizer, jsonl files): ``$LIT_MINIMIND_CACHE`` or ``<repo>/.cache``."""
    env = os.environ.get("LIT_MINIMIND_CACHE")
    path = Path(env).expanduser() if env else ROOT / ".cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def workdir(name: str) -> Iterator[Path]:
    """A temporary directory ``bench-<name>-*`` in the cache, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-", dir=cache_dir(), ignore_cleanup_errors=True) as tmp:
        yield Path(tmp)


def rel(path: Path | str) -> str:
    """``path`` relative to the repository when inside it (results files carry no machine paths)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def default_data() -> tuple[Path, Path]:
    """``(jsonl, tokenizer_dir)`` of the embedded default (pydoc corpus + project BPE), built once."""
    from lit_minimind.data.corpus import write_embedded_corpus
    from lit_minimind.data.tokenizer import build_default_tokenizer

    return write_embedded_corpus(cache_dir()), build_default_tokenizer(cache_dir())


def synthetic_jsonl(records: int, min_chars: int, max_chars: int, seed: int = 1234, path: Path | None = None) -> Path:
    """``records`` seeded ``{"text"}`` lines of ``min_chars``-``max_chars`` characters, slices of a seeded word soup
    (ASCII, CJK, quotes, tabs, newlines, backslashes); written atomically to ``path``, or once into the cache."""
    import numpy as np

    if path is None:
        path = cache_dir() / f"bench-soup-{records}-{min_chars}-{max_chars}-{seed}-v1.jsonl"
        if path.is_file():
            return path
    rng = np.random.default_rng(seed)
    words = np.array(SOUP_WORDS, dtype=object)[rng.integers(0, len(SOUP_WORDS), size=max(2_000_000, max_chars))]
    soup = " ".join(words)
    starts = rng.integers(0, len(soup) - max_chars, size=records).tolist()
    lengths = rng.integers(min_chars, max_chars + 1, size=records).tolist()
    with atomic_open(path, "w") as f:
        for first in range(0, records, 20_000):
            f.write("".join(json.dumps({"text": soup[s:s + n]}, ensure_ascii=False) + "\n"
                            for s, n in zip(starts[first:first + 20_000], lengths[first:first + 20_000])))
    return path


def proc_field(name: str, field: str) -> int:
    """The number of ``field`` in ``/proc/self/<name>`` (``status``: kB, ``io``: bytes)."""
    with open(f"/proc/self/{name}") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def stats(values: Sequence[Any], key: str | None = None) -> dict[str, Any]:
    """min / median / max (and the raw values, in measurement order) of ``values``, or of their ``key``."""
    vals = [float(v[key] if key else v) for v in values]
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals), "values": vals}


def ratios(tops: Sequence[Any], bottoms: Sequence[Any], key: str | None = None) -> dict[str, Any]:
    """:func:`stats` of ``top / bottom`` within each repetition (of their ``key`` where given)."""
    return stats([(a[key] / b[key]) if key else a / b for a, b in zip(tops, bottoms)])


def alternating(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated by ``rep``: every item runs first, last and in between equally often (load drift cancels)."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def rotated(variants: Sequence[Any], reps: int, measure: Callable[[Any], Any], warmup: Sequence[Any] = (),
            note: Callable[[Any], str] | None = None) -> dict[Any, list[Any]]:
    """``measure(variant)`` of every variant ``reps`` times, in :func:`alternating` order, after an unrecorded call of
    each in ``warmup``: each variant's results in repetition order (``note(result)``: a progress line)."""
    for variant in warmup:
        measure(variant)
    runs: dict[Any, list[Any]] = {v: [] for v in variants}
    for rep in range(reps):
        for variant in alternating(variants, rep):
            runs[variant].append(result := measure(variant))
            if note:
                say(f"  rep {rep + 1}/{reps} {variant}: {note(result)}")
    return runs


def python_with(modules: str, *candidates: str | None) -> str | None:
    """The first of ``candidates`` (Python executables; None skipped) that can ``import modules``."""
    for python in filter(None, candidates):
        if subprocess.run([python, "-c", f"import {modules}"], capture_output=True).returncode == 0:
            return python
    return None


def byte_rates(mib: int) -> dict[str, float]:
    """GB/s of per-byte work on this machine (best of 3): sha256, ``zlib.crc32`` on ``mib`` MiB and on a 1 MiB buffer
    (in cache), a memory copy."""
    import hashlib
    import timeit
    import zlib

    big, small = os.urandom(mib << 20), os.urandom(1 << 20)
    work = {"sha256": (big, lambda b: hashlib.sha256(b).digest()), f"crc32 (zlib), {mib} MiB": (big, zlib.crc32),
            "crc32 (zlib), 1 MiB (in cache)": (small, zlib.crc32), "memory copy": (big, bytearray)}
    out = {}
    for name, (buf, fn) in work.items():
        repeat = max(1, (64 << 20) // len(buf))
        out[name] = len(buf) * repeat / min(timeit.timeit(lambda: fn(buf), number=repeat) for _ in range(3)) / 1e9
    return out


def fmt_num(x: float, digits: int = 3) -> str:
    return "0" if x == 0 else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}g}"


def spread(s: dict[str, Any], digits: int = 3, fmt: Callable[[float], str] | None = None) -> str:
    """``median (min–max)``, each with ``digits`` decimals or through ``fmt``."""
    f = fmt or (lambda x: f"{x:.{digits}f}")
    return f"{f(s['median'])} ({f(s['min'])}–{f(s['max'])})"


def yes(met: bool) -> str:
    return "yes" if met else "NO"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable as plain text)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])])


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    import lightning
    import torch

    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "loadavg_at_start": os.getloadavg()}


def chart(path: Path, *panels: tuple, width: float = 10) -> Path:
    """A figure of horizontal-bar panels side by side, each ``(title, xlabel, rows)``, rows top to bottom. A row
    ``(label, value, extra)``: ``value`` a number or a :func:`stats` dict (a bar at the median, min–max as its error
    bar) in colour ``extra``, or a dict of segments stacked from ``extra`` (a colour per segment)."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    stacked = lambda v: isinstance(v, dict) and "median" not in v
    segments = lambda rows: list(dict.fromkeys(k for _, v, _ in rows if stacked(v) for k in v))
    height = 1.2 + max(0.3 * len(p[2]) + 0.12 * len(segments(p[2])) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, height), squeeze=False)
    for ax, (title, xlabel, rows) in zip(axes[0], panels):
        names = segments(rows)
        for y, (_, value, extra) in enumerate(rows):
            if stacked(value):
                for k, v in value.items():
                    ax.barh(y, v, left=extra, color=f"C{names.index(k) % 10}")
                    extra += v
            else:
                s = value if isinstance(value, dict) else {"median": value, "min": value, "max": value}
                ax.barh(y, s["median"], color=extra or "tab:blue", capsize=2,
                        xerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]])
        ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set(xlabel=xlabel, title=title)
        if names:
            handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i % 10}") for i in range(len(names))]
            ax.legend(handles, names, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def say(*args: Any) -> None:
    print(*args, flush=True)


def set_threads(n: int | None) -> int:
    """Pin torch's intra-op threads, and those of child processes, to ``n`` (default 1): on a small shared machine
    2 OpenMP threads next to a busy process make a matmul 10-15x slower (a thread descheduled at a barrier)."""
    import torch

    n = n or 1
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    return n


# --------------------------------------------------------------------------- the CLI in a subprocess


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIT_MINIMIND_TEST")}
    env.update({"PYTHONPATH": str(ROOT), "LIT_MINIMIND_CACHE": str(cache_dir()), "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", **extra})
    return env


def fit_cmd(work: Path, data: Path, tok: Path, shape: Sequence[int], flags: dict[str, Any], *extra: str) -> list[str]:
    """``python -m lit_minimind.fit`` training in ``work`` on ``data``: quiet, CPU, no save, the model and batch
    ``shape`` (hidden size, layers, sequence length, batch size), then ``flags`` (``{"log_interval": 1}`` ->
    ``--log_interval 1``) and ``extra`` (``--trainer.callbacks+=...``)."""
    base: dict[str, Any] = {
        "data.data_path": data, "data.tokenizer_path": tok, "trainer.accelerator": "cpu", "trainer.devices": 1,
        "trainer.max_epochs": 1, "trainer.enable_progress_bar": "false", "trainer.enable_model_summary": "false",
        "trainer.default_root_dir": work, "log_interval": 1000, "resume.save_interval": 10**9,
        "resume.out_dir": work / "out", "resume.ckpt_dir": work / "checkpoints",
        **dict(zip(("model.hidden_size", "model.num_hidden_layers", "data.max_seq_len", "data.batch_size"), shape)),
        **flags}
    return [sys.executable, "-m", "lit_minimind.fit", *(a for k, v in base.items() for a in (f"--{k}", str(v))), *extra]


def probe(**init_args: Any) -> list[str]:
    """The flags that add :class:`benchmarks.probes.Probe` (with these init args) to the CLI's callbacks."""
    fmt = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    return ["--trainer.callbacks+=benchmarks.probes.Probe",
            *(f"--trainer.callbacks.{k}={fmt(v)}" for k, v in init_args.items())]


def launch(cmd: Sequence[str], work: Path, env: dict[str, str] | None = None, timeout: float = 900, until: Any = None,
           check: bool = True, signal_at: tuple[float, int] | None = None) -> dict[str, Any]:
    """The one runner: ``cmd`` in ``work`` (its own session), both pipes read line by line, each line stamped when it
    arrives. ``@@bench {json}`` lines (:mod:`benchmarks.probes`) become ``events`` (``t``: seconds after launch);
    every other line is kept with its time. ``until(line)`` true: the process group is SIGKILLed there
    (``stopped``). ``signal_at=(seconds, signum)``: that signal to the process group then, if it still runs
    (``signalled_s``: when). CPU time from ``wait4``."""
    work.mkdir(parents=True, exist_ok=True)
    start, arrived, signalled = time.monotonic(), queue.SimpleQueue(), []
    proc = subprocess.Popen(list(cmd), cwd=work, env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)

    def deliver(signum: int, record: bool = True) -> None:
        with contextlib.suppress(ProcessLookupError):  # no poll(): it could reap the child before wait4 below
            os.killpg(proc.pid, signum)
            if record:
                signalled.append(time.monotonic() - start)

    def pump(stream: Any) -> None:
        for raw in stream:
            arrived.put((time.monotonic() - start, raw.decode(errors="replace")))
        arrived.put(None)

    for stream in (proc.stdout, proc.stderr):
        threading.Thread(target=pump, args=(stream,), daemon=True).start()
    timers = [threading.Timer(timeout, deliver, (signal.SIGKILL, False))]
    if signal_at:
        timers.append(threading.Timer(max(0.0, signal_at[0]), deliver, (signal_at[1],)))
    for timer in timers:
        timer.start()
    events, lines, stopped, open_pipes = [], [], False, 2
    try:
        while open_pipes and not stopped:
            if (item := arrived.get()) is None:
                open_pipes -= 1
            elif item[1].startswith("@@bench "):
                event = json.loads(item[1][len("@@bench "):])
                events.append({**event, "t": event["t"] - start})
            else:
                lines.append(item)
                stopped = until is not None and bool(until(item[1]))
    finally:
        for timer in timers:
            timer.cancel()
        if stopped:
            deliver(signal.SIGKILL, record=False)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    if check and not stopped and (proc.returncode != 0 or wall >= timeout):
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}, {wall:.0f} s) in {work}:\n"
                           + tail(lines))
    return {"returncode": proc.returncode, "events": events, "lines": lines, "stopped": stopped, "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime, "signalled_s": signalled[0] if signalled else None}


def tail(lines: list[tuple[float, str]], n: int = 30) -> str:
    """The last ``n`` lines a run printed."""
    return "".join(text for _, text in lines[-n:])


def event(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((e for e in run["events"] if e["event"] == name), None)


def console(run: dict[str, Any]) -> dict[str, list[str]]:
    """The run's MiniMind console lines: ``"epoch:step" -> [loss, logits_loss, aux_loss, lr]``."""
    found = (CONSOLE_LINE_RE.search(line) for _, line in run["lines"])
    return {f"{m[1]}:{m[3]}": [m[5], m[6], m[7], m[8]] for m in found if m}
