"""Hugging Face format: MiniMind weights as a Qwen3 / Qwen3-MoE model directory, and back.

MiniMind's model is Qwen3's (GQA attention with per-head q/k RMSNorm, SwiGLU MLP, top-k MoE with
softmax routing, tied embeddings), with the same parameter names. MiniMind's own
``scripts/convert_model.py`` (``convert_torch2transformers``, transformers >= 5) loads its weights
into ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` and calls ``save_pretrained``; this module writes
the same ``config.json`` and the same tensors with ``safetensors`` and ``json`` only:

- dense: the keys unchanged, ``lm_head.weight`` left out (tied to ``model.embed_tokens.weight``);
- MoE: transformers >= 5 holds the experts stacked in memory (``mlp.experts.gate_up_proj``
  ``(E, 2I, H)``, ``mlp.experts.down_proj`` ``(E, H, I)``), which is what the converter builds, but its
  ``save_pretrained`` writes them back per expert (``mlp.experts.{e}.gate_proj.weight``, ...): the
  layout of Qwen3-MoE checkpoints, which transformers, llama.cpp and vLLM read. We write that
  layout; reading accepts both.

Nothing here imports ``transformers``. Reading a directory checks everything that would change
what the model computes and names the first difference in one line (:class:`CheckpointError`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lit_minimind.checkpoint.names import FIELDS_KEY, HF_CONFIG_KEY
from lit_minimind.errors import CheckpointError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TRANSFORMERS_VERSION = "5.24.0"  # the release whose converter output this layout was checked against
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# the MiniMindConfig fields a config.json carries (the rest of a Qwen3 config is fixed by MiniMind's model)
MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                "tie_word_embeddings", "hidden_act")
REQUIRED_FIELDS = MODEL_FIELDS[:6] + ("rms_norm_eps",)


def hf_config(config: Mapping[str, Any], dtype: str = "float16") -> dict[str, Any]:
    """``config.json`` for a MiniMind config (``MiniMindConfig.to_dict()``), as MiniMind's
    ``convert_torch2transformers`` writes it with transformers >= 5: the Qwen3 defaults it leaves in
    place, ``rope_theta`` set, ``rope_scaling`` null, keys sorted as ``save_pretrained`` sorts them."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    moe = bool(config["use_moe"])
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES["qwen3_moe" if moe else "qwen3"]],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": dtype,
        "eos_token_id": None,
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "hidden_act": config["hidden_act"],
        "hidden_size": config["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "num_attention_heads": config["num_attention_heads"],
        "num_hidden_layers": config["num_hidden_layers"],
        "num_key_value_heads": config["num_key_value_heads"],
        "pad_token_id": None,
        "rms_norm_eps": config["rms_norm_eps"],
        "sliding_window": None,
        "tie_word_embeddings": config["tie_word_embeddings"],
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": config["vocab_size"],
    }
    if moe:
        out.update(decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=config["moe_intermediate_size"],
                   norm_topk_prob=config["norm_topk_prob"], num_experts_per_tok=config["num_experts_per_tok"],
                   num_local_experts=config["num_experts"], output_router_logits=False,
                   router_aux_loss_coef=0.001)  # Qwen3MoeConfig's default: the converter does not pass MiniMind's
    else:
        out.update(layer_types=["full_attention"] * config["num_hidden_layers"], max_window_layers=28)
    out = dict(sorted(out.items()))
    out["rope_theta"] = float(config["rope_theta"])
    out["rope_scaling"] = None
    return out


def generation_config() -> dict[str, Any]:
    """``generation_config.json``: MiniMind's special tokens, so ``generate`` stops at ``<|im_end|>``."""
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "transformers_version": TRANSFORMERS_VERSION, "use_cache": True}


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a MiniMind model (MiniMind's keys) with its shape."""
    hidden, head_dim = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        })
        if config["use_moe"]:
            inter = config["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (config["num_experts"], hidden)
            for e in range(config["num_experts"]):
                shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", hidden, inter))
        else:
            shapes.update(_mlp_shapes(p + "mlp.", hidden, config["intermediate_size"]))
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def check_weights(weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], what: str) -> None:
    """Raise one line naming the first missing, unexpected or misshapen tensor of ``weights``."""
    shapes = expected_shapes(config)
    missing = [k for k in shapes if k not in weights]
    extra = [k for k in weights if k not in shapes]
    wrong = [f"{k} {tuple(weights[k].shape)}, expected {shapes[k]}" for k in shapes
             if k in weights and tuple(weights[k].shape) != shapes[k]]
    for label, items in (("missing tensor", missing), ("unexpected tensor", extra), ("shape", wrong)):
        if items:
            more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
            raise CheckpointError(f"{what}: {label} {items[0]}{more}")


def to_hf(weights: Mapping[str, torch.Tensor], config: Mapping[str, Any], dtype: str = "float16",
          what: str = "weights") -> dict[str, torch.Tensor]:
    """MiniMind weights as the tensors of the HF directory's ``model.safetensors``: ``dtype``, contiguous,
    none shared; ``lm_head.weight`` left out (tied: it must equal the embedding)."""
    check_weights(weights, config, what)
    if not config["tie_word_embeddings"]:
        raise CheckpointError(f"{what}: untied embeddings (tie_word_embeddings false): MiniMind's models tie them")
    if not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]):
        raise CheckpointError(f"{what}: lm_head.weight differs from model.embed_tokens.weight, but MiniMind ties them")
    out = {}
    for k, v in weights.items():
        if k != "lm_head.weight":
            out[k] = v.detach().to(device="cpu", dtype=DTYPES[dtype]).contiguous().clone()
    return out


# ------------------------------------------------------------------ reading an HF directory

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def is_hf_directory(path: str | Path) -> bool:
    """A directory with a ``config.json``: what :func:`read_hf_directory` reads."""
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def read_hf_directory(path: str | Path) -> dict[str, Any]:
    """``{HF_CONFIG_KEY: config.json, FIELDS_KEY: its MiniMindConfig fields, "model": MiniMind weights}`` from an HF directory of a Qwen3 / Qwen3-MoE
    model with MiniMind's shapes (``model.safetensors`` or a sharded ``model.safetensors.index.json``).
    The weights keep the file's dtype; ``lm_head.weight`` is the embedding tensor itself (tied)."""
    path = Path(path)
    config = _read_json(path / CONFIG_FILE)
    fields = minimind_fields(config, str(path / CONFIG_FILE))
    tensors = _read_tensors(path)
    weights = from_hf(tensors, fields, str(path))
    return {HF_CONFIG_KEY: config, FIELDS_KEY: fields, "model": weights}


def minimind_fields(config: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The MiniMindConfig fields of a Qwen3 / Qwen3-MoE ``config.json``; one line naming the first
    setting MiniMind's model cannot reproduce."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        arch = ", ".join(config.get("architectures") or []) or "no architectures"
        raise CheckpointError(f"{what}: model_type {model_type!r} ({arch}) is not Qwen3 or Qwen3-MoE, "
                              "the architectures that hold MiniMind's model")
    moe = model_type == "qwen3_moe"
    fields: dict[str, Any] = {"use_moe": moe}
    for name in MODEL_FIELDS:
        if name in REQUIRED_FIELDS and not isinstance(config.get(name), (int, float)):
            raise CheckpointError(f"{what}: no {name}")
        if config.get(name) is not None:
            fields[name] = config[name]
    if moe:
        fields["num_experts"] = config.get("num_local_experts", config.get("num_experts"))
        fields["norm_topk_prob"] = bool(config.get("norm_topk_prob", False))  # Qwen3MoeConfig's default
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if name != "num_experts":
                fields[name] = config.get(name)
            if not isinstance(fields[name], int):
                raise CheckpointError(f"{what}: no {'num_local_experts' if name == 'num_experts' else name}")
    natural_head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    # what must hold for MiniMind's model to compute what the HF model computes (absent: the Qwen3 default)
    required: list[tuple[str, Any, Any]] = [
        ("head_dim", fields.get("head_dim", natural_head_dim), natural_head_dim),
        ("hidden_act", fields.get("hidden_act", "silu"), "silu"),
        ("tie_word_embeddings", fields.get("tie_word_embeddings", True), True),
        ("attention_bias", config.get("attention_bias", False), False),
        ("use_sliding_window", config.get("use_sliding_window", False), False),
        ("rope_scaling", config.get("rope_scaling"), None),
    ]
    if moe:
        required += [("decoder_sparse_step", config.get("decoder_sparse_step", 1), 1),
                     ("mlp_only_layers", config.get("mlp_only_layers") or [], [])]
    for name, value, want in required:
        if value != want:
            raise CheckpointError(f"{what}: {name} is {json.dumps(value)}; MiniMind's model needs {json.dumps(want)}")
    rope = config.get("rope_parameters")  # transformers >= 5 without the converter's rope_theta edit
    if fields.get("rope_theta") is None and isinstance(rope, dict):
        if rope.get("rope_type", "default") != "default":
            raise CheckpointError(f"{what}: rope_parameters.rope_type is {rope.get('rope_type')!r}; MiniMind's model needs 'default'")
        fields["rope_theta"] = rope.get("rope_theta")
    if fields.get("rope_theta") is None:
        raise CheckpointError(f"{what}: no rope_theta")
    fields.update(head_dim=natural_head_dim, hidden_act="silu", tie_word_embeddings=True,
                  rope_theta=float(fields["rope_theta"]))
    if not moe:
        fields.pop("num_experts", None)
    return fields


def from_hf(tensors: Mapping[str, torch.Tensor], fields: Mapping[str, Any], what: str) -> dict[str, torch.Tensor]:
    """The MiniMind weights of an HF model's tensors: stacked experts split per expert, ``lm_head.weight``
    the embedding (tied); one line naming the first tensor that differs from MiniMind's model."""
    weights: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        stacked = _STACKED.match(key)
        if stacked is None:
            weights[key] = value
            continue
        prefix, name = stacked.groups()
        n = fields.get("num_experts") or 0
        if value.dim() != 3 or value.shape[0] != n:
            raise CheckpointError(f"{what}: shape {key} {tuple(value.shape)}, expected ({n}, ...) stacked experts")
        if name == "down_proj":
            for e in range(n):
                weights[f"{prefix}.{e}.down_proj.weight"] = value[e]
        else:
            gate, up = value.chunk(2, dim=1)
            for e in range(n):
                weights[f"{prefix}.{e}.gate_proj.weight"], weights[f"{prefix}.{e}.up_proj.weight"] = gate[e], up[e]
    embed = weights.get("model.embed_tokens.weight")
    head = weights.pop("lm_head.weight", None)
    if head is not None and embed is not None and not torch.equal(head, embed):
        raise CheckpointError(f"{what}: lm_head.weight differs from model.embed_tokens.weight; MiniMind ties them")
    if embed is not None:
        weights["lm_head.weight"] = embed
    check_weights(weights, fields, what)
    weights = {k: v.contiguous() for k, v in weights.items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{file}: unreadable ({err})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return value


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` or of the shards an index lists."""
    from safetensors.torch import load_file

    if (path / WEIGHTS_FILE).is_file():
        files = [path / WEIGHTS_FILE]
    elif (path / INDEX_FILE).is_file():
        weight_map = _read_json(path / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path / INDEX_FILE}: no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    else:
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {', '.join(others[:3])}: only safetensors is read)" if others else ""
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as err:  # safetensors raises its own error types for damaged headers/bytes
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"{file}: not a readable safetensors file ({first})") from None
    return tensors
