"""lit-minimind: MiniMind's LLM pretraining on PyTorch Lightning, with exact checkpoint/resume."""

__version__ = "0.1.0"

from lit_minimind.checkpoint import (  # noqa: E402
    CheckpointError,
    checkpoint_paths,
    load_resume_checkpoint,
    save_resume_checkpoint,
)
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM  # noqa: E402
from lit_minimind.sampler import SkipBatchSampler  # noqa: E402

__all__ = [
    "MiniMindConfig",
    "MiniMindForCausalLM",
    "SkipBatchSampler",
    "checkpoint_paths",
    "save_resume_checkpoint",
    "load_resume_checkpoint",
    "CheckpointError",
]
