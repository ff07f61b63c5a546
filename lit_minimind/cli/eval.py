"""``python -m lit_minimind.eval SRC --tasks T1,T2``: a trained model on lm-evaluation-harness's tasks.

SRC is anything ``python -m lit_minimind.generate`` loads (the same code loads it): an fp16 export,
``*_resume.pth``, a Lightning ``.ckpt``, MiniMind's own files, a Hugging Face directory; ``--lora FILE``
adds adapters. lm-eval itself builds the prompts and scores the answers (``lm_eval.simple_evaluate``);
the model answers through :class:`lit_minimind.cli.eval_lm.MiniMindLM` (the project's model and tokenizer,
no transformers). Prints lm-eval's results table and writes every result to a JSON file (``--output``;
``--log_samples`` adds each item's prompt, answers and scores).

lm-eval lives in its own venv (it brings datasets and friends; transformers, which other lm-eval models
need, breaks the project's torchmetrics): ``make install-eval`` builds ``.venv-eval``, then
``.venv-eval/bin/python -m lit_minimind.eval ...``. Without lm-eval this command says so in one line
and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lit_minimind.cli.plain import description
from lit_minimind.errors import CheckpointError

INSTALL_HINT = ("error: lm-evaluation-harness (lm_eval) is not installed in this Python; `make install-eval` builds "
                ".venv-eval (then run .venv-eval/bin/python -m lit_minimind.eval ...), or: pip install -e \".[eval]\"")


def _limit(text: str) -> int | float:
    """lm-eval's ``--limit``: a count of items per task, or a fraction of them below 1."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value if value < 1 else int(value)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {text})")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_minimind.eval", description=description(__doc__))
    p.add_argument("src", help="fp16 .pth, *_resume.pth, Lightning .ckpt, MiniMind's file or Hugging Face directory")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names (arc_easy,piqa,...)")
    p.add_argument("--limit", type=_limit, default=None, help="only the first N items of each task (< 1: a fraction)")
    p.add_argument("--batch_size", type=_positive, default=1, help="log-likelihood requests per forward (generations: one at a time)")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's, else 0)")
    p.add_argument("--include_path", default=None, metavar="DIR", help="a directory of extra task YAMLs (local data)")
    p.add_argument("--output", default=None, metavar="FILE", help="the JSON results file (default: out/eval_<SRC name>.json)")
    p.add_argument("--log_samples", action="store_true", help="also write every item (prompt, answers, log-likelihoods) to the JSON")
    p.add_argument("--lora", default=None, metavar="FILE", help="LoRA adapters to apply to the weights (not merged)")
    p.add_argument("--tokenizer_path", default=None,
                   help="directory with tokenizer.json (default: a Hugging Face directory's own, else the embedded one)")
    p.add_argument("--max_length", type=_positive, default=None,
                   help="the context, in tokens, inputs are left-truncated to (default: the model's max_position_embeddings)")
    p.add_argument("--max_gen_toks", type=_positive, default=256, help="generation tasks: new tokens at most, unless the task says")
    p.add_argument("--apply_chat_template", action="store_true", help="render prompts with the tokenizer's chat template (SFT models)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    p.add_argument("--bootstrap_iters", type=int, default=100000, help="lm-eval's bootstrap for the stderr of some metrics (0: none)")
    p.add_argument("--seed", type=int, default=0, help="lm-eval's random seed (few-shot sampling, sampled generations)")
    return p


def default_output(src: str) -> Path:
    return Path("out") / f"eval_{Path(src.rstrip('/')).stem or 'model'}.json"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import lm_eval  # noqa: F401  (its own venv: see the module's docstring)
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable, make_table

    from lit_minimind.cli.eval_lm import MiniMindLM
    from lit_minimind.cli.generate import load
    from lit_minimind.data.chat_template import load_chat_template

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        print("error: --tasks names no task", file=sys.stderr)
        return 2
    if args.include_path and not Path(args.include_path).is_dir():
        print(f"error: --include_path {args.include_path} is not a directory", file=sys.stderr)
        return 2
    try:
        model, tokenizer, tokenizer_dir = load(args.src, args.lora, args.tokenizer_path)
        template = load_chat_template(tokenizer_dir) if args.apply_chat_template else None
    except (CheckpointError, ValueError, OSError) as err:  # DataError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = MiniMindLM(model, tokenizer, batch_size=args.batch_size, max_length=args.max_length,
                    max_gen_toks=args.max_gen_toks, device=device, chat_template=template, name=str(args.src))
    task_manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if t not in task_manager.all_tasks]
    if unknown:
        hint = f" (--include_path {args.include_path} included)" if args.include_path else " (local tasks: --include_path DIR)"
        print(f"error: unknown lm-eval task(s) {', '.join(unknown)}{hint}", file=sys.stderr)
        return 2
    try:
        results: dict[str, Any] | None = simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=args.num_fewshot, batch_size=args.batch_size, device=device,
            limit=args.limit, log_samples=args.log_samples, bootstrap_iters=args.bootstrap_iters,
            apply_chat_template=args.apply_chat_template, task_manager=task_manager,
            random_seed=args.seed, numpy_random_seed=args.seed + 1234, torch_random_seed=args.seed + 1234,
            fewshot_random_seed=args.seed + 1234)
    except (ConnectionError, FileNotFoundError) as err:  # a task's dataset: not cached, no network, a missing file
        print(f"error: a task's dataset could not be loaded ({type(err).__name__}: {err}); standard tasks need their "
              "datasets from the Hugging Face Hub or its cache, local ones --include_path DIR with data_files that exist "
              "(relative paths: from the working directory)", file=sys.stderr)
        return 2
    if results is None:  # not rank 0 (never here: one process)
        return 0
    results["config"]["model"] = str(args.src)
    results["config"]["model_args"] = {"src": str(args.src), "lora": args.lora, "tokenizer_path": str(tokenizer_dir),
                                       "max_gen_toks": args.max_gen_toks}
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    output = Path(args.output) if args.output else default_output(args.src)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    print(f"results: {output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
