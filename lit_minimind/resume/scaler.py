"""A loss scaler's state across precision plugins: a checkpoint written under one (the CPU fp16 plugin,
:class:`lit_minimind.model.precision.CPUFloat16Mixed`) resumes under another (Lightning's CUDA
``MixedPrecision("16-mixed", "cuda")``) with its scale, and back.

Lightning keeps a precision plugin's state under the plugin's class name, so a run with another plugin
would start again from the initial scale (steps that overflow are skipped until it has backed off again).
``torch.amp.GradScaler``'s state dict holds no device: the same dict loads into a CPU or a CUDA scaler.
"""

from __future__ import annotations

from typing import Any


def adopt_scaler_state(checkpoint: dict[str, Any], plugin: Any) -> None:
    """Before Lightning restores the precision plugin: when ``plugin`` has a scaler and ``checkpoint``
    holds no state under its class name, give it the saved scaler state (MiniMind's ``scaler`` key,
    which every lit-minimind checkpoint carries), for Lightning to load with ``plugin.load_state_dict``."""
    key = type(plugin).__qualname__
    saved = checkpoint.get("scaler")
    if saved and key not in checkpoint and getattr(plugin, "scaler", None) is not None:
        checkpoint[key] = dict(saved)
