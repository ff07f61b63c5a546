"""fp16 mixed precision with a real GradScaler on CPU, selectable from the CLI.

Lightning 2.6 turns ``precision="16-mixed"`` on CPU into bf16; this plugin keeps fp16 and a
scaling ``torch.amp.GradScaler("cpu")`` so the GradScaler path (and its saved state) can be
exercised without a GPU: ``--trainer.plugins lit_minimind.model.precision.CPUFloat16Mixed``.
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins import MixedPrecision


class CPUFloat16Mixed(MixedPrecision):
    """``MixedPrecision("16-mixed", "cpu")`` with a CPU GradScaler (``init_scale`` configurable)."""

    def __init__(self, init_scale: float = 2.0**16) -> None:
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
