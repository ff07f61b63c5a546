"""``python -m lit_minimind.generate WEIGHTS --prompt TEXT``: see what a trained model learned.

Loads an fp16 export (``out/pretrain_128.pth``, ours or MiniMind's) or any resume checkpoint,
infers the model shape from its tensors, and continues the prompt (KV cache; greedy, or
temperature / top-p / top-k sampling).
"""

from __future__ import annotations

import argparse
import sys

import torch

from lit_minimind.checkpoint import CheckpointError, checkpoint_kind, read_checkpoint, shape_config
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from lit_minimind.tokenizer import BOS_ID, EOS_ID, build_default_tokenizer, encode, load_tokenizer


def load_model(path: str) -> MiniMindForCausalLM:
    """A float32 model, in eval mode, from any checkpoint holding MiniMind weights."""
    ckpt = read_checkpoint(path)
    kind = checkpoint_kind(ckpt)
    if kind == "weights":
        weights = ckpt
    elif kind == "minimind_resume":
        weights = (ckpt.get("lit_minimind") or {}).get("model_fp32") or ckpt["model"]
    elif kind == "lightning":
        weights = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    else:
        raise CheckpointError(f"{path}: no MiniMind weights found")
    fields = {k: v for k, v in shape_config(weights).items() if v is not None}
    model = MiniMindForCausalLM(MiniMindConfig(**fields))
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.generate", description=__doc__.splitlines()[0])
    parser.add_argument("weights", help="fp16 export, *_resume.pth or Lightning .ckpt")
    parser.add_argument("--prompt", action="append", required=True, help="text to continue (repeatable)")
    parser.add_argument("--tokenizer_path", default=None, help="directory with tokenizer.json (default: the embedded one)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=0.9)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        model = load_model(args.weights)
        tokenizer = load_tokenizer(args.tokenizer_path or build_default_tokenizer())
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(args.seed)
    for prompt in args.prompt:
        ids = torch.tensor([[BOS_ID, *encode(tokenizer, prompt, model.config.max_position_embeddings)]])
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, greedy=args.temperature == 0,
                             eos_token_id=EOS_ID, generator=generator)
        print(f"{prompt}{tokenizer.decode(out[0, ids.shape[1]:].tolist())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
