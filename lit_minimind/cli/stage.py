"""Which of MiniMind's training scripts a run is, and what that script names and starts from.

==========  =====================================  =================  ==========================  =============
stage       when                                   MiniMind script    files (``--resume.weight``)  ``--from_weight``
==========  =====================================  =================  ==========================  =============
pretrain    pretraining data                       train_pretrain.py  ``pretrain``                ``none``
sft         SFT data                               train_full_sft.py  ``full_sft``                (as given)
lora        ``--model.lora_rank`` > 0 (SFT data)   train_lora.py      ``lora_medical``            ``full_sft``
dpo         DPO data, or ``--model.objective dpo``  train_dpo.py       ``dpo``                     ``full_sft``
==========  =====================================  =================  ==========================  =============

The names and start weights are defaults: a flag or a ``--config`` file that sets them wins. So a
fine-tune never overwrites the ``out/*.pth`` it starts from.
"""

from __future__ import annotations

from typing import Any

from jsonargparse import ArgumentError

WEIGHT = {"pretrain": "pretrain", "sft": "full_sft", "lora": "lora_medical", "dpo": "dpo"}
SCRIPT = {"pretrain": "train_pretrain.py", "sft": "train_full_sft.py", "lora": "train_lora.py", "dpo": "train_dpo.py"}
START = {"lora": "full_sft", "dpo": "full_sft"}  # MiniMind's --from_weight defaults of those scripts


def data_kind(config: Any) -> str:
    """The data kind of a parsed config (the file is read only with ``--data.kind auto``)."""
    kind = config.get("data.kind") or "auto"
    if kind != "auto":
        return kind
    from lit_minimind.data.dataset import detect_kind

    data_path = config.get("data.data_path")
    return detect_kind(data_path) if data_path else "pretrain"  # DataError: the file is unusable anyway


def stage_of(config: Any) -> str:
    kind = data_kind(config)
    if config.get("model.objective") == "dpo" or (config.get("model.objective") in (None, "auto") and kind == "dpo"):
        return "dpo"
    if int(config.get("model.lora_rank") or 0) > 0:
        return "lora"
    return "sft" if kind == "sft" else "pretrain"


def apply_stage_defaults(config: Any, parser: Any, args: list[str]) -> list[str]:
    """Set the stage's file name, start weights and objective where the user set none; returns the
    lines saying so (printed by the caller)."""
    stage = stage_of(config)
    if stage == "dpo":
        config["model.objective"] = "dpo"
    elif config.get("model.objective") in (None, "auto") and "model.objective" in config:
        config["model.objective"] = "lm"
    if stage == "pretrain":
        return []
    try:  # what the user gave, defaults left out (the linked --log_interval must be present)
        given = parser.parse_args(["--log_interval", "0", *args], defaults=False)
    except (ArgumentError, SystemExit):
        return []
    notes = []
    if given.get("resume.weight") is None and config.get("resume.weight") == "pretrain":
        config["resume.weight"] = WEIGHT[stage]
        what = {"sft": "SFT data", "lora": "LoRA", "dpo": "DPO data"}[stage]
        notes.append(f"{what}: files named {WEIGHT[stage]} (MiniMind's {SCRIPT[stage]}; --resume.weight to change)")
    if stage in START and given.get("from_weight") is None and config.get("from_weight") in (None, "none"):
        config["from_weight"] = START[stage]
        notes.append(f"{stage.upper() if stage == 'dpo' else 'LoRA'}: --from_weight {START[stage]} "
                     f"(MiniMind's {SCRIPT[stage]} default)")
    return notes
