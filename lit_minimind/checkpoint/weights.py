"""Weights in MiniMind's format: the fp16 export, MiniMind's keys in our checkpoints, weights out of
any checkpoint, and the model shape a state dict implies.

MiniMind (lesson 15) writes ``out/{stem}.pth`` (fp16 weights) and ``checkpoints/{stem}_resume.pth``
(``model`` fp16, ``optimizer``, ``epoch``, ``step``, ``world_size``, ``wandb_id``, ``scaler``). Our
Lightning checkpoint carries those keys too (:func:`add_minimind_keys`), sharing the optimizer's
tensors with Lightning's ``optimizer_states`` so ``torch.save`` writes them once; ``_resume.pth``
is a hard link to the newest one. An original MiniMind file becomes a Lightning checkpoint in
:func:`to_lightning`; its missing loop counters are built by :func:`lit_minimind.resume.states.loops_at`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lit_minimind.checkpoint.names import (
    DATA_STATE_KEY,
    FIELDS_KEY,
    HF_CONFIG_KEY,
    LORA_KEY,
    MINIMIND_KEYS,
    MINIMIND_PPO_KEYS,
    MODULE_PREFIX,
    RESUME_STATE_KEY,
)
from lit_minimind.errors import CheckpointError


def checkpoint_kind(ckpt: Mapping[str, Any]) -> str:
    """``lightning``, ``minimind_resume``, ``hf`` (a Hugging Face directory), ``weights`` or ``unknown``."""
    if HF_CONFIG_KEY in ckpt:
        return "hf"
    if "state_dict" in ckpt and "pytorch-lightning_version" in ckpt:
        return "lightning"
    if all(k in ckpt for k in MINIMIND_KEYS):
        return "minimind_resume"
    if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return "weights"
    return "unknown"


def fp16_weights(state_dict: Mapping[str, torch.Tensor], prefix: str = MODULE_PREFIX) -> dict[str, torch.Tensor]:
    """MiniMind's export: the tensors under ``prefix`` (a LightningModule's ``model.``), prefix
    removed, fp16 on CPU. The one fp16 export of the project."""
    halves: dict[int, torch.Tensor] = {}  # tied weights (embedding = lm_head) stay one tensor
    out = {}
    for k, v in state_dict.items():
        if k.startswith(prefix):
            key = v.untyped_storage().data_ptr() + v.storage_offset()
            if key not in halves or halves[key].shape != v.shape:
                halves[key] = v.detach().half().cpu()
            out[k[len(prefix):]] = halves[key]
    return out


def add_minimind_keys(checkpoint: dict[str, Any], *, step: int, world_size: int, wandb_id: str | None,
                      scaler_state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    """Make a Lightning checkpoint dict MiniMind's resume dict as well; returns the fp16 weights.

    ``epoch`` is Lightning's own key, equal to MiniMind's (the 0-based epoch of the position).
    ``scaler`` is always present: MiniMind's loader calls ``scaler.load_state_dict`` unconditionally.
    """
    weights = fp16_weights(checkpoint["state_dict"])
    checkpoint.update(model=weights, optimizer=checkpoint["optimizer_states"][0], step=step, world_size=world_size,
                      wandb_id=wandb_id, scaler=scaler_state or {})
    return weights


def to_lightning(ckpt: dict[str, Any]) -> dict[str, Any]:
    """An original MiniMind resume dict as a Lightning checkpoint dict (loop counters left to the resume)."""
    import lightning  # here, not at the top: `import lit_minimind`, inspect, export and generate never load Lightning

    # restart_draws: MiniMind's file holds no RNG state; its resumed run draws afresh from the resume position
    position = {"epoch": int(ckpt["epoch"]), "step": int(ckpt["step"]), "world_size": int(ckpt.get("world_size") or 1),
                "restart_draws": True}
    converted: dict[str, Any] = {
        "state_dict": {MODULE_PREFIX + k: v.float() for k, v in ckpt["model"].items()},
        "optimizer_states": [ckpt["optimizer"]],
        "lr_schedulers": [],
        "pytorch-lightning_version": lightning.__version__,
        "epoch": position["epoch"],
        "global_step": None,  # counted by the resume from the position and the accumulation
        "loops": None,
        DATA_STATE_KEY: position,
        "callbacks": {RESUME_STATE_KEY: {"wandb_id": ckpt.get("wandb_id"), "source_format": "minimind_resume"}},
    }
    for key in MINIMIND_PPO_KEYS:  # train_ppo.py's extra keys: LitMiniMind's PPO restore reads them
        if key in ckpt:
            converted[key] = ckpt[key]
    if ckpt.get("scaler"):  # Lightning restores this key into any MixedPrecision plugin's scaler
        converted["native_amp_scaling_state"] = ckpt["scaler"]
    return converted


def model_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's weights with MiniMind's keys out of any checkpoint: ours or Lightning's (fp32),
    an original MiniMind resume dict or fp16 export (fp16), a Hugging Face directory (its dtype)."""
    kind = checkpoint_kind(ckpt)
    if kind == "lightning":
        return {k[len(MODULE_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(MODULE_PREFIX)}
    if kind in ("minimind_resume", "hf"):
        return ckpt["model"]
    if kind == "weights":
        return ckpt
    raise ValueError(f"no model weights in a checkpoint with keys {sorted(ckpt)[:8]}")


GIVE_A_MODEL = "give MiniMind weights (out/NAME_HIDDEN.pth), a checkpoint (.ckpt, *_resume.pth) or a Hugging Face export"


def not_a_model(ckpt: dict[str, Any], path: Any) -> str | None:
    """None when ``ckpt`` (read from ``path``) holds a MiniMind model's weights; else one line saying what
    the file holds instead (LoRA adapters, an optimizer's state, other tensors, ...) and what to do.
    The one check of ``generate``, ``export`` and ``inspect``."""
    try:
        weights = model_weights(ckpt)
    except ValueError:
        weights = {}
    if any(k.endswith("embed_tokens.weight") for k in weights):
        return None
    adapters = [k for k in weights if k.endswith(".lora.A.weight")]
    if adapters and all(LORA_KEY in k for k in weights):
        ranks = "/".join(str(r) for r in sorted({int(weights[k].shape[0]) for k in adapters}))
        return (f"{path}: LoRA adapters only ({len(adapters)}, rank {ranks}), not a whole model: use them with the "
                f"model they were trained on: python -m lit_minimind.generate BASE --lora {path} "
                f"(or merge them into it: python -m lit_minimind.merge_lora BASE {path})")
    keys = ", ".join(sorted(map(str, weights or ckpt))[:5]) or "none"
    if {"state", "param_groups"} <= ckpt.keys():
        return f"{path}: an optimizer's state (state, param_groups), no model weights: {GIVE_A_MODEL}"
    kind = {"lightning": "a Lightning checkpoint", "minimind_resume": "a MiniMind resume file",
            "hf": "a Hugging Face directory"}.get(checkpoint_kind(ckpt))
    if kind is not None:
        return f"{path}: {kind} without a MiniMind model's weights (keys: {keys}): {GIVE_A_MODEL}"
    if weights:
        return f"{path}: tensors, but no MiniMind weights among them (no embed_tokens.weight; keys: {keys}): {GIVE_A_MODEL}"
    return f"{path}: not model weights or a checkpoint (keys: {keys}): {GIVE_A_MODEL}"


def require_model_weights(ckpt: dict[str, Any], path: Any) -> dict[str, torch.Tensor]:
    """:func:`model_weights` of a file a command loads as a model; :class:`CheckpointError` with
    :func:`not_a_model`'s line for any other file."""
    problem = not_a_model(ckpt, path)
    if problem is not None:
        raise CheckpointError(problem)
    return model_weights(ckpt)


def saved_config(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    """The model config a checkpoint records beside its weights (``MiniMindConfig`` fields among
    others): a Lightning checkpoint's ``hyper_parameters``, a Hugging Face directory's ``config.json``;
    {} for files that record none (fp16 exports, MiniMind's resume files)."""
    kind = checkpoint_kind(ckpt)
    if kind == "hf":
        return dict(ckpt[FIELDS_KEY])
    if kind == "lightning" and isinstance(ckpt.get("hyper_parameters"), Mapping):
        return dict(ckpt["hyper_parameters"])
    return {}


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare model under DDP (``.module``), ``torch.compile`` (``_orig_mod``) or our LightningModule."""
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(inner, "lm_head"):  # LitMiniMind -> MiniMindForCausalLM
        model = inner
    return model


def fp16_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """MiniMind's export of a model (any wrapper): :func:`fp16_weights` of the bare model."""
    return fp16_weights(unwrap_model(model).state_dict(), prefix="")


SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "use_moe",
                "num_experts", "vocab_size")


def shape_config(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The model-shape fields implied by a MiniMind state dict (any key prefix)."""
    def find(suffix: str) -> torch.Tensor | None:
        return next((v for k, v in state_dict.items() if k.endswith(suffix)), None)

    embed = find("embed_tokens.weight")
    if embed is None:
        return {}
    head_dim = find("layers.0.self_attn.q_norm.weight").shape[0]
    layers = {int(k.split("layers.")[1].split(".")[0]) for k in state_dict if "layers." in k}
    experts = {int(k.split("experts.")[1].split(".")[0]) for k in state_dict if ".mlp.experts." in k and "layers.0." in k}
    return {
        "hidden_size": int(embed.shape[1]),
        "num_hidden_layers": len(layers),
        "num_attention_heads": int(find("layers.0.self_attn.q_proj.weight").shape[0] // head_dim),
        "num_key_value_heads": int(find("layers.0.self_attn.k_proj.weight").shape[0] // head_dim),
        "use_moe": bool(experts),
        "num_experts": len(experts) if experts else None,
        "vocab_size": int(embed.shape[0]),
    }


def config_mismatches(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``field: checkpoint X, this run Y`` for every shape field that differs."""
    out = []
    for field in SHAPE_FIELDS:
        if field == "num_experts" and not (saved.get("use_moe") and current.get("use_moe")):
            continue
        if field in saved and field in current and saved[field] != current[field]:
            out.append(f"{field}: checkpoint {saved[field]}, this run {current[field]}")
    return out
