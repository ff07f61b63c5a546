"""``python -m lit_minimind.generate WEIGHTS --prompt TEXT``: see what a trained model learned.

Loads an fp16 export (``out/pretrain_128.pth``, ours or MiniMind's) or any resume checkpoint,
infers the model shape from its tensors, and continues the prompt (KV cache; greedy, or
temperature / top-p / top-k sampling).

``--chat QUESTION`` talks to an SFT model instead (``out/full_sft_128.pth``): the conversation is
rendered with the tokenizer's chat template and its generation prompt, as MiniMind's
``eval_llm.py`` does, and only the assistant's answer is printed. ``--chat`` without a question
reads one user turn per line from stdin until EOF, keeping the whole conversation; from a pipe each answer
follows its turn as ``user> TURN`` (a transcript).

``--lora FILE`` adds LoRA adapters (``out/lora_medical_768.pth``) to the weights, without merging them
(MiniMind's ``eval_llm.py --lora_weight``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterable, TextIO

import torch
from tokenizers import Tokenizer

from lit_minimind.checkpoint.hf import is_hf_directory
from lit_minimind.checkpoint.read import read_checkpoint
from lit_minimind.checkpoint.weights import model_weights, require_model_weights, saved_config, shape_config
from lit_minimind.cli.plain import description
from lit_minimind.data.chat_template import load_chat_template, render_chat
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, build_default_tokenizer, encode, load_tokenizer
from lit_minimind.errors import CheckpointError
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from lit_minimind.model.lora import attach_lora


def load_model(path: str) -> MiniMindForCausalLM:
    """A float32 model, in eval mode, from any checkpoint holding MiniMind weights (or a Hugging Face
    directory of one): the shape from the weights, the rest from the config the checkpoint records."""
    ckpt = read_checkpoint(path)
    weights = require_model_weights(ckpt, path)  # LoRA adapters, an optimizer's state, ...: one line saying so
    fields = {k: v for k, v in shape_config(weights).items() if v is not None}
    model = MiniMindForCausalLM(MiniMindConfig.from_dict({**saved_config(ckpt), **fields}))
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.eval()


def load(weights: str, lora: str | None = None,
         tokenizer_path: str | None = None) -> tuple[MiniMindForCausalLM, Tokenizer, str | Path]:
    """What ``generate WEIGHTS [--lora FILE] [--tokenizer_path DIR]`` loads: the float32 model (LoRA
    adapters attached, not merged), its tokenizer, and the tokenizer's directory (the chat template's).

    Raises:
        CheckpointError, ValueError: a file that is not what it should be (one line saying so).
    """
    model = load_model(weights)
    if lora:
        try:
            attach_lora(model, model_weights(read_checkpoint(lora)))
        except ValueError as err:
            raise CheckpointError(f"{lora} (--lora): {err}") from None
    own = is_hf_directory(weights) and (Path(weights) / "tokenizer.json").is_file()
    tokenizer_dir = tokenizer_path or (weights if own else build_default_tokenizer())
    return model, load_tokenizer(tokenizer_dir), tokenizer_dir


def chat(
    model: MiniMindForCausalLM,
    tokenizer: Tokenizer,
    template: str,
    questions: Iterable[str],
    out: TextIO,
    system: str | None = None,
    think: bool = False,
    echo: bool = False,
    **sampling: object,
) -> list[dict[str, str]]:
    """Answer each question in turn, the whole conversation so far as context; return the conversation.

    Each prompt is ``template`` rendered with the generation prompt (MiniMind's opens the answer
    with an empty ``<think>`` block unless ``think``); the answer is what the model generates
    after it, up to ``<|im_end|>`` (excluded), decoded without special tokens and printed on
    its own line(s) to ``out``; with ``echo`` each after a ``user> QUESTION`` line (a transcript: turns read
    from a pipe, where nothing else tells one answer from the next).
    """
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    for question in questions:
        messages.append({"role": "user", "content": question})
        prompt = render_chat(messages, template, add_generation_prompt=True, open_thinking=think)
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        new = model.generate(ids, eos_token_id=EOS_ID, **sampling)[0, ids.shape[1]:].tolist()
        if EOS_ID in new:
            new = new[: new.index(EOS_ID)]
        answer = tokenizer.decode(new, skip_special_tokens=True)
        if echo:
            print(f"user> {question}", file=out)
        print(answer, file=out, flush=True)
        messages.append({"role": "assistant", "content": answer})
    return messages


def _stdin_turns() -> Iterable[str]:
    """Non-blank lines of stdin, prompting on stderr when it is a terminal."""
    while True:
        if sys.stdin.isatty():
            print("user> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.generate", description=description(__doc__))
    parser.add_argument("weights", help="fp16 export, *_resume.pth, Lightning .ckpt or Hugging Face directory (export)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", action="append", help="text to continue (repeatable)")
    mode.add_argument("--chat", nargs="?", const="", metavar="QUESTION",
                      help="ask an SFT model (chat template, answer only); without QUESTION: one user turn per stdin line")
    parser.add_argument("--system", default=None, help="--chat: a system message opening the conversation")
    parser.add_argument("--think", action="store_true", help="--chat: let the model write its reasoning (open_thinking)")
    parser.add_argument("--lora", default=None, metavar="FILE", help="LoRA adapters to apply to the weights (not merged)")
    parser.add_argument("--tokenizer_path", default=None,
                        help="directory with tokenizer.json (default: a Hugging Face directory's own, else the embedded one)")
    parser.add_argument("--max_new_tokens", type=int, default=64,
                        help="tokens to generate at most per prompt or answer; fewer when the model ends it (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; 0 = greedy: the most likely token each time (default: %(default)s)")
    parser.add_argument("--top_p", type=float, default=0.9,
                        help="nucleus sampling: draw from the most likely tokens that together hold this probability; "
                        "1 = all (default: %(default)s)")
    parser.add_argument("--top_k", type=int, default=0,
                        help="draw from the K most likely tokens only; 0 = no limit (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the sampling's random draws: the same seed, the same text (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        model, tokenizer, tokenizer_dir = load(args.weights, args.lora, args.tokenizer_path)
        template = load_chat_template(tokenizer_dir) if args.chat is not None else None
    except (CheckpointError, ValueError) as err:  # DataError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(args.seed)
    if args.chat is not None:
        questions = [args.chat] if args.chat else _stdin_turns()
        echo = not args.chat and not sys.stdin.isatty()  # a terminal shows the typed turns already
        try:
            chat(model, tokenizer, template, questions, sys.stdout, system=args.system, think=args.think, echo=echo,
                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 top_k=args.top_k, greedy=args.temperature == 0, generator=generator)
        except KeyboardInterrupt:
            return 130
        return 0
    for prompt in args.prompt:
        ids = torch.tensor([[BOS_ID, *encode(tokenizer, prompt, model.config.max_position_embeddings)]])
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, greedy=args.temperature == 0,
                             eos_token_id=EOS_ID, generator=generator)
        print(f"{prompt}{tokenizer.decode(out[0, ids.shape[1]:].tolist())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
