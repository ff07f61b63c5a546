"""Which of MiniMind's training scripts a run is, and what that script names and starts from.

==========  =====================================  =================  ==========================  =============
stage       when                                   MiniMind script    files (``--resume.weight``)  ``--from_weight``
==========  =====================================  =================  ==========================  =============
pretrain    pretraining data                       train_pretrain.py  ``pretrain``                ``none``
sft         SFT data                               train_full_sft.py  ``full_sft``                (as given)
lora        ``--model.lora_rank`` > 0 (SFT data)   train_lora.py      ``lora_medical``            ``full_sft``
dpo         DPO data, or ``--model.objective dpo``  train_dpo.py       ``dpo``                     ``full_sft``
distill     ``--model.objective distill``          train_distillation ``full_dist``               ``full_sft``
reward      ``--model.objective reward`` (DPO data) (none: InternLM2)  ``reward``                  ``full_sft``
grpo        ``--model.objective grpo`` (prompts)   train_grpo.py      ``grpo``                    ``full_sft``
ppo         ``--model.objective ppo`` (prompts)    train_ppo.py       ``ppo_actor``               ``full_sft``
agent       ``--model.objective agent`` (tool use)  train_agent.py     ``agent``                   ``full_sft``
==========  =====================================  =================  ==========================  =============

GRPO and PPO read their data as prompts: ``--data.kind rlaif`` is set with them (conversations, the last
assistant turn the slot to answer). PPO steps its two optimizers itself: its ``--trainer.accumulate_grad_batches``
and ``--trainer.gradient_clip_val`` move to ``--model.accumulation_steps`` and ``--model.grad_clip``. Agent RL
reads MiniMind's agent RL records (``--data.kind agent`` is set with it; no data path: the embedded demo questions)
and opens thinking in 10 % of its rollouts unless ``--data.thinking_ratio`` is given (``train_agent.py``'s default).
PPO cuts an over-long prompt on the right (``--data.truncation_side right``, ``train_ppo.py``'s rule) unless told.

The names and start weights are defaults: a flag or a ``--config`` file that sets them wins. So a
fine-tune never overwrites the ``out/*.pth`` it starts from. Distillation's teacher is named the same way:
``--model.teacher NAME`` (default ``full_sft``, MiniMind's ``--from_teacher_weight``) is
``{resume.out_dir}/{NAME}_{teacher_hidden_size}[_moe].pth``, MoE unless ``--model.teacher_use_moe false``
(MiniMind's ``--teacher_use_moe 1`` default).
"""

from __future__ import annotations

from typing import Any

from jsonargparse import ArgumentError

WEIGHT = {"pretrain": "pretrain", "sft": "full_sft", "lora": "lora_medical", "dpo": "dpo", "distill": "full_dist",
          "reward": "reward", "grpo": "grpo", "ppo": "ppo_actor", "agent": "agent"}
SCRIPT = {"pretrain": "train_pretrain.py", "sft": "train_full_sft.py", "lora": "train_lora.py", "dpo": "train_dpo.py",
          "distill": "train_distillation.py", "grpo": "train_grpo.py", "ppo": "train_ppo.py",
          "agent": "train_agent.py"}  # the reward model stage has none (InternLM2's)
START = {"lora": "full_sft", "dpo": "full_sft", "distill": "full_sft", "reward": "full_sft",
         "grpo": "full_sft", "ppo": "full_sft", "agent": "full_sft"}  # --from_weight defaults
TEACHER = "full_sft"  # train_distillation.py's --from_teacher_weight default (with --teacher_use_moe 1)


def data_kind(config: Any) -> str:
    """The data kind of a parsed config (the file is read only with ``--data.kind auto``)."""
    kind = config.get("data.kind") or "auto"
    if kind != "auto":
        return kind
    from lit_minimind.data.dataset import detect_kind

    data_path = config.get("data.data_path")
    return detect_kind(data_path) if data_path else "pretrain"  # DataError: the file is unusable anyway


def stage_of(config: Any) -> str:
    if config.get("model.objective") in ("distill", "reward", "grpo", "ppo", "agent"):
        return config.get("model.objective")
    if config.get("data.kind") == "agent":
        return "agent"
    if config.get("data.kind") == "rlaif":
        return "grpo"
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
    if stage in ("dpo", "grpo", "ppo", "agent"):
        config["model.objective"] = stage
    if stage == "agent" and config.get("data.kind") in (None, "auto"):
        config["data.kind"] = "agent"
    if stage in ("grpo", "ppo") and config.get("data.kind") in (None, "auto"):
        config["data.kind"] = "rlaif"
    if stage == "ppo":
        move_ppo_optimization(config)
    elif config.get("model.objective") in (None, "auto") and "model.objective" in config:
        config["model.objective"] = "lm"
    if stage == "pretrain":
        return []
    try:  # what the user gave, defaults left out (the linked --log_interval must be present)
        given = parser.parse_args(["--log_interval", "0", *args], defaults=False)
    except (ArgumentError, SystemExit):
        return []
    notes = []
    if stage == "ppo" and given.get("data.truncation_side") is None and "data.truncation_side" in config:
        config["data.truncation_side"] = "right"
        notes.append("PPO: a prompt over --data.max_seq_len keeps its first tokens (MiniMind's train_ppo.py; "
                     "--data.truncation_side to change)")
    if given.get("resume.weight") is None and config.get("resume.weight") == "pretrain":
        config["resume.weight"] = WEIGHT[stage]
        what = {"sft": "SFT data", "lora": "LoRA", "dpo": "DPO data", "distill": "distillation", "reward": "reward model",
                "grpo": "GRPO", "ppo": "PPO", "agent": "agent RL"}[stage]
        source = f"MiniMind's {SCRIPT[stage]}" if stage in SCRIPT else "the port's"
        notes.append(f"{what}: files named {WEIGHT[stage]} ({source}; --resume.weight to change)")
    if stage in START and given.get("from_weight") is None and config.get("from_weight") in (None, "none"):
        config["from_weight"] = START[stage]
        what = {"dpo": "DPO", "lora": "LoRA", "distill": "distillation (the student)", "reward": "reward model",
                "grpo": "GRPO (policy and reference)", "ppo": "PPO (actor, critic and reference)",
                "agent": "agent RL (policy and reference)"}[stage]
        source = f"MiniMind's {SCRIPT[stage]}" if stage in SCRIPT else "the port's"
        notes.append(f"{what}: --from_weight {START[stage]} ({source} default)")
    if stage == "distill":
        notes += resolve_teacher(config)
    if stage == "agent" and given.get("data.thinking_ratio") is None and "data.thinking_ratio" in config:
        from lit_minimind.data.agent import THINKING_RATIO

        config["data.thinking_ratio"] = THINKING_RATIO  # train_agent.py's 0.1 (GRPO's prompts: 0.9)
    return notes


def move_ppo_optimization(config: Any) -> None:
    """PPO steps its optimizers itself (Lightning's manual optimization refuses the trainer's accumulation and
    clipping): ``--trainer.accumulate_grad_batches`` and ``--trainer.gradient_clip_val`` become the model's."""
    accumulate = config.get("trainer.accumulate_grad_batches")
    if accumulate not in (None, 1):
        config["model.accumulation_steps"] = int(accumulate)
    config["trainer.accumulate_grad_batches"] = 1
    clip = config.get("trainer.gradient_clip_val")
    if clip is not None:
        config["model.grad_clip"] = float(clip)
    config["trainer.gradient_clip_val"] = None


def resolve_teacher(config: Any) -> list[str]:
    """``--model.teacher NAME`` (or none given: MiniMind's ``full_sft`` MoE) as the file it names."""
    from lit_minimind.cli.from_weight import weight_path

    name = config.get("model.teacher") or TEACHER
    moe = config.get("model.teacher_use_moe")
    hidden = config.get("model.teacher_hidden_size") or config.get("model.hidden_size")
    path = weight_path(name, config.get("resume.out_dir") or "out", hidden, True if moe is None else moe)
    config["model.teacher"] = str(path)
    if str(path) == name:
        return []
    return [f"distillation: teacher {path} (--model.teacher {name}"
            + (", MoE: MiniMind's --teacher_use_moe 1 default" if moe is None else "") + ")"]
