"""GRPO rollout throughput: the port's sampling against MiniMind's ``TorchRolloutEngine``, same weights, same prompts.

A GRPO step samples ``num_generations`` completions of every prompt (``model.generate`` with the KV cache) before any
gradient; on a CPU that is most of the step. Both sides start from the same fp16 export (MiniMind's 128 x 2 shape,
random weights seeded) and the same left-padded prompts (the embedded chat corpus's first prompts, rendered with the
chat template and its generation prompt), sample ``4 x 4`` completions of up to 48 tokens (the docs' GRPO command) at
MiniMind's rollout settings (temperature 0.8 from torch's stream seeded alike), and are timed around the sampling
alone, alternating, in fresh processes: the port's ``lit_minimind.model.grpo.rollout`` here, MiniMind's engine (its
``trainer/rollout_engine.py`` at ``d65ef2c``, with its per-token log-probabilities, which the port computes in the
training step instead) in a Python that has its dependencies (``--minimind-python``, ``--minimind-src``: a checkout
of jingyaogong/minimind; without them only the port is measured). The completions are compared too: the port
samples MiniMind's tokens (``tests/test_grpo.py`` holds that on MiniMind's own runs).

``python -m benchmarks.bench_rollout [--quick] [--reps N] [--minimind-src DIR --minimind-python PY]``: a table, and
``benchmarks/results/rollout.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "rollout"
HIDDEN, LAYERS, PROMPTS, GENERATIONS, MAX_NEW = 128, 2, 4, 4, 48

PORT = """
import json, sys, time, torch
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from lit_minimind.model.grpo import rollout
torch.set_num_threads(1)
export, prompts, max_new, generations = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = MiniMindForCausalLM(MiniMindConfig(hidden_size={hidden}, num_hidden_layers={layers}))
model.load_state_dict({{k: v.float() for k, v in torch.load(export, weights_only=True).items()}})
model.eval()
ids, mask = torch.tensor(prompts["ids"]), torch.tensor(prompts["mask"])
torch.manual_seed(0)
start = time.perf_counter()
with torch.no_grad():
    out = rollout(model, ids, mask, generations, max_new)
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "completions": out[:, ids.shape[1]:].tolist()}}))
"""

MINIMIND = """
import json, os, sys, time, torch
sys.path.insert(0, sys.argv[5])
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM
from trainer.rollout_engine import TorchRolloutEngine
torch.set_num_threads(1)
export, prompts, max_new, generations = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = MiniMindForCausalLM(MiniMindConfig(hidden_size={hidden}, num_hidden_layers={layers}))
model.load_state_dict({{k: v.float() for k, v in torch.load(export, weights_only=True).items()}}, strict=False)
model.eval()
class Tok:  # what the engine reads of a tokenizer (pad and eos ids, batch_decode)
    pad_token_id, eos_token_id = 0, 2
    def batch_decode(self, ids, skip_special_tokens=True): return ["" for _ in ids]
engine = TorchRolloutEngine(model, Tok(), device="cpu")
ids, mask = torch.tensor(prompts["ids"]), torch.tensor(prompts["mask"])
torch.manual_seed(0)
start = time.perf_counter()
result = engine.rollout(ids, mask, generations, max_new, temperature=0.8)
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "completions": result.completion_ids.tolist()}}))
"""


def prompts(count: int) -> dict[str, list[list[int]]]:
    """The first ``count`` prompts of the embedded chat corpus, rendered with the chat template's generation prompt,
    left-padded with the pad id (0), as the GRPO DataModule batches them."""
    from lit_minimind.data.chat_template import load_chat_template, render_chat
    from lit_minimind.data.corpus import embedded_conversations
    from lit_minimind.data.tokenizer import build_default_tokenizer, load_tokenizer

    directory = build_default_tokenizer()
    tokenizer, template = load_tokenizer(directory), load_chat_template(directory)
    rows = []
    for record in embedded_conversations()[:count]:
        question = next(turn for turn in record["conversations"] if turn["role"] == "user")
        text = render_chat([{"role": "user", "content": question["content"]}], template, add_generation_prompt=True)
        rows.append(tokenizer.encode(text).ids)
    width = max(map(len, rows))
    return {"ids": [[0] * (width - len(r)) + r for r in rows], "mask": [[0] * (width - len(r)) + [1] * len(r) for r in rows]}


def export(path: Path) -> Path:
    """A seeded random MiniMind of the benchmark's shape, as an fp16 export (MiniMind's key names)."""
    import torch

    from lit_minimind.checkpoint.weights import fp16_state_dict
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    torch.save(fp16_state_dict(MiniMindForCausalLM(MiniMindConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS))), path)
    return path


def sample(python: str, code: str, args: list[str]) -> dict[str, Any]:
    done = subprocess.run([python, "-c", code.format(hidden=HIDDEN, layers=LAYERS), *args], capture_output=True,
                          text=True, timeout=1800, env=bc.child_env())
    if done.returncode != 0:
        raise RuntimeError(f"{python}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False, reps: int | None = None, minimind_src: str | None = None,
        minimind_python: str | None = None) -> dict[str, Any]:
    reps = reps or (1 if quick else 5)
    count, max_new = (2, 8) if quick else (PROMPTS, MAX_NEW)
    batch = prompts(count)
    sides = {"port": (sys.executable, PORT, [])}
    if minimind_src and minimind_python:
        sides["MiniMind TorchRolloutEngine"] = (minimind_python, MINIMIND, [str(Path(minimind_src).resolve())])
    with bc.workdir("rollout") as tmp:
        weights = str(export(tmp / "random_128.pth"))
        argv = [weights, json.dumps(batch), str(max_new), str(GENERATIONS)]
        runs = bc.rotated(list(sides), reps, lambda side: sample(sides[side][0], sides[side][1], argv + sides[side][2]))
    tokens = {side: [sum(1 for row in r["completions"] for t in row) for r in rs] for side, rs in runs.items()}
    rates = {side: bc.stats([n / r["seconds"] for n, r in zip(tokens[side], runs[side])]) for side in runs}
    same = None  # the first repetition of each side: the same seed, the same weights and prompts
    if len(runs) == 2:
        same = runs["port"][0]["completions"] == runs["MiniMind TorchRolloutEngine"][0]["completions"]
    rows = [[side, f"{count} x {GENERATIONS}", tokens[side][0], bc.spread(bc.stats([r["seconds"] for r in runs[side]])),
             bc.spread(rates[side])] for side in runs]
    table = bc.table(["rollout", "prompts x samples", "tokens sampled", "seconds med (min–max)",
                      "tokens/s med (min–max)"], rows)
    verdict = f"The port samples {rates['port']['median']:.0f} tokens/s"
    if len(runs) == 2:
        theirs = rates["MiniMind TorchRolloutEngine"]["median"]
        verdict += (f", MiniMind's engine {theirs:.0f} (×{rates['port']['median'] / theirs:.2f}); the same completions: "
                    f"{'yes' if same else 'NO'}.")
    else:
        verdict += " (MiniMind's engine not measured: give --minimind-src and --minimind-python)."
    return {"reps": reps, "model": {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS}, "prompts": count,
            "num_generations": GENERATIONS, "max_new_tokens": max_new, "tokens": tokens, "tokens_per_s": rates,
            "same_completions": same, "table": table, "verdict": verdict}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy size: the numbers mean nothing")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per side (default 5; --quick 1)")
    parser.add_argument("--minimind-src", default=None, help="a checkout of jingyaogong/minimind (d65ef2c)")
    parser.add_argument("--minimind-python", default=None, help="a Python with MiniMind's dependencies (transformers)")
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    payload = {"benchmark": NAME, "quick": args.quick, "environment": bc.environment(),
               **run(args.quick, args.reps, args.minimind_src, args.minimind_python)}
    print(payload["table"], payload["verdict"], sep="\n\n", flush=True)
    from lit_minimind.checkpoint.atomic import atomic_write_bytes

    atomic_write_bytes(json.dumps(payload, indent=1, default=str) + "\n", args.results_dir / f"{NAME}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
