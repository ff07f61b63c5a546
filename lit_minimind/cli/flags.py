"""MiniMind's ``trainer/train_pretrain.py`` flags (and those of ``train_full_sft.py``, ``train_lora.py``:
``--lora_name``, ``train_dpo.py``: ``--beta``, ``train_distillation.py``: ``--alpha``, ``--temperature``,
``--from_teacher_weight``, ``--teacher_*``, ``--student_*``, ``--from_student_weight``, ``train_grpo.py``:
``--num_generations``, ``--loss_type``, ``--epsilon``, ``--epsilon_high``, ``--max_gen_len``, ``--thinking_ratio``,
``--reward_model_path``, ``--rollout_engine torch``, ``train_agent.py``: ``--max_total_len``), translated into the
port's own flags.

``python -m lit_minimind.fit --epochs 2 --batch_size 32 --from_resume 1`` means what it means
in MiniMind; MiniMind's and the port's flags mix freely (later ones win, as in argparse).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from lit_minimind.errors import UsageError

# MiniMind flag -> port flag, for flags whose value passes through unchanged
SIMPLE = {
    "save_dir": "--resume.out_dir",
    "save_weight": "--resume.weight",
    "epochs": "--trainer.max_epochs",
    "batch_size": "--data.batch_size",
    "learning_rate": "--model.learning_rate",
    "num_workers": "--data.num_workers",
    "accumulation_steps": "--trainer.accumulate_grad_batches",
    "grad_clip": "--trainer.gradient_clip_val",
    "save_interval": "--resume.save_interval",
    "hidden_size": "--model.hidden_size",
    "num_hidden_layers": "--model.num_hidden_layers",
    "max_seq_len": "--data.max_seq_len",
    "data_path": "--data.data_path",
    "tokenizer_path": "--data.tokenizer_path",
    "beta": "--model.beta",
    "alpha": "--model.alpha",
    "temperature": "--model.temperature",
    "from_teacher_weight": "--model.teacher",
    "teacher_hidden_size": "--model.teacher_hidden_size",
    "teacher_num_layers": "--model.teacher_num_layers",
    "student_hidden_size": "--model.hidden_size",
    "student_num_layers": "--model.num_hidden_layers",
    "from_student_weight": "--from_weight",
    "num_generations": "--model.num_generations",
    "loss_type": "--model.loss_type",
    "epsilon": "--model.epsilon",
    "epsilon_high": "--model.epsilon_high",
    "max_gen_len": "--model.max_gen_len",
    "thinking_ratio": "--data.thinking_ratio",
    "reward_model_path": "--model.reward_model",
    "critic_learning_rate": "--model.critic_learning_rate",
    "clip_epsilon": "--model.epsilon",
    "kl_coef": "--model.beta",
    "vf_coef": "--model.vf_coef",
    "gamma": "--model.gamma",
    "lam": "--model.lam",
    "cliprange_value": "--model.cliprange_value",
    "ppo_update_iters": "--model.ppo_update_iters",
    "early_stop_kl": "--model.early_stop_kl",
    "mini_batch_size": "--model.mini_batch_size",
    "max_total_len": "--model.max_total_len",
}
BOOLS = {"use_moe": "--model.use_moe", "student_use_moe": "--model.use_moe", "teacher_use_moe": "--model.teacher_use_moe"}
DISTILL = {"alpha", "temperature", "from_teacher_weight", "teacher_hidden_size", "teacher_num_layers", "teacher_use_moe"}
GRPO = {"num_generations", "loss_type", "epsilon", "epsilon_high", "max_gen_len", "thinking_ratio", "reward_model_path",
        "rollout_engine"}  # train_grpo.py's own flags: any of them means --model.objective grpo
PPO = {"critic_learning_rate", "clip_epsilon", "kl_coef", "vf_coef", "gamma", "lam", "cliprange_value", "ppo_update_iters",
       "early_stop_kl", "mini_batch_size"}  # train_ppo.py's own flags: --model.objective ppo (before GRPO's shared ones)
AGENT = {"max_total_len"}  # train_agent.py's own flag: --model.objective agent (GRPO's flags it shares keep it)
DTYPES = {"bfloat16": "bf16-mixed", "float16": "16-mixed", "float32": "32-true"}
SAME = ["log_interval", "from_weight"]  # the port's flags too: they pass through
MINIMIND_FLAGS = [*SIMPLE, *SAME, *BOOLS, "device", "dtype", "from_resume", "use_wandb", "wandb_project", "use_compile",
                  "lora_name", "rollout_engine"]
LORA_RANK = "16"  # MiniMind's apply_lora(model, rank=16)
WANDB_PROJECT = "MiniMind-Pretrain"  # MiniMind's default --wandb_project


def help_epilog() -> str:
    """What ``--help`` says of MiniMind's flags (they are translated before the parser sees them): every
    flag of ``MINIMIND_FLAGS``, the flags of MiniMind's four training scripts."""
    pairs = [f"--{k} -> {v}" for k, v in SIMPLE.items()]
    pairs += ["--dtype bfloat16|float16|float32 -> --trainer.precision bf16-mixed|16-mixed|32-true",
              "--device cpu|mps|cuda|cuda:N -> --trainer.accelerator/--trainer.devices",
              "--use_moe 0|1, --student_use_moe 0|1 -> --model.use_moe",
              "--teacher_use_moe 0|1 -> --model.teacher_use_moe",
              "a flag of train_distillation.py's teacher (--alpha, --temperature, --from_teacher_weight, --teacher_*) "
              "also sets --model.objective distill", "--from_resume 1 -> --ckpt_path last",
              "--use_compile 0|1 -> --model.compile", "--use_wandb [--wandb_project P] -> a WandbLogger",
              "--wandb_project P: the project of --use_wandb (alone it does nothing, as in MiniMind)",
              f"--lora_name NAME -> --resume.weight NAME --model.lora_rank {LORA_RANK} (train_lora.py; "
              "the rank unless --model.lora_rank is given)",
              "a flag of train_grpo.py (--num_generations, --loss_type, --epsilon, --epsilon_high, --max_gen_len, "
              "--thinking_ratio, --reward_model_path, --rollout_engine torch) also sets --model.objective grpo",
              "a flag of train_ppo.py (--critic_learning_rate, --clip_epsilon, --kl_coef, --vf_coef, --gamma, --lam, "
              "--cliprange_value, --ppo_update_iters, --early_stop_kl, --mini_batch_size) sets --model.objective ppo",
              "a flag of train_agent.py (--max_total_len) sets --model.objective agent (with GRPO's flags it shares)",
              "--rollout_engine torch: the only engine (sglang is not supported)",
              "--log_interval, --from_weight: the same"]
    return ("MiniMind's flags (trainer/train_pretrain.py, train_full_sft.py, train_lora.py, train_dpo.py, "
            "train_distillation.py, train_grpo.py, train_ppo.py, train_agent.py) are "
            "accepted too\n(--flag value or --flag=value, mixed with the flags above; later ones win):\n  "
            + "\n  ".join(pairs))


@dataclass
class Translation:
    args: list[str]  # the port's argv
    mapping: list[tuple[str, str]] = field(default_factory=list)  # ("--epochs 2", "--trainer.max_epochs 2")
    origins: dict[str, str] = field(default_factory=dict)  # port flag -> MiniMind flag it came from
    notes: list[str] = field(default_factory=list)


def _choice(flag: str, value: str, allowed: dict[str, list[str]]) -> list[str]:
    if value not in allowed:
        raise UsageError(f"--{flag} must be one of {', '.join(allowed)} (got {value!r})")
    return allowed[value]


def _device(value: str) -> list[str]:
    if value == "cpu":
        return ["--trainer.accelerator", "cpu", "--trainer.devices", "1"]
    if value == "mps":
        return ["--trainer.accelerator", "mps", "--trainer.devices", "1"]
    if m := re.fullmatch(r"cuda(?::(\d+))?", value):
        return ["--trainer.accelerator", "gpu", "--trainer.devices", f"[{m[1]}]" if m[1] else "1"]
    raise UsageError(f"--device must be cpu, cuda or cuda:N (got {value!r})")


def _translate_one(flag: str, value: str, wandb_project: str, compile_supported: bool, notes: list[str],
                   rank_given: bool = False) -> list[str]:
    if flag in SIMPLE:
        return [SIMPLE[flag], value]
    if flag in BOOLS:
        return [BOOLS[flag], _choice(flag, value, {"0": ["false"], "1": ["true"]})[0]]
    if flag == "lora_name":  # train_lora.py: its files' name, and LoRA itself (unless a rank is given)
        return ["--resume.weight", value, *([] if rank_given else ["--model.lora_rank", LORA_RANK])]
    if flag == "dtype":
        return ["--trainer.precision", _choice(flag, value, {k: [v] for k, v in DTYPES.items()})[0]]
    if flag == "device":
        return _device(value)
    if flag == "rollout_engine":
        if value != "torch":
            raise UsageError(f"--rollout_engine {value}: only torch (the project's own generation) is supported")
        return []
    if flag == "from_resume":
        return _choice(flag, value, {"0": [], "1": ["--ckpt_path", "last"]})
    if flag == "use_compile":
        on = _choice(flag, value, {"0": ["false"], "1": ["true"]})[0]
        if compile_supported:
            return ["--model.compile", on]
        if on == "true":
            notes.append("note: --use_compile 1: torch.compile is not yet supported by lit-minimind; training uncompiled")
        return []
    if flag == "use_wandb":
        return ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger",
                "--trainer.logger.init_args.project", wandb_project, "--trainer.logger.init_args.save_dir", "."]
    return []  # wandb_project: used by --use_wandb; alone it does nothing, as in MiniMind


def translate(argv: list[str], compile_supported: bool = False) -> Translation:
    """Replace MiniMind's flags in ``argv`` (``--flag value`` or ``--flag=value``) by the port's.

    Anything else passes through in place, except ``--config`` presets when MiniMind's flags are
    given: those move to the front, so MiniMind's argv overrides a preset of MiniMind's defaults
    wherever the preset is given (MiniMind's flags override its script's defaults). Raises
    :class:`UsageError` for a MiniMind flag without its value or with a value MiniMind would reject.
    """
    items: list[tuple[str, str | None] | str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok[2:].partition("=") if tok.startswith("--") else ("", "", "")
        if name not in MINIMIND_FLAGS or name in SAME:
            items.append(tok)
        elif name == "use_wandb":  # store_true in MiniMind
            if eq:
                raise UsageError("--use_wandb takes no value")
            items.append((name, None))
        elif eq:
            items.append((name, value))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            items.append((name, argv[i + 1]))
            i += 1
        else:
            raise UsageError(f"--{name} needs a value")
        i += 1
    given = dict(it for it in items if isinstance(it, tuple))  # the last value of each MiniMind flag
    if given:
        items = _presets_first(items)
    # MiniMind's default project of the script whose flags these are
    script_project = ("MiniMind-LoRA" if "lora_name" in given else "MiniMind-Agent-RL" if AGENT & given.keys()
                      else "MiniMind-PPO" if PPO & given.keys()
                      else "MiniMind-GRPO" if GRPO & given.keys()
                      else "MiniMind-DPO" if "beta" in given
                      else "MiniMind-Distillation" if DISTILL & given.keys() else WANDB_PROJECT)
    project, has_wandb = given.get("wandb_project") or script_project, "use_wandb" in given
    # train_grpo.py's flags that train_ppo.py shares (--max_gen_len, ...) keep --config minimind_ppo's objective
    ppo_preset = any(tok.removeprefix("--config=").removesuffix(".yaml").endswith("minimind_ppo") for tok in argv)
    agent_preset = any(tok.removeprefix("--config=").removesuffix(".yaml").endswith("minimind_agent") for tok in argv)
    out = Translation([])
    for it in items:
        if isinstance(it, str):
            out.args.append(it)
            continue
        flag, value = it
        rank_given = any(a.split("=", 1)[0] == "--model.lora_rank" for a in argv)
        port = _translate_one(flag, value or "", project, compile_supported, out.notes, rank_given)
        if flag in DISTILL | GRPO | PPO | AGENT and "--model.objective" not in out.origins:  # once, with the first such flag
            objective = ("agent" if AGENT & given.keys() or agent_preset else "ppo" if PPO & given.keys() or ppo_preset
                         else "distill" if flag in DISTILL else "grpo")
            port = ["--model.objective", objective, *port]
        out.args += port
        nothing = {"wandb_project": "(the project of --use_wandb)" if has_wandb else "(unused without --use_wandb)",
                   "use_compile": "(not supported yet)" if value == "1" else "(off)"}.get(flag, "(nothing: start fresh)")
        out.mapping.append((f"--{flag}" + (f" {value}" if value is not None else ""), " ".join(port) or nothing))
        out.origins.update({p: f"--{flag}" for p in port if p.startswith("--")})
    return out


def _presets_first(items: list) -> list:
    """``--config FILE`` / ``--config=FILE`` moved to the front (in their order), the rest in place."""
    presets, rest = [], []
    i = 0
    while i < len(items):
        it = items[i]
        if it == "--config" and i + 1 < len(items) and isinstance(items[i + 1], str):
            presets += [it, items[i + 1]]
            i += 2
            continue
        (presets if isinstance(it, str) and it.startswith("--config=") else rest).append(it)
        i += 1
    return presets + rest


def mapping_line(translation: Translation) -> str | None:
    """``MiniMind flags: --epochs 2 -> --trainer.max_epochs 2, ...`` (None without MiniMind flags)."""
    if not translation.mapping:
        return None
    return "MiniMind flags: " + ", ".join(f"{mm} -> {port}" for mm, port in translation.mapping)


def unknown_flag_message(token: str, port_flags: list[str]) -> str:
    """``unknown flag --epoch (did you mean --epochs?)``, matched against MiniMind's and the port's flags."""
    flag = token.split("=", 1)[0]
    known = [f"--{f}" for f in MINIMIND_FLAGS] + port_flags
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    return f"unknown flag {flag} " + (f"(did you mean {close[0]}?)" if close else "(see --help)")


def name_origins(message: str, origins: dict[str, str]) -> str:
    """Name the MiniMind flag beside the port flag it was translated into: ``--data.batch_size (--batch_size)``."""
    for port, minimind in origins.items():
        if port != minimind:
            message = re.sub(rf"{re.escape(port)}(?![\w.])", f"{port} ({minimind})", message, count=1)
    return message
