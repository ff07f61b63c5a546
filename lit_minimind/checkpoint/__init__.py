"""The checkpoint format: names and keys, the atomic writer, safe reading, zip verification, weights.

Bytes and schemas only: nothing here knows about a Trainer (that seam is :mod:`lit_minimind.resume`).
"""

from lit_minimind.checkpoint.atomic import atomic_link, atomic_open, atomic_save, atomic_write_bytes, read_manifest
from lit_minimind.checkpoint.names import checkpoint_paths, checkpoint_stem, manifest_path, minimind_file_names
from lit_minimind.checkpoint.read import read_checkpoint, verify_checkpoint
from lit_minimind.checkpoint.weights import (
    checkpoint_kind,
    fp16_state_dict,
    fp16_weights,
    model_weights,
    shape_config,
    unwrap_model,
)
from lit_minimind.errors import CheckpointError

__all__ = [
    "CheckpointError", "atomic_link", "atomic_open", "atomic_save", "atomic_write_bytes", "checkpoint_kind", "checkpoint_paths",
    "checkpoint_stem", "fp16_state_dict", "fp16_weights", "manifest_path", "minimind_file_names", "model_weights",
    "read_checkpoint", "read_manifest", "shape_config", "unwrap_model", "verify_checkpoint",
]
