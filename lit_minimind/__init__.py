"""lit-minimind: MiniMind's LLM pretraining on PyTorch Lightning, with exact checkpoint/resume.

Packages by concern (lower ones never import higher ones; ``tests/test_layers.py`` checks it):
``errors`` -> ``checkpoint`` (the file format) -> ``resume`` (the seam with Lightning) ->
``data``, ``model`` -> ``callbacks`` (the repository's ``callbacks/`` links here) -> ``cli``.

``import lit_minimind`` imports no torch and no Lightning: the public names below are imported on first
use (PEP 562), so ``python -m lit_minimind.fit`` runs its first line (the start-up signal handler) at
once, and ``python -m lit_minimind.inspect`` / ``export`` / ``generate`` never pay for Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lit_minimind.errors import CheckpointError

if TYPE_CHECKING:
    from lit_minimind.checkpoint.names import checkpoint_paths
    from lit_minimind.data.sampler import SkipBatchSampler
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.resume.library import load_resume_checkpoint, save_resume_checkpoint

_LAZY = {  # public name -> the module defining it
    "MiniMindConfig": "lit_minimind.model",
    "MiniMindForCausalLM": "lit_minimind.model",
    "SkipBatchSampler": "lit_minimind.data.sampler",
    "checkpoint_paths": "lit_minimind.checkpoint.names",
    "save_resume_checkpoint": "lit_minimind.resume.library",
    "load_resume_checkpoint": "lit_minimind.resume.library",
}
_SUBPACKAGES = ("callbacks", "checkpoint", "cli", "data", "model", "resume")  # lit_minimind.<name> without an import

__all__ = [
    "__version__",
    "MiniMindConfig",
    "MiniMindForCausalLM",
    "SkipBatchSampler",
    "checkpoint_paths",
    "save_resume_checkpoint",
    "load_resume_checkpoint",
    "CheckpointError",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the one version number is pyproject.toml's, as pip installed it (read on first use)
        from importlib import metadata

        try:
            version = metadata.version("lit-minimind")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            version = "unknown"
        globals()[name] = version
        return version
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"__version__"} | set(_LAZY) | set(_SUBPACKAGES))
