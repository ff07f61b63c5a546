"""``python -m lit_minimind.export SRC DIR``: a model for the transformers ecosystem.

SRC is any weights this project reads (an fp16 ``.pth``, a ``.ckpt``, a ``_resume.pth``, an original
MiniMind file, an HF directory). DIR receives what ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` need, as MiniMind's ``scripts/convert_model.py`` writes it for
transformers >= 5 (Qwen3 / Qwen3-MoE): ``config.json``, ``model.safetensors``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json`` (chat template,
``PreTrainedTokenizerFast``) and ``chat_template.jinja``. DIR appears complete or not at all.
Does not import transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from lit_minimind.checkpoint.atomic import atomic_directory
from lit_minimind.checkpoint.hf import (
    CONFIG_FILE,
    DTYPES,
    GENERATION_CONFIG_FILE,
    WEIGHTS_FILE,
    generation_config,
    hf_config,
    to_hf,
)
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import config_mismatches, require_model_weights, saved_config, shape_config
from lit_minimind.cli.plain import description
from lit_minimind.data.chat_template import load_chat_template
from lit_minimind.data.tokenizer import build_default_tokenizer, load_tokenizer
from lit_minimind.errors import CheckpointError, DataError, UsageError
from lit_minimind.model import MiniMindConfig


def model_config(ckpt: dict[str, Any], weights: dict[str, Any], what: str) -> MiniMindConfig:
    """The model's config: its shape from the weights, the rest from the checkpoint's saved config
    (or MiniMind's defaults); a saved shape that the weights contradict is one line."""
    shape = {k: v for k, v in shape_config(weights).items() if v is not None}
    if not shape:
        raise CheckpointError(f"{what}: no MiniMind weights found (no model.embed_tokens.weight)")
    saved = saved_config(ckpt)
    bad = config_mismatches(saved, shape)
    if bad:
        raise CheckpointError(f"{what}: its saved config and its weights differ: {bad[0].replace('this run', 'weights')}")
    shape["intermediate_size"] = next((int(v.shape[0]) for k, v in weights.items() if k.endswith("layers.0.mlp.gate_proj.weight")), None)
    shape["moe_intermediate_size"] = next((int(v.shape[0]) for k, v in weights.items()
                                           if k.endswith("layers.0.mlp.experts.0.gate_proj.weight")), None)
    return MiniMindConfig.from_dict({**saved, **{k: v for k, v in shape.items() if v is not None}})


def recorded_tokenizer(ckpt: dict[str, Any]) -> Path | None:
    """The tokenizer directory a Lightning checkpoint was trained with (its DataModule's
    ``tokenizer_path``; the embedded default when that was unset); None when it records none."""
    data = ckpt.get("datamodule_hyper_parameters")
    if not isinstance(data, dict):
        return None
    if data.get("tokenizer_path"):
        return Path(data["tokenizer_path"])
    return build_default_tokenizer(data.get("cache_dir"))


def tokenizer_files(tokenizer_dir: Path, vocab_size: int) -> dict[str, bytes]:
    """``tokenizer.json`` (as is), ``tokenizer_config.json`` (with the chat template,
    ``tokenizer_class: PreTrainedTokenizerFast`` and ``extra_special_tokens: {}``, as MiniMind's
    converter writes it for transformers >= 5) and ``chat_template.jinja``."""
    tokenizer = load_tokenizer(tokenizer_dir)  # DataError: missing, unreadable, wrong special ids
    if tokenizer.get_vocab_size() > vocab_size:
        raise DataError(f"tokenizer {tokenizer_dir} has {tokenizer.get_vocab_size()} tokens, more than the "
                        f"model's vocab_size {vocab_size}")
    template = load_chat_template(tokenizer_dir)
    config_file = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise DataError(f"{config_file}: not a JSON object")
    config = {**config, "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast", "extra_special_tokens": {}}
    return {
        "tokenizer.json": (tokenizer_dir / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": _json(config),
        "chat_template.jinja": template.encode("utf-8"),
    }


def export_hf(src: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float16",
              tokenizer_path: str | os.PathLike | None = None, overwrite: bool = False) -> str:
    """Write the HF directory ``out_dir`` for the weights in ``src``; returns a one-line report.

    Raises :class:`CheckpointError` / :class:`DataError` / :class:`UsageError` (one line each).
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    out_dir = Path(out_dir)
    check_target(out_dir, overwrite)
    ckpt = read_checkpoint(src)
    weights = require_model_weights(ckpt, src)  # LoRA adapters, an optimizer's state, ...: one line saying so
    config = model_config(ckpt, weights, str(src))
    tensors = to_hf(weights, config.to_dict(), dtype, what=str(src))
    recorded = None if tokenizer_path else recorded_tokenizer(ckpt)
    if recorded is not None and not recorded.is_dir():
        raise DataError(f"{src} was trained with the tokenizer {recorded}, which no longer exists: pass --tokenizer_path")
    tokenizer_dir = Path(tokenizer_path) if tokenizer_path else recorded or build_default_tokenizer()
    files = {CONFIG_FILE: _json(hf_config(config.to_dict(), dtype)), GENERATION_CONFIG_FILE: _json(generation_config()),
             **tokenizer_files(tokenizer_dir, config.vocab_size)}
    with atomic_directory(out_dir, replace=overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, data in files.items():
            (tmp / name).write_bytes(data)
    kind = "Qwen3MoeForCausalLM" if config.use_moe else "Qwen3ForCausalLM"
    return f"exported {src} -> {out_dir}/ ({kind}, {dtype}, tokenizer {tokenizer_dir})"


def export_after_fit(out_dir: str | None, resume: Any, datamodule: Any, trainer: Any) -> str | None:
    """``fit --export_hf DIR``: DIR from the final fp16 weights the run saved, with the run's tokenizer
    (an earlier export there is replaced). Returns the summary's line; None without the flag."""
    if not out_dir or not trainer.is_global_zero:
        return None
    if resume.stopped_by is not None:
        return f"{out_dir} not written: stopped by {resume.stopped_by} before the end (export the final weights later)"
    if not resume.manager.saved_files:
        return f"{out_dir} not written: this run saved no weights"
    export_hf(resume.manager.saved_files[0], out_dir, tokenizer_path=datamodule.resolved_paths()[1], overwrite=True)
    return f"{out_dir}/ (from {resume.manager.saved_files[0]})"


def check_target(out_dir: Path, overwrite: bool) -> None:
    """An existing DIR is refused unless ``overwrite``; even then only an earlier export (or an empty
    directory) is replaced, never a directory of other files."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UsageError(f"{out_dir}: exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise UsageError(f"{out_dir}: already exists (pass --overwrite to replace it)")
    if not (out_dir / CONFIG_FILE).is_file():
        raise UsageError(f"{out_dir}: not an earlier export (no {CONFIG_FILE}); refusing to replace it")


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.export", description=description(__doc__))
    parser.add_argument("src", help="fp16 .pth, .ckpt, *_resume.pth, original MiniMind file or HF directory")
    parser.add_argument("dir", help="the HF directory to write (must not exist unless --overwrite)")
    parser.add_argument("--dtype", default="float16", choices=list(DTYPES), help="tensor dtype in model.safetensors")
    parser.add_argument("--tokenizer_path", default=None,
                        help="directory with tokenizer.json (default: the one the checkpoint was trained with, "
                             "else the embedded default)")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it holds an earlier export")
    args = parser.parse_args(argv)
    try:
        print(export_hf(args.src, args.dir, args.dtype, args.tokenizer_path, args.overwrite), flush=True)
    except (CheckpointError, DataError, UsageError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
