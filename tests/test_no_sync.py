"""No host-device sync inside a micro-batch, outside MiniMind's log interval: on a GPU each one
stalls the pipeline. Counted on CPU by wrapping every tensor method that hands a value to Python."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.runs import need_shared, run_cli, tiny_args


def sync_counts(run_dir: Path) -> dict[int, dict[str, list[str]]]:
    return {r["rank"]: r["counts"] for r in (json.loads(p.read_text()) for p in run_dir.glob("syncs_rank*.json"))}


@pytest.mark.parametrize(("moe", "devices"), [(False, 1), (True, 1), pytest.param(False, 2, marks=pytest.mark.slow),
                                               pytest.param(True, 2, marks=pytest.mark.slow)])
def test_micro_batches_between_log_lines_do_not_sync(tmp_path: Path, moe: bool, devices: int) -> None:
    need_shared()
    # 12 batches per epoch (6 on 2 ranks): console line and save only at the epoch's last batch
    args = tiny_args(epochs=1, accumulate=2, save_interval=1000, moe=moe, devices=devices) + [
        "--log_interval", "1000", "--trainer.callbacks+=tests.helpers.sync_counter.SyncCounter"]
    run = run_cli(tmp_path, args)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = sync_counts(tmp_path)
    assert sorted(counts) == list(range(devices))
    iters = 12 // devices
    for rank, per_batch in counts.items():
        inner = {batch: calls for batch, calls in per_batch.items() if int(batch.split(":")[1]) < iters}
        assert len(inner) == iters - 1
        for batch, calls in inner.items():
            # MoE routing sends each layer's per-expert token counts to the host once (data-dependent
            # shapes): one sync per layer and forward, where MiniMind's own code has three per expert
            routing = [c for c in calls if c.startswith("tolist minimind.py")]
            assert len(routing) == (2 if moe else 0), (rank, batch, calls)
            # under DDP the ranks agree on stopping (a signal, a failed background write) once per
            # optimizer step, with one small all-reduce: not inside an accumulation window
            agree = [c for c in calls if c.startswith("tolist manager.py")]  # CheckpointManager.agree
            window_end = int(batch.split(":")[1]) % 2 == 0
            assert len(agree) == (1 if devices > 1 and window_end else 0), (rank, batch, calls)
            assert len(calls) == len(routing) + len(agree), (rank, batch, calls)
