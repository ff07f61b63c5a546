"""Checks of the parsed command line, before anything is built: one ``error:`` line per mistake."""

from __future__ import annotations

import operator
import re
from pathlib import Path
from typing import Any

from lit_minimind.cli.flags import unknown_flag_message
from lit_minimind.errors import UsageError

# (key, comparison, bound): the value must satisfy it (None = unset is fine)
BOUNDS: list[tuple[str, str, float]] = [
    ("data.batch_size", ">=", 1),
    ("data.max_seq_len", ">=", 3),  # bos + one token + eos
    ("data.num_workers", ">=", 0),
    ("log_interval", ">=", 1),
    ("resume.save_interval", ">=", 1),
    ("resume.keep_last", ">=", 1),
    ("resume.save_every_minutes", ">", 0),  # or "auto"
    ("resume.mtbf", ">", 0),
    ("model.learning_rate", ">", 0),
    ("model.hidden_size", ">=", 1),
    ("model.num_hidden_layers", ">=", 1),
    ("model.num_attention_heads", ">=", 1),
    ("model.num_key_value_heads", ">=", 1),
    ("model.vocab_size", ">=", 3),  # MiniMind's pad, bos, eos
    ("model.num_experts", ">=", 1),
    ("model.num_experts_per_tok", ">=", 1),
    ("model.warmup_steps", ">=", 0),
    ("model.weight_decay", ">=", 0),
    ("model.dropout", ">=", 0),
    ("model.dropout", "<", 1),
    ("data.val_fraction", ">=", 0),
    ("data.val_fraction", "<", 1),
    ("trainer.accumulate_grad_batches", ">=", 1),
    ("trainer.gradient_clip_val", ">=", 0),
    ("trainer.max_epochs", ">=", -1),
    ("trainer.max_steps", ">=", -1),
]
OPS = {">=": operator.ge, ">": operator.gt, "<": operator.lt}
PRECISIONS = "32-true, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true"


def validate(config: Any) -> None:
    """Raise :class:`UsageError` (``--data.batch_size must be >= 1 (got 0)``) for the first invalid value."""
    for key, op, bound in BOUNDS:
        value = config.get(key)
        if value is not None and not isinstance(value, (bool, str)) and not OPS[op](value, bound):  # str: 'auto'
            raise UsageError(f"--{key} must be {op} {bound:g} (got {value})")
    hidden, heads, kv = (config.get(f"model.{k}") for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    if hidden // heads < 2 or (hidden // heads) % 2:  # RoPE rotates pairs: the head size must be even
        raise UsageError(f"--model.hidden_size // --model.num_attention_heads (the head size) must be even and >= 2 "
                         f"(got {hidden} // {heads} = {hidden // heads})")
    if heads % kv:
        raise UsageError(f"--model.num_attention_heads must be a multiple of --model.num_key_value_heads (got {heads} and {kv})")
    if config.get("model.use_moe") and config.get("model.num_experts_per_tok") > config.get("model.num_experts"):
        raise UsageError(f"--model.num_experts_per_tok must be <= --model.num_experts "
                         f"(got {config.get('model.num_experts_per_tok')} > {config.get('model.num_experts')})")
    epochs, steps, max_time = (config.get(f"trainer.{k}") for k in ("max_epochs", "max_steps", "max_time"))
    if epochs == -1 and (steps is None or steps == -1) and max_time is None:
        raise UsageError("--trainer.max_epochs -1 (MiniMind's --epochs -1: train forever) needs an end: give "
                         "--trainer.max_steps N or --trainer.max_time DD:HH:MM:SS (the LR schedule is laid out over it)")
    ckpt = config.get("ckpt_path")
    if ckpt and ckpt != "last" and Path(ckpt).is_dir():
        raise UsageError(f"--ckpt_path {ckpt} is a directory; give a checkpoint file or 'last'")


def parse_error_line(message: str, port_flags: list[str]) -> str:
    """jsonargparse's multi-line error as one line naming the flag."""
    lines = message.strip().splitlines() or [message]
    if m := re.match(r"unrecognized arguments: (.*)", lines[0]):
        token = m[1].split()[0] if m[1].split() else m[1]
        return unknown_flag_message(token, port_flags) if token.startswith("-") else f"unexpected argument {token!r}"
    m = re.match(r'Parser key "([^"]+)":\s*(.*)', lines[0])
    if not m:
        return " ".join(line.strip() for line in lines)
    flag, detail = f"--{m[1]}", m[2].strip()
    given = re.search(r"(?:Given value|Got value): (.*)", message)
    if m[1] == "config" or "does not exist" in detail:
        return f"{flag}: {detail[:1].lower()}{detail[1:]}"
    if m[1] == "trainer.precision" and given:
        return f"{flag} must be one of {PRECISIONS} (got {given[1].strip()!r})"
    if given:
        types = [t for t in re.findall(r"Expected a <class '(\w+)'>", message) if t != "NoneType"]
        return f"{flag}: invalid value {given[1].strip()!r}" + (f" (expected {' or '.join(types)})" if types else "")
    return f"{flag}: {detail or ' '.join(line.strip() for line in lines[1:])}"
