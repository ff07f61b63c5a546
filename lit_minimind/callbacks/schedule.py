"""When to save: MiniMind's ``save_interval`` rule plus an optional wall-clock cadence, fixed or
chosen by Young/Daly (``--resume.save_every_minutes auto``)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info

MAX_OVERHEAD = 0.05  # the auto interval never lets blocking saves take more than this share of the loop
DEFAULT_MTBF = 3600.0  # seconds: the auto interval's MTBF with no interruption in the run's history and no --resume.mtbf
RECENT_SAVES = 5  # the save cost is the median of this many latest measured saves
REPORT_CHANGE = 1.2  # the interval line is printed again when the interval moved by more than this factor


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Seconds between saves: Young/Daly's ``sqrt(2 * s * MTBF)`` for a blocking save cost ``s``, never
    below ``s / MAX_OVERHEAD`` (saves then cost the loop at most 5 % of its time)."""
    if save_seconds < 0:
        raise ValueError(f"save cost must be >= 0 seconds, got {save_seconds}")
    if mtbf_seconds <= 0:
        raise ValueError(f"MTBF must be > 0 seconds, got {mtbf_seconds}")
    return max(math.sqrt(2.0 * save_seconds * mtbf_seconds), save_seconds / MAX_OVERHEAD)


def run_mtbf(exposure_seconds: float, interruptions: int) -> float | None:
    """The run's own mean time between interruptions: seconds run over all its starts (each start counted
    up to its newest checkpoint, the current one up to now) per interruption; ``None`` with none yet."""
    return exposure_seconds / interruptions if interruptions > 0 and exposure_seconds > 0 else None


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


class SaveSchedule:
    """MiniMind saves after batch ``step`` when ``step % save_interval == 0 or step == iters``.

    With ``save_every_minutes`` it also saves at the first optimizer-step boundary after that many
    minutes (rank 0's clock decides, so every rank agrees; asked only at window boundaries).
    ``save_every_minutes="auto"``: the interval is :func:`young_daly_interval` of the measured save cost
    (the loop's wait, the median of the latest saves; until one is measured the first boundary saves) and
    ``mtbf`` (seconds) or else the run's own (:func:`run_mtbf`, from :meth:`state_dict`, checkpointed with
    the callback's state), or else :data:`DEFAULT_MTBF`.
    """

    def __init__(self, save_interval: int, save_every_minutes: float | Literal["auto"] | None = None,
                 mtbf: float | None = None) -> None:
        if save_interval < 1:
            raise ValueError(f"save_interval must be >= 1, got {save_interval}")
        if isinstance(save_every_minutes, str) and save_every_minutes != "auto":
            raise ValueError(f"--resume.save_every_minutes must be a number of minutes or 'auto', got {save_every_minutes!r}")
        if save_every_minutes not in (None, "auto") and save_every_minutes <= 0:
            raise ValueError(f"save_every_minutes must be > 0, got {save_every_minutes}")
        if mtbf is not None and mtbf <= 0:
            raise ValueError(f"--resume.mtbf must be > 0 seconds, got {mtbf:g}")
        if mtbf is not None and save_every_minutes != "auto":
            raise ValueError("--resume.mtbf is the MTBF of --resume.save_every_minutes auto: give both, or neither")
        self.save_interval = save_interval
        self.save_every_minutes = save_every_minutes
        self.mtbf = mtbf
        self.last_save = time.monotonic()
        self.born = time.monotonic()  # this start's exposure counts from here
        self.exposure = 0.0  # seconds run by the earlier starts of this run, each up to its newest checkpoint
        self.starts = 0  # earlier starts of this run: each ended in an interruption (this one resumed from it)
        self.costs: list[float] = []  # the latest measured blocking save costs (seconds)
        self.reported: float | None = None  # the interval the last line printed

    @property
    def auto(self) -> bool:
        return self.save_every_minutes == "auto"

    def by_step(self, step: int, iters: int) -> bool:
        return step % self.save_interval == 0 or step == iters

    def by_time(self, trainer: Any) -> bool:
        """A collective under DDP: call it on every rank, at the same step."""
        if self.save_every_minutes is None:
            return False
        interval = self.interval(report=trainer.is_global_zero)
        due = interval is None or time.monotonic() - self.last_save >= interval
        return bool(trainer.strategy.broadcast(due, src=0))

    def saved(self, save_seconds: float | None = None) -> None:
        """A save was taken (or training starts: nothing measured); ``save_seconds``: the loop's wait for it."""
        self.last_save = time.monotonic()
        if save_seconds is not None:
            self.costs = [*self.costs, float(save_seconds)][-RECENT_SAVES:]

    # ------------------------------------------------------------------ the auto interval
    def mtbf_now(self) -> tuple[float, str]:
        """The MTBF the auto interval uses and where it comes from."""
        if self.mtbf is not None:
            return self.mtbf, "by --resume.mtbf"
        own = run_mtbf(self.exposure + time.monotonic() - self.born, self.starts)
        if own is not None:
            return own, f"over this run's {self.starts} interruption{'s' if self.starts > 1 else ''}"
        return DEFAULT_MTBF, "by default"

    def interval(self, report: bool = False) -> float | None:
        """Seconds between time-based saves; ``None``: due now (auto, no save cost measured yet)."""
        if not self.auto:
            return None if self.save_every_minutes is None else float(self.save_every_minutes) * 60
        if not self.costs:
            return None
        cost, (mtbf, source) = statistics.median(self.costs), self.mtbf_now()
        tau = young_daly_interval(cost, mtbf)
        if report and (self.reported is None or max(tau / self.reported, self.reported / tau) > REPORT_CHANGE):
            self.report(tau, cost, mtbf, source)
        return tau

    def report(self, tau: float, cost: float, mtbf: float, source: str) -> None:
        floor = "; 5 % loop-overhead floor" if tau == cost / MAX_OVERHEAD else ""
        if source == "by default" and self.reported is None:  # said once
            source += ": no interruption in this run's history and no --resume.mtbf"
        rank_zero_info(f"save interval: every {_seconds(tau)} s (Young/Daly: save {_seconds(cost)} s, "
                       f"MTBF {_seconds(mtbf)} s {source}{floor})")
        self.reported = tau

    # ------------------------------------------------------------------ state (in the callback's checkpointed state)
    def state_dict(self) -> dict[str, Any]:
        """The run's history for its MTBF: seconds run (this start up to now) and starts, with the save costs."""
        return {"exposure_seconds": self.exposure + time.monotonic() - self.born, "starts": self.starts + 1,
                "save_seconds": list(self.costs)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A resume: the checkpoint's run history (absent in older checkpoints: none)."""
        if not state:
            return
        self.exposure = float(state.get("exposure_seconds") or 0.0)
        self.starts = int(state.get("starts") or 0)
        self.costs = [float(c) for c in state.get("save_seconds") or []][-RECENT_SAVES:]
