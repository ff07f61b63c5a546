"""MiniMind's knowledge distillation (``trainer/train_distillation.py``) and its frozen teacher.

On SFT batches ``(input_ids, labels)`` the student's loss is MiniMind's
``alpha * CE (+ MoE aux) + (1 - alpha) * T^2 * KL(softmax(teacher / T) || softmax(student / T))``: both
logits shifted (position ``t`` predicts token ``t + 1``), the teacher's cut to the student's vocabulary,
CE and KL over the rows with a label (``labels != -100``), the KL a mean over those rows (``batchmean``).
The rows are selected by a mask product, not by indexing, so no step waits for the host; a batch without
a labelled row gives 0 (MiniMind's ``batchmean`` over no rows: NaN).

The teacher is any MiniMind weight file (fp16 export, resume file, Lightning checkpoint, Hugging Face
directory) of any size, dense or MoE: its shape is read from its tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from lit_minimind.checkpoint.hf import is_hf_directory
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import model_weights, shape_config
from lit_minimind.errors import CheckpointError
from lit_minimind.model.dpo import Reference, file_sha256
from lit_minimind.model.minimind import MiniMindConfig, MiniMindForCausalLM

__all__ = ["DISTILL_ALPHA", "DISTILL_TEMPERATURE", "distill_loss", "load_teacher"]

DISTILL_ALPHA = 0.5  # MiniMind's --alpha: the CE term's weight
DISTILL_TEMPERATURE = 1.5  # MiniMind's --temperature


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                 alpha: float, temperature: float, aux_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """MiniMind's distillation loss from unshifted ``(B, T, V)`` logits and ``(B, T)`` labels; returns the
    loss and MiniMind's console values (``ce`` without the aux loss, ``aux_loss``, ``distill``), detached."""
    student = student_logits[:, :-1, :].float()
    teacher = teacher_logits[:, :-1, : student.shape[-1]].float()
    targets = labels[:, 1:]
    mask = (targets != -100).float()
    rows = mask.sum()
    ce_tokens = F.cross_entropy(student.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="none")
    ce = (ce_tokens * mask.flatten()).sum() / (rows + 1e-8)
    log_student = F.log_softmax(student / temperature, dim=-1)
    with torch.no_grad():
        probs_teacher = F.softmax(teacher / temperature, dim=-1)
    # F.kl_div's pointwise term, target * (log target - input), summed per row; xlogy makes 0 * log 0 = 0
    kl_rows = (torch.xlogy(probs_teacher, probs_teacher) - probs_teacher * log_student).sum(-1)
    kl = temperature**2 * (kl_rows * mask).sum() / rows.clamp(min=1)
    loss = alpha * (ce + aux_loss) + (1 - alpha) * kl
    return loss, {"loss": loss.detach(), "ce": ce.detach(), "aux_loss": aux_loss.detach(), "distill": kl.detach()}


def load_teacher(path: str | os.PathLike[str], *, hidden_size: int | None = None, num_hidden_layers: int | None = None,
                 use_moe: bool | None = None) -> Reference:
    """The frozen teacher in ``path`` (its sha256 recorded), of the shape its tensors have; a shape given
    (MiniMind's ``--teacher_hidden_size``, ``--teacher_num_layers``, ``--teacher_use_moe``) must agree.
    Draws nothing from torch's random stream (the weights are loaded over the initialisation)."""
    if not Path(path).is_file() and not is_hf_directory(path):
        raise CheckpointError(f"--model.teacher: {path}: no such weight file")
    state = model_weights(read_checkpoint(path))
    shape = shape_config(state)
    if not shape:
        raise CheckpointError(f"--model.teacher: {path}: no MiniMind weights in it (no embed_tokens.weight)")
    given = {"hidden_size": hidden_size, "num_hidden_layers": num_hidden_layers, "use_moe": use_moe}
    bad = [f"--model.teacher_{k.replace('num_hidden_layers', 'num_layers')} {v} but the file has {shape[k]}"
           for k, v in given.items() if v is not None and shape[k] != v]
    if bad:
        raise CheckpointError(f"--model.teacher: {path}: " + "; ".join(bad))
    config = MiniMindConfig(**{k: v for k, v in shape.items() if v is not None})
    with torch.random.fork_rng(devices=[]):
        model = MiniMindForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith(("freqs_cos", "freqs_sin"))]
    if missing or unexpected:
        raise CheckpointError(f"--model.teacher: {path}: not a complete MiniMind model (missing "
                              f"{len(missing)} tensors, e.g. {(missing or ['-'])[0]}; unexpected {len(unexpected)})")
    return Reference(model, path, file_sha256(path))
