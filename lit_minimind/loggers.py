"""The CLI's default logger (``conf/default.yaml``)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger


class CSVLogger(LightningCSVLogger):
    """Lightning's ``CSVLogger`` (``metrics.csv`` under ``lightning_logs/version_N``) without its ``hparams.yaml``:
    the run's whole configuration is the ``config.yaml`` LightningCLI writes in the same directory. Writing it cost
    every start 0.6 s where ``s3fs`` is installed (remote checkpoints, the ``test-s3`` extra): Lightning 2.6 imports
    ``s3fs``, ``gcsfs`` and ``adlfs`` to ask whether the directory is object storage."""

    def log_hyperparams(self, params: Any = None, *args: Any, **kwargs: Any) -> None:
        """Nothing: ``config.yaml`` holds them."""
