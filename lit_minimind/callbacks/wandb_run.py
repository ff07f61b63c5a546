"""A resumed run keeps logging into the same wandb run, on one step axis (``micro_step``)."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


def wandb_logger(trainer: L.Trainer) -> Any:
    """The trainer's WandbLogger, if any."""
    from lightning.pytorch.loggers import WandbLogger

    return next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)


def continue_wandb_run(trainer: L.Trainer, run_id: str | None) -> None:
    """Before the run starts: make a WandbLogger continue the checkpoint's run, unless the user chose an id.

    wandb reads ``WANDB_RUN_ID`` when no id is passed (WandbLogger already passes ``resume="allow"``).
    """
    logger = wandb_logger(trainer)
    if logger is None:
        return
    chosen = logger.version  # the id given to the logger (None until the run starts, if none was)
    if chosen and chosen != run_id:
        rank_zero_info(f"wandb: logging to the run id you chose ({chosen}), not the checkpoint's ({run_id})")
    elif run_id is None:
        rank_zero_info("wandb: the checkpoint has no wandb run id: starting a new run (its id goes into the next checkpoint)")
    else:
        os.environ["WANDB_RUN_ID"] = run_id
        rank_zero_info(f"wandb: continuing run {run_id}")


def wandb_run_id(trainer: L.Trainer) -> str | None:
    logger = wandb_logger(trainer)
    return str(logger.experiment.id) if logger is not None and trainer.is_global_zero else None


def resume_record(trainer: L.Trainer, resumed_from: dict[str, Any]) -> dict[str, Any]:
    """``{"resume_at_global_step_N": where this run resumed from}``, for the run's config."""
    record = {**resumed_from, "checkpoint": str(trainer.ckpt_path), "world_size_now": trainer.world_size}
    return {f"resume_at_global_step_{resumed_from['global_step']}": record}


def describe_wandb_run(trainer: L.Trainer, resume_records: dict[str, Any]) -> str | None:
    """One step axis for every metric (``micro_step``) and every resume of the run so far in its config
    (all of them each time: a process SIGKILLed before wandb wrote its config loses none). Returns the run id."""
    logger = wandb_logger(trainer)
    if logger is None or not trainer.is_global_zero:
        return None
    run = logger.experiment
    run.define_metric("micro_step")
    run.define_metric("*", step_metric="micro_step")
    if resume_records:
        run.config.update(dict(resume_records), allow_val_change=True)
    return str(run.id)
