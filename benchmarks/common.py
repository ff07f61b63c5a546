"""Helpers shared by the benchmarks: paths, statistics, tables, JSON and plots."""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import io
import json
import logging
import os
import platform
import re
import statistics
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import atomic_open, atomic_write_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cache_dir() -> Path:
    """Where generated inputs (corpus, tokenizer, the 1M-line jsonl) are cached.

    ``$LIT_MINIMIND_CACHE`` if set, else ``<repo>/.cache`` (git-ignored), as the tests use.
    """
    env = os.environ.get("LIT_MINIMIND_CACHE")
    path = Path(env).expanduser() if env else ROOT / ".cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def rel(path: Path | str) -> str:
    """``path`` relative to the repository when inside it (results files carry no machine paths)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def default_data() -> tuple[Path, Path]:
    """``(jsonl, tokenizer_dir)`` of the embedded default (pydoc corpus + project BPE), built once."""
    from lit_minimind.data.corpus import write_embedded_corpus
    from lit_minimind.data.tokenizer import build_default_tokenizer

    cache = cache_dir()
    return write_embedded_corpus(cache), build_default_tokenizer(cache)


def stats(values: Sequence[float]) -> dict[str, Any]:
    """min / median / max (and the raw values, in measurement order)."""
    vals = [float(v) for v in values]
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals), "n": len(vals), "values": vals}


def alternating(items: Sequence[Any], rep: int) -> list[Any]:
    """The order of ``items`` in repetition ``rep``: rotated each time, so every item
    runs first, last and in between equally often (drift in machine load cancels out)."""
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def fmt_num(x: float, digits: int = 3) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (also readable as plain text)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    out = [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    import lightning
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": load,
    }


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    return atomic_write_bytes(json.dumps(payload, indent=1, default=str) + "\n", path)


def write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(text, path)


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Silence stdout, warnings and Lightning's info logging while a measured run goes on."""
    sink = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield sink
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def say(*args: Any) -> None:
    print(*args, flush=True, file=sys.stdout)


DEFAULT_THREADS = 1


def set_threads(n: int | None) -> int:
    """Pin torch's intra-op threads (and those of child processes) to ``n`` (default 1).

    On a small shared machine, 2 OpenMP threads next to another busy process make a matmul
    10-15x slower whenever one thread is descheduled at a barrier; one thread per process
    keeps the ratios measured here stable. Pass ``--threads`` to measure with more.
    """
    import torch

    n = n or DEFAULT_THREADS
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ["MKL_NUM_THREADS"] = str(n)
    return n


def bench_parser(doc: str, reps_help: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes: --quick, --reps, --results-dir, --threads."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy size (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help=reps_help)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    return parser


# MiniMind's console line (lit_minimind's console prints it unchanged): epoch, epochs, step, iters, loss,
# logits_loss, aux_loss, lr
CONSOLE_LINE_RE = re.compile(r"Epoch:\[(\d+)/(\d+)\]\((\d+)/(\d+)\), loss: ([\d.]+), logits_loss: ([\d.]+), "
                             r"aux_loss: ([\d.]+), lr: ([\d.]+)")
SOUP_WORDS = ("the model data token layer attention resume checkpoint step a of and in to is that for it with as was on "
              "训练 数据 模型 语言 的 是 在 \"quoted\" tab\there line\nbreak back\\slash").split(" ")


def synthetic_jsonl(records: int, min_chars: int, max_chars: int, seed: int = 1234, path: Path | None = None) -> Path:
    """The benchmarks' one corpus generator: ``records`` seeded ``{"text"}`` lines of ``min_chars`` to
    ``max_chars`` characters, slices at random offsets of a seeded word soup (ASCII, CJK, quotes, tabs,
    newlines, backslashes). Written atomically to ``path``, or once into the cache directory."""
    import numpy as np

    if path is None:
        path = cache_dir() / f"bench-soup-{records}-{min_chars}-{max_chars}-{seed}-v1.jsonl"
        if path.is_file():
            return path
    rng = np.random.default_rng(seed)
    soup = " ".join(np.array(SOUP_WORDS, dtype=object)[rng.integers(0, len(SOUP_WORDS), size=max(2_000_000, max_chars))])
    starts = rng.integers(0, len(soup) - max_chars, size=records)
    lengths = rng.integers(min_chars, max_chars + 1, size=records)
    with atomic_open(path, "w") as f:
        for first in range(0, records, 20_000):
            f.write("".join(json.dumps({"text": soup[s:s + n]}, ensure_ascii=False) + "\n"
                            for s, n in zip(starts[first:first + 20_000].tolist(), lengths[first:first + 20_000].tolist())))
    return path
