"""``python -m lit_minimind.inspect PATH [--json]``: what is inside any checkpoint.

Works on ours (MiniMind resume dict with extras, Lightning ``.ckpt``), original MiniMind's
files and fp16 exports. Loading is always ``weights_only``; a bad file is reported, not raised.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from lit_minimind.checkpoint import CheckpointError, checkpoint_kind, manifest_path, read_checkpoint, shape_config
from lit_minimind.lightning_io import RESUME_STATE_KEY


def summarize(path: str | Path) -> dict[str, Any]:
    """A JSON-able summary of the checkpoint at ``path``; ``valid`` False with ``error`` when unusable."""
    path = Path(path)
    info: dict[str, Any] = {"path": str(path), "file_size": path.stat().st_size if path.is_file() else None,
                            "manifest": manifest_path(path).exists()}
    try:
        ckpt = read_checkpoint(path)
    except CheckpointError as err:
        return {**info, "valid": False, "error": str(err)}
    kind = checkpoint_kind(ckpt)
    info.update(valid=kind != "unknown", format=kind)
    if kind == "lightning":
        weights = ckpt["state_dict"]
        state = (ckpt.get("callbacks") or {}).get(RESUME_STATE_KEY) or {}
        optimizer = (ckpt.get("optimizer_states") or [None])[0]
        scaler = ckpt.get("MixedPrecision")
        info.update(global_step=ckpt.get("global_step"), lightning_version=ckpt.get("pytorch-lightning_version"))
    elif kind == "minimind_resume":
        weights = ckpt["model"]
        extra = ckpt.get("lit_minimind") or {}
        state = {**(extra.get("callback") or {}), **{k: ckpt.get(k) for k in ("epoch", "step", "world_size", "wandb_id")}}
        optimizer, scaler = ckpt.get("optimizer"), ckpt.get("scaler") or None
        info.update(written_by="lit-minimind" if extra else "original MiniMind", versions=extra.get("versions"),
                    fp32_master_weights="model_fp32" in extra)
    elif kind == "weights":
        weights, state, optimizer, scaler = ckpt, {}, None, None
    else:
        return {**info, "error": f"unrecognised keys: {sorted(ckpt)[:10]}"}
    info.update({k: state.get(k) for k in ("epoch", "step", "world_size", "wandb_id")})
    if "global_step" not in info and state.get("global_step") is not None:
        info["global_step"] = state["global_step"]
    info["partial_gradients"] = state.get("grads") is not None if state else None
    tensors = [v for v in weights.values() if isinstance(v, torch.Tensor)]
    info["model_config"] = shape_config(weights)
    info["parameters"] = sum(v.numel() for v in tensors) - _tied_numel(weights)
    info["dtypes"] = dict(Counter(str(v.dtype).replace("torch.", "") for v in tensors))
    if optimizer:
        group = optimizer["param_groups"][0]
        steps = [s.get("step") for s in optimizer.get("state", {}).values()]
        info["optimizer"] = {"param_groups": len(optimizer["param_groups"]), "lr": group.get("lr"),
                             "betas": list(group.get("betas", [])), "weight_decay": group.get("weight_decay"),
                             "steps": int(steps[0]) if steps and steps[0] is not None else 0}
    info["scaler"] = {"scale": float(scaler["scale"]), "growth_tracker": int(scaler.get("_growth_tracker", 0))} if scaler else None
    return info


def _tied_numel(weights: dict[str, Any]) -> int:
    """Size of lm_head when it is tied to (equal to) the embedding, so it is counted once."""
    head = next((v for k, v in weights.items() if k.endswith("lm_head.weight")), None)
    embed = next((v for k, v in weights.items() if k.endswith("embed_tokens.weight")), None)
    return head.numel() if head is not None and embed is not None and torch.equal(head, embed) else 0


def _render(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoint {info['path']}", show_header=False)
    for key, value in info.items():
        if key != "path":
            table.add_row(key, json.dumps(value) if isinstance(value, (dict, list)) else str(value))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a .pth / .ckpt checkpoint file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    info = summarize(args.path)
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        _render(info)
    return 0 if info.get("valid") else 1


if __name__ == "__main__":
    sys.exit(main())
