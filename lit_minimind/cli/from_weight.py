"""MiniMind's ``--from_weight``: start training from saved weights, with a fresh optimizer and position."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from lit_minimind.checkpoint.hf import is_hf_directory
from lit_minimind.checkpoint.names import checkpoint_stem
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import checkpoint_kind, model_weights, saved_config, unwrap_model
from lit_minimind.errors import CheckpointError


def weight_path(value: str, out_dir: str | Path, hidden_size: int, use_moe: bool) -> Path | None:
    """MiniMind's ``{out_dir}/{NAME}_{hidden}{_moe}.pth`` for a NAME, the file (or Hugging Face
    directory) itself for a path, None for 'none'."""
    if not value or value == "none":
        return None
    path = Path(value)
    if path.suffix in {".pth", ".pt", ".ckpt"} or len(path.parts) > 1 or path.is_file() or is_hf_directory(path):
        return path
    return Path(out_dir) / f"{checkpoint_stem(value, hidden_size, use_moe)}.pth"


def load_start_weights(model: nn.Module, path: str | Path) -> str:
    """Load the MiniMind weights in ``path`` (fp16 export, resume file, Lightning checkpoint or Hugging
    Face directory) into ``model``.

    Like MiniMind (``strict=False``), missing or unexpected keys are reported, not fatal; a missing
    file, a shape mismatch or a file sharing no key with the model raises :class:`CheckpointError`.
    Returns a one-line report.
    """
    if not Path(path).is_file() and not is_hf_directory(path):
        raise CheckpointError(f"--from_weight: {path}: no such weight file")
    target = unwrap_model(model)
    ckpt = read_checkpoint(path)
    state = model_weights(ckpt)
    if checkpoint_kind(ckpt) == "hf":  # its config.json says how the model computes: this run's must agree
        bad = hf_config_mismatches(saved_config(ckpt), vars(target.config))
        if bad:
            raise CheckpointError(f"{path}: config.json differs from this model (--from_weight): {'; '.join(bad)}")
    own = target.state_dict()
    bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items() if k in own and v.shape != own[k].shape]
    if bad:
        raise CheckpointError(f"{path}: shapes do not match this model (--from_weight): {'; '.join(bad[:3])}"
                              + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))
    if not own.keys() & state.keys():
        raise CheckpointError(f"{path}: no tensor matches this model's keys (--from_weight); is it a MiniMind weight file?")
    result = target.load_state_dict(state, strict=False)

    def listing(keys: list[str]) -> str:
        return f"{len(keys)} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" if keys else "none"

    return (f"--from_weight: loaded {len(state) - len(result.unexpected_keys)} tensors from {path}; "
            f"missing keys: {listing(result.missing_keys)}; unexpected keys: {listing(result.unexpected_keys)}")


COMPUTE_FIELDS = ("head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "num_experts_per_tok", "norm_topk_prob")

def hf_config_mismatches(saved: dict, current: dict) -> list[str]:
    """``field: config.json X, this run Y`` for the settings beyond the shapes that change what the
    model computes (MoE routing only for MoE models)."""
    fields = COMPUTE_FIELDS if current.get("use_moe") else COMPUTE_FIELDS[:4]
    return [f"{f}: config.json {saved[f]}, this run {current[f]}" for f in fields
            if f in saved and f in current and saved[f] != current[f]]
