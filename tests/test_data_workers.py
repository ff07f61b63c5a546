"""DataLoader workers capped at the cores a process may use (issue 51): the ``minimind_pretrain`` preset's 8
workers on a 2-core machine made torch warn ("This DataLoader will create 8 worker processes in total") once
per loader. Real processes pinned to one core (``os.sched_setaffinity``), real DataLoaders with real workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.runs import cli_env

TORCH_WARNING = "worker processes in total"


def pinned_to_one_core(body: str) -> subprocess.CompletedProcess:
    """``body`` run by a fresh Python that first pins itself to one core (as ``taskset -c N`` would)."""
    code = "import os\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n" + textwrap.dedent(body)
    run = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


LOADERS = """
    import warnings
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lit_minimind.data.workers import capped_workers, usable_cores

    warnings.simplefilter("always")  # torch's UserWarning: on stderr each time it is raised
    data = TensorDataset(torch.arange(16))
    for loader in ("train", "val"):  # a DataModule's two loaders
        workers = {workers}
        batches = [b[0].tolist() for b in DataLoader(data, batch_size=4, num_workers=workers)]
        print(loader, usable_cores(), workers, sum(batches, []) == list(range(16)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins a process to one core (Linux)")
def test_eight_workers_on_one_core_are_one_said_in_one_line_without_torchs_warning() -> None:
    uncapped = pinned_to_one_core(LOADERS.format(workers="8"))  # what the preset did: torch warns per loader
    assert uncapped.stderr.count(TORCH_WARNING) >= 2, uncapped.stderr[-3000:]  # each loader's (at creation, at iter)

    run = pinned_to_one_core(LOADERS.format(workers="capped_workers(8)"))
    assert run.stdout.splitlines() == ["train 1 1 True", "val 1 1 True"], run.stdout
    assert TORCH_WARNING not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines == ["data: --data.num_workers 8 capped at 1: this process may use 1 CPU core"], run.stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins a process to one core (Linux)")
def test_what_fits_is_kept_and_other_ranks_cap_in_silence() -> None:
    run = pinned_to_one_core("""
        from lit_minimind.data.workers import capped_workers
        print(capped_workers(0), capped_workers(1), capped_workers(4, rank=1), capped_workers(4, rank=1))
    """)
    assert run.stdout.split() == ["0", "1", "1", "1"] and not run.stderr.strip(), (run.stdout, run.stderr[-3000:])
