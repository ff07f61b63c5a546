"""What the benchmarks share: paths, statistics, tables, plots, the one subprocess runner (:func:`launch`) and the one
command line (:func:`bench_main`). A benchmark module defines ``NAME``, ``run(quick, reps, **ARGS) -> payload`` (tables
under keys ending in ``table``/``verdict``) and optionally ``plot(payload, path)``; :func:`execute` runs it, prints its
tables and writes ``results/<NAME>.json`` (+ ``.png``)."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib
import json
import os
import platform
import re
import selectors
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from lit_minimind.checkpoint.atomic import atomic_open, atomic_write_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# MiniMind's console line: epoch, epochs, step, iters, loss, logits_loss, aux_loss, lr
CONSOLE_LINE_RE = re.compile(r"Epoch:\[(\d+)/(\d+)\]\((\d+)/(\d+)\), loss: ([\d.]+), logits_loss: ([\d.]+), "
                             r"aux_loss: ([\d.]+), lr: ([\d.]+)")
SOUP_WORDS = ("the model data token layer attention resume checkpoint step a of and in to is that for it with as was on "
              "训练 数据 模型 语言 的 是 在 \"quoted\" tab\there line\nbreak back\\slash").split(" ")


class BenchError(RuntimeError):
    """A benchmark that cannot run here: one line on stderr, exit status 2."""


def cache_dir() -> Path:
    """Generated inputs (corpus, tokenizer, jsonl files): ``$LIT_MINIMIND_CACHE`` or ``<repo>/.cache``, as the tests use."""
    env = os.environ.get("LIT_MINIMIND_CACHE")
    path = Path(env).expanduser() if env else ROOT / ".cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def rel(path: Path | str) -> str:
    """``path`` relative to the repository when inside it (results files carry no machine paths)."""
    return str(Path(path).resolve().relative_to(ROOT)) if Path(path).resolve().is_relative_to(ROOT) else str(path)


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
    soup = " ".join(np.array(SOUP_WORDS, dtype=object)[rng.integers(0, len(SOUP_WORDS), size=max(2_000_000, max_chars))])
    starts, lengths = rng.integers(0, len(soup) - max_chars, size=records), rng.integers(min_chars, max_chars + 1, size=records)
    with atomic_open(path, "w") as f:
        for first in range(0, records, 20_000):
            f.write("".join(json.dumps({"text": soup[s:s + n]}, ensure_ascii=False) + "\n" for s, n in
                            zip(starts[first:first + 20_000].tolist(), lengths[first:first + 20_000].tolist())))
    return path


def stats(values: Sequence[float]) -> dict[str, Any]:
    """min / median / max (and the raw values, in measurement order)."""
    vals = [float(v) for v in values]
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals), "values": vals}


def spread(s: dict[str, Any], digits: int = 3) -> str:
    """``median (min–max)``."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def alternating(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated by ``rep``: every item runs first, last and in between equally often (load drift cancels)."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def fmt_num(x: float, digits: int = 3) -> str:
    return "0" if x == 0 else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}g}"


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

    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "python": platform.python_version(),
            "torch": torch.__version__, "lightning": lightning.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "loadavg_at_start": os.getloadavg()}


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    return atomic_write_bytes(json.dumps(payload, indent=1, default=str) + "\n", path)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path


def say(*args: Any) -> None:
    print(*args, flush=True)


def set_threads(n: int | None) -> int:
    """Pin torch's intra-op threads, and those of child processes, to ``n`` (default 1).

    On a small shared machine, 2 OpenMP threads next to another busy process make a matmul 10-15x slower
    whenever one thread is descheduled at a barrier; one thread per process keeps the ratios stable."""
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


def fit_cmd(work: Path, data: Path, tok: Path, flags: dict[str, Any], *extra: str) -> list[str]:
    """``python -m lit_minimind.fit`` training in ``work`` on ``data``: quiet, CPU, no save, then ``flags``
    (``{"model.hidden_size": 64}`` -> ``--model.hidden_size 64``) and ``extra`` (``--trainer.callbacks+=...``)."""
    base: dict[str, Any] = {
        "data.data_path": data, "data.tokenizer_path": tok, "trainer.accelerator": "cpu", "trainer.devices": 1,
        "trainer.max_epochs": 1, "trainer.enable_progress_bar": "false", "trainer.enable_model_summary": "false",
        "trainer.default_root_dir": work, "log_interval": 1000, "resume.save_interval": 10**9,
        "resume.out_dir": work / "out", "resume.ckpt_dir": work / "checkpoints", **flags}
    return [sys.executable, "-m", "lit_minimind.fit", *(a for k, v in base.items() for a in (f"--{k}", str(v))), *extra]


def probe(**init_args: Any) -> list[str]:
    """The flags that add :class:`benchmarks.probes.Probe` (with these init args) to the CLI's callbacks."""
    fmt = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    return ["--trainer.callbacks+=benchmarks.probes.Probe", *(f"--trainer.callbacks.{k}={fmt(v)}" for k, v in init_args.items())]


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def lines_as_read(proc: subprocess.Popen) -> Iterator[tuple[float, str]]:
    """``(time.monotonic(), line)`` of both pipes, each line stamped when its bytes arrive (unbuffered reads)."""
    sel = selectors.DefaultSelector()
    pending = {}
    for stream in (proc.stdout, proc.stderr):
        sel.register(stream.fileno(), selectors.EVENT_READ)  # type: ignore[union-attr]
        pending[stream.fileno()] = b""  # type: ignore[union-attr]
    try:
        while pending:
            for key, _ in sel.select():
                fd = int(key.fd)
                chunk, now = os.read(fd, 1 << 16), time.monotonic()
                if not chunk:
                    sel.unregister(fd)
                    if rest := pending.pop(fd):
                        yield now, rest.decode(errors="replace")
                    continue
                *complete, pending[fd] = (pending[fd] + chunk).split(b"\n")
                for raw in complete:
                    yield now, raw.decode(errors="replace") + "\n"
    finally:
        sel.close()


def launch(cmd: Sequence[str], work: Path, env: dict[str, str] | None = None, timeout: float = 900, until: Any = None,
           check: bool = True) -> dict[str, Any]:
    """The one runner: ``cmd`` in ``work`` (its own session), both pipes read as lines come. ``@@bench {json}`` lines
    (:mod:`benchmarks.probes`) become ``events`` (``t``: seconds after launch); every other line is kept with its
    time. ``until(line)`` true (any line): the process group is SIGKILLed there (``stopped``). CPU time from ``wait4``."""
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(list(cmd), cwd=work, env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    timer = threading.Timer(timeout, kill_group, (proc.pid,))
    timer.start()
    events, lines, stopped = [], [], False
    try:
        for now, line in lines_as_read(proc):
            if line.startswith("@@bench "):
                event = json.loads(line[len("@@bench "):])
                events.append({**event, "t": event["t"] - start})
            else:
                lines.append((now - start, line))
            if until is not None and until(line):
                stopped = True
                break
    finally:
        timer.cancel()
        if stopped:
            kill_group(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    if check and not stopped and (proc.returncode != 0 or wall >= timeout):
        tail = "".join(text for _, text in lines[-30:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}, {wall:.0f} s) in {work}:\n{tail}")
    return {"returncode": proc.returncode, "events": events, "lines": lines, "stopped": stopped, "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime}


def event(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((e for e in run["events"] if e["event"] == name), None)


def console(run: dict[str, Any]) -> dict[str, list[str]]:
    """The run's MiniMind console lines: ``"epoch:step" -> [loss, logits_loss, aux_loss, lr]``."""
    return {f"{m[1]}:{m[3]}": [m[5], m[6], m[7], m[8]] for _, line in run["lines"] if (m := CONSOLE_LINE_RE.search(line))}


# --------------------------------------------------------------------------- one command line for every benchmark


def execute(module: ModuleType, results_dir: Path = RESULTS_DIR, quick: bool = False, reps: int | None = None,
            threads: int | None = None, **extra: Any) -> dict[str, Any]:
    """Run one benchmark module, print its tables, write ``<NAME>.json`` (and its plot) under ``results_dir``."""
    threads = set_threads(threads)
    env = environment()
    say(f"== {module.__doc__.splitlines()[0].rstrip('.')} ({'--quick: toy size' if quick else 'full size'}, {threads} torch thread(s)) ==")
    payload = module.run(quick=quick, reps=reps, **extra)
    payload = {"benchmark": module.NAME, "quick": quick, "threads": threads, "environment": env, **payload}
    for key, value in payload.items():
        if key.endswith(("table", "verdict")) and value:
            say(value)
    write_json(results_dir / f"{payload.get('results_file', module.NAME)}.json", payload)
    for name, part in payload.get("also_written", {}).items():  # a second results file from the same runs
        write_json(results_dir / f"{name}.json", {"benchmark": name, "quick": quick, "environment": env, **part})
    if hasattr(module, "plot"):
        module.plot(payload, results_dir / f"{module.NAME}.png")
    return payload


def bench_main(module: ModuleType, argv: list[str] | None = None) -> int:
    """``python -m benchmarks.<name> [--quick] [--reps N] [--results-dir DIR] [--threads N] [the module's ARGS]``."""
    parser = argparse.ArgumentParser(description=module.__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy size (smoke test; numbers mean nothing)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (each benchmark has its default)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default 1)")
    for flags, kwargs in getattr(module, "ARGS", ()):
        parser.add_argument(*flags, **kwargs)
    try:
        payload = execute(module, **vars(parser.parse_args(argv)))
    except BenchError as err:
        print(err, file=sys.stderr)
        return 2
    return int(payload.get("exit_status", 0))
