"""``python -m lit_minimind.inspect PATH [--json]``: what is inside any checkpoint.

Works on ours (MiniMind resume dict with extras, Lightning ``.ckpt``), original MiniMind's
files and fp16 exports. Every byte of a torch zip file is verified first (``verify_file``: record
CRC-32s and the zip structure, no manifest needed); loading is always ``weights_only``; a bad
file is reported, not raised.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from lit_minimind.checkpoint.names import (
    MINIMIND_KEYS,
    POSITION_KEYS,
    RESUME_STATE_KEY,
    TRAINING_STATE_KEY,
    manifest_path,
)
from lit_minimind.checkpoint.read import harmful_imports, read_checkpoint, verify_file, verify_manifest
from lit_minimind.checkpoint.weights import checkpoint_kind, model_weights, not_a_model, shape_config
from lit_minimind.cli.plain import description
from lit_minimind.errors import CheckpointError, NotATorchZip, UnverifiableCheckpoint

SCALER_KEYS = frozenset({"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"})


def summarize(path: str | Path) -> dict[str, Any]:
    """A JSON-able summary of the checkpoint at ``path``; ``valid`` False with ``error`` when unusable."""
    path = Path(path)
    info: dict[str, Any] = {"path": str(path), "file_size": path.stat().st_size if path.is_file() else None,
                            "manifest": manifest_path(path).exists()}
    try:  # every byte first: JSON or text is "not a checkpoint" (not a pickle to refuse), a flipped byte shows
        verify_file(path)
        info["verified"] = True
    except NotATorchZip as err:
        if not err.legacy:  # a pickle torch.save did not write: no checkpoint, maybe a trap; never unpickled
            return {**info, "valid": False, "verified": False, "error": _plain_pickle_error(path)}
        info.update(verified=False, integrity=str(err))  # torch's legacy format: load it, unverified
    except UnverifiableCheckpoint as err:  # saved without CRCs: its layout checked, load it
        info.update(verified=False, integrity=str(err))
    except CheckpointError as err:
        return {**info, "valid": False, "verified": False, "error": str(err)}
    try:
        verify_manifest(path)  # also catches a whole valid file swapped for another
        ckpt = read_checkpoint(path, verify=False)  # verified above: no second read
    except CheckpointError as err:
        return {**info, "valid": False, "error": str(err)}
    kind = checkpoint_kind(ckpt)
    info.update(valid=kind != "unknown", format=kind)
    if kind in ("weights", "unknown") and (problem := not_a_model(ckpt, path)):  # adapters, optimizer state, ...
        return {**info, "valid": False, "not_a_model": True, "error": problem}
    if kind == "lightning":
        weights = model_weights(ckpt)  # MiniMind's keys: the metrics' states are no weights
        callback = (ckpt.get("callbacks") or {}).get(RESUME_STATE_KEY) or {}
        state = {**{k: ckpt[k] for k in POSITION_KEYS if k in ckpt}, **callback}
        optimizer = (ckpt.get("optimizer_states") or [None])[0]
        info.update(global_step=ckpt.get("global_step"), lightning_version=ckpt.get("pytorch-lightning_version"),
                    minimind_keys=all(k in ckpt for k in MINIMIND_KEYS),  # also loadable by MiniMind's lm_checkpoint
                    written_by="lit-minimind" if callback else "Lightning", versions=callback.get("versions"),
                    fp32_master_weights=True)
        training = ckpt.get(TRAINING_STATE_KEY) or {}
        # saves are taken at optimizer-step boundaries: only files of format 1 and 2 (before) may list gradients
        state = {**state, "grads": training.get("shards") or next(
            (r["grads"] for r in training.get("ranks") or [] if r.get("grads")), None)}
    elif kind == "minimind_resume":
        weights = ckpt["model"]
        state = {k: ckpt.get(k) for k in POSITION_KEYS}
        optimizer = ckpt.get("optimizer")
        info.update(written_by="original MiniMind", versions=None, fp32_master_weights=False)
    else:  # "weights" (any other file: not_a_model above)
        weights, state, optimizer = ckpt, {}, None
    info.update({k: state.get(k) for k in POSITION_KEYS})
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
    info["scaler"] = _find_scaler(ckpt)
    return info


def _find_scaler(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The GradScaler state stored at the top level, under whatever key: MiniMind's ``scaler``, or in a
    Lightning ``.ckpt`` the precision plugin's class ``__qualname__`` (``MixedPrecision``,
    ``CPUFloat16Mixed``, ...). ``None`` when there is none (MiniMind stores ``{}`` without one)."""
    for key, value in ckpt.items():
        if isinstance(value, dict) and SCALER_KEYS <= value.keys():
            return {"scale": float(value["scale"]), "growth_tracker": int(value["_growth_tracker"]), "stored_under": key}
    return None


def _plain_pickle_error(path: Path) -> str:
    """Why a plain pickle (not a torch.save file) is refused, from its opcodes: it is never unpickled."""
    harmful = harmful_imports(path.read_bytes())
    if harmful:
        return (f"{path}: refused to load: a pickle (not a torch.save file) that would import "
                f"{', '.join(harmful[:5])} and run it. Only load files you trust; this one is not a checkpoint.")
    return f"{path}: not a checkpoint: a plain pickle (not written by torch.save)"


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
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.inspect", description=description(__doc__))
    parser.add_argument("path", help="a .pth / .ckpt checkpoint file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    info = summarize(args.path)
    if info.get("not_a_model"):  # a file to give another command (LoRA adapters: generate --lora): say so, no table
        if args.json:
            print(json.dumps(info, indent=1, default=str))
        print(f"error: {info['error']}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1, default=str))
    else:
        _render(info)
    return 0 if info.get("valid") else 1


if __name__ == "__main__":
    sys.exit(main())
