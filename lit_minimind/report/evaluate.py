"""The pipeline's evaluation: each stage's model on the shipped tasks and its greedy answers to fixed prompts.

The shipped tasks (``tests/fixtures/eval``: ``mm_arc``, ``mm_cloze``, ``mm_gen``, ``mm_ppl``) are scored here the
way lm-evaluation-harness scores them through ``python -m lit_minimind.eval`` (``tests/test_eval.py`` checks lm-eval
against this very computation: the BOS first, the context's trailing spaces moved into the continuation, the
continuation's log-likelihood, acc and acc_norm (per character), greedy generation cut at the stop strings,
rolling log-likelihoods), in the project's own venv: lm-eval lives in ``.venv-eval`` and is not needed.
Each model's results go to ``eval/<stage>.json`` (atomically, with the weights' sha256: a rerun skips a model
whose results are there for the same file).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lit_minimind.checkpoint.atomic import atomic_write_bytes
from lit_minimind.cli.generate import chat, load
from lit_minimind.data.chat_template import load_chat_template
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, encode

TASKS_IN_CHECKOUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "eval"
GEN_UNTIL, GEN_MAX_TOKENS = ("\n", "."), 16  # mm_gen.yaml's generation_kwargs


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Scorer:
    """One model and tokenizer, scoring texts as lm-eval's requests do."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_length = model.config.max_position_embeddings

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's rule: the context's trailing whitespace goes to the continuation, the pair is encoded whole."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = [BOS_ID, *self.ids(context)] if context else [BOS_ID]
        whole = [BOS_ID, *self.ids(context + continuation)]
        return ctx, whole[len(ctx):]

    @torch.no_grad()
    def loglikelihood(self, context: list[int], continuation: list[int]) -> float:
        tokens = (context + continuation)[-(self.max_length + 1):]
        log_probs = F.log_softmax(self.model(torch.tensor([tokens])).logits[0].float(), dim=-1)
        rows = log_probs[len(tokens) - 1 - len(continuation):len(tokens) - 1]
        return float(rows.gather(-1, torch.tensor(continuation)[:, None]).sum())

    def choices(self, context: str, choices: list[str], delimiter: str) -> list[float]:
        return [self.loglikelihood(*self.split(context, delimiter + choice)) for choice in choices]

    def rolling(self, text: str) -> float:
        full = [BOS_ID, *self.ids(text)]
        total = 0.0
        for a in range(1, len(full), self.max_length):
            b = min(a + self.max_length, len(full))
            total += self.loglikelihood(full[max(0, b - 1 - self.max_length):a], full[a:b])
        return total

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int) -> list[int]:
        new = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, greedy=True,
                                  eos_token_id=EOS_ID)[0, len(ids):].tolist()
        return new[:new.index(EOS_ID)] if EOS_ID in new else new


def multiple_choice(scorer: Scorer, docs: list[tuple[str, list[str], int]], delimiter: str) -> dict[str, float]:
    acc = acc_norm = 0
    for context, choices, gold in docs:
        lls = scorer.choices(context, choices, delimiter)
        acc += max(range(len(lls)), key=lls.__getitem__) == gold
        acc_norm += max(range(len(lls)), key=lambda i: lls[i] / len(choices[i])) == gold
    return {"acc": acc / len(docs), "acc_norm": acc_norm / len(docs)}


def run_tasks(scorer: Scorer, tasks: Path) -> dict[str, dict[str, float]]:
    """The four shipped tasks' metrics (as lm-eval reports them)."""
    arc = [(f"Question: {d['question']}\nAnswer:", d["choices"]["text"], d["choices"]["label"].index(d["answerKey"]))
           for d in _jsonl(tasks / "mm_arc.jsonl")]
    cloze = [(d["context"], d["choices"], int(d["label"])) for d in _jsonl(tasks / "mm_cloze.jsonl")]
    results = {"mm_arc": multiple_choice(scorer, arc, " "), "mm_cloze": multiple_choice(scorer, cloze, "")}
    gen = _jsonl(tasks / "mm_gen.jsonl")
    matches = 0
    for doc in gen:
        text = scorer.tokenizer.decode(scorer.greedy([BOS_ID, *scorer.ids(doc["context"])], GEN_MAX_TOKENS),
                                       skip_special_tokens=True)
        for stop in GEN_UNTIL:
            text = text.split(stop)[0]
        matches += text == doc["target"]
    results["mm_gen"] = {"exact_match": matches / len(gen)}
    ll = words = nbytes = 0.0
    for doc in _jsonl(tasks / "mm_ppl.jsonl"):
        ll += scorer.rolling(doc["text"])
        words += len(re.split(r"\s+", doc["text"]))
        nbytes += len(doc["text"].encode("utf-8"))
    results["mm_ppl"] = {"bits_per_byte": -ll / nbytes / math.log(2), "byte_perplexity": math.exp(-ll / nbytes),
                         "word_perplexity": math.exp(-ll / words)}
    return results


def samples(scorer: Scorer, tokenizer_dir: str | Path, is_chat: bool, settings: dict[str, Any]) -> list[dict[str, str]]:
    """Greedy answers to the config's questions (a chat model, a fresh conversation each, as ``generate --chat
    --temperature 0``) or continuations of its prompts (as ``generate --prompt --temperature 0``)."""
    max_new = int(settings.get("max_new_tokens", 48))
    out = []
    if is_chat:
        template = load_chat_template(tokenizer_dir)
        for question in settings.get("questions") or []:
            conversation = chat(scorer.model, scorer.tokenizer, template, [question], _Discard(),
                                max_new_tokens=max_new, greedy=True)
            out.append({"prompt": question, "answer": conversation[-1]["content"]})
    else:
        for prompt in settings.get("prompts") or []:
            ids = [BOS_ID, *encode(scorer.tokenizer, prompt, scorer.max_length)]
            out.append({"prompt": prompt, "answer": scorer.tokenizer.decode(scorer.greedy(ids, max_new))})
    return out


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def evaluate_run(run_dir: Path) -> int:
    """Evaluate every stage of ``run_dir``'s plan (``pipeline.json``) that has weights to evaluate."""
    record = json.loads((run_dir / "pipeline.json").read_text())
    steps = dict((name, settings) for name, settings in record["plan"])
    settings = steps.get("evaluation", {})
    tokenizer_dir = settings.get("tokenizer_path") or (steps["tokenizer"]["out_dir"] if "tokenizer" in steps else None)
    tasks = Path(settings["tasks"]) if settings.get("tasks") else TASKS_IN_CHECKOUT
    if not (tasks / "mm_arc.jsonl").is_file():
        print(f"evaluation: no shipped tasks at {tasks} (a checkout's tests/fixtures/eval): samples only", flush=True)
        tasks = None
    (run_dir / "eval").mkdir(exist_ok=True)
    torch.manual_seed(0)
    for name, stage in steps.items():
        if stage.get("kind") != "fit" or not stage.get("evaluate", True) or not stage.get("weights"):
            continue
        weights = run_dir / stage["weights"]
        target = run_dir / "eval" / f"{name}.json"
        digest = sha256(weights)
        if target.is_file() and json.loads(target.read_text()).get("sha256") == digest:
            print(f"evaluation: {name}: done already ({target})", flush=True)
            continue
        model, tokenizer, used_dir = load(str(weights), None, tokenizer_dir and str(run_dir / tokenizer_dir))
        scorer = Scorer(model, tokenizer)
        result = {"stage": name, "weights": stage["weights"], "sha256": digest,
                  "tasks": run_tasks(scorer, tasks) if tasks else None, "tasks_dir": str(tasks) if tasks else None,
                  "samples": samples(scorer, used_dir, bool(stage.get("chat", True)), settings)}
        atomic_write_bytes(json.dumps(result, indent=1, ensure_ascii=False), target)
        line = ", ".join(f"{task} {next(iter(m))} {next(iter(m.values())):.4f}" for task, m in (result["tasks"] or {}).items())
        print(f"evaluation: {name}: {line or 'samples written'} -> {target.relative_to(run_dir)}", flush=True)
    return 0
