"""Loop counters for a position Lightning did not save itself (a MiniMind file, a changed world size).

Lightning has no API to set a loop position, so this is written against the counters Lightning
2.5/2.6 save; ``tests/test_loop_state.py`` compares it with what Lightning saves.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from lit_minimind.resume.position import DataPosition, optimizer_steps, window_complete


def fit_loop_state_at(template: dict[str, Any], position: DataPosition, accumulate: int, global_step: int) -> dict[str, Any]:
    """Fit-loop state as Lightning saves it after ``position`` (at least one batch trained).

    Inside an epoch: the state of a save in ``on_train_batch_end`` of batch ``position.step``; a
    complete epoch: the state of a save in ``on_train_epoch_end``. ``template`` is a fresh
    ``trainer.fit_loop.state_dict()``, ``global_step`` the optimizer steps taken so far.
    ``tests/test_loop_state.py`` checks both against states Lightning saved itself.
    """
    epoch, step, iters = position.epoch, position.step, position.iters
    if step < 1:
        raise ValueError("fit_loop_state_at needs a position after at least one batch")
    state = copy.deepcopy(template)
    end = position.epoch_complete
    stepped = window_complete(step, iters, accumulate)
    steps_in_epoch = optimizer_steps(DataPosition(0, step, iters), accumulate)
    windows_in_epoch = math.ceil(step / accumulate)
    windows_before = epoch * math.ceil(iters / accumulate)

    def batches(total: int) -> dict[str, int]:
        return {"ready": total, "completed": total if end else total - 1, "started": total, "processed": total}

    state["epoch_loop.state_dict"] = {"_batches_that_stepped": global_step - (1 if stepped and not end else 0)}
    state["epoch_loop.batch_progress"] = {
        "total": batches(epoch * iters + step), "current": batches(step), "is_last_batch": step == iters,
    }
    optim = state["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    optim["step"] = {
        "total": {"ready": global_step, "completed": global_step},
        "current": {"ready": steps_in_epoch, "completed": steps_in_epoch},
    }
    zg_total, zg_current = windows_before + windows_in_epoch, windows_in_epoch
    optim["zero_grad"] = {
        "total": {"ready": zg_total, "completed": zg_total, "started": zg_total},
        "current": {"ready": zg_current, "completed": zg_current, "started": zg_current},
    }
    epochs = {"ready": epoch + 1, "completed": epoch, "started": epoch + 1, "processed": epoch + (1 if end else 0)}
    state["epoch_progress"] = {"total": dict(epochs), "current": dict(epochs)}
    return state


def loops_at(template: dict[str, Any], position: DataPosition, accumulate: int, global_step: int) -> dict[str, Any] | None:
    """``checkpoint["loops"]`` for a position Lightning did not save itself (a MiniMind file, a changed
    world size): the one place where loop counters are built by hand. ``None`` before any batch."""
    if position.step >= 1:
        return {"fit_loop": fit_loop_state_at(template, position, accumulate, global_step)}
    if position.epoch > 0:  # nothing trained yet in this epoch: the previous one is complete
        previous = DataPosition(position.epoch - 1, position.iters, position.iters)
        return {"fit_loop": fit_loop_state_at(template, previous, accumulate, global_step)}
    return None
