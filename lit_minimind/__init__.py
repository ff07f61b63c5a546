"""lit-minimind: MiniMind's LLM pretraining on PyTorch Lightning, with exact checkpoint/resume.

Packages by concern (lower ones never import higher ones; ``tests/test_layers.py`` checks it):
``errors`` -> ``checkpoint`` (the file format) -> ``resume`` (the seam with Lightning) ->
``data``, ``model`` -> ``callbacks`` (the repository's ``callbacks/`` links here) -> ``cli``.
"""

from lit_minimind.checkpoint.names import checkpoint_paths
from lit_minimind.data.sampler import SkipBatchSampler
from lit_minimind.errors import CheckpointError
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from lit_minimind.resume.library import load_resume_checkpoint, save_resume_checkpoint
from lit_minimind.version import __version__

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
