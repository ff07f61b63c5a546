"""``python -m lit_minimind.eval`` through lm-evaluation-harness itself, checked against the model computed directly.

lm-eval never runs in the project's venv: ``make install-eval`` builds ``.venv-eval`` (torch, lm-eval, the
project ``-e .``) and the evaluations run there as subprocesses, on the local tasks of
``tests/fixtures/eval/`` (``--include_path``); without that venv these tests skip. What lm-eval reports (its
accuracy, exact_match and, from ``--log_samples``, every item's log-likelihoods, is_greedy flags and
generations) must equal what this file computes from the same model with plain torch, in the project's venv:
the BOS first, the context's trailing spaces moved into the continuation, the continuation's tokens scored
given the context, left truncation to ``--max_length``, lm-eval's disjoint rolling windows, greedy generation
cut at the first stop string. The model: MiniMind's own 64 x 2 file (``../shared``), so each run takes seconds.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lit_minimind.cli.export import export_hf
from lit_minimind.cli.generate import load_model
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, load_tokenizer
from tests.helpers.runs import MINIMIND, ROOT, TOKENIZER, cli_env, need_shared

EVAL_PYTHON = ROOT / ".venv-eval" / "bin" / "python"
need_eval_venv = pytest.mark.skipif(not EVAL_PYTHON.exists(), reason=".venv-eval is absent (`make install-eval` builds it)")
TASKS = ROOT / "tests" / "fixtures" / "eval"
SRC = MINIMIND / "original_run" / "out__pretrain_64.pth"
ALL = "mm_arc,mm_cloze,mm_gen,mm_ppl"
TOL = 1e-4  # log-likelihoods: the same model on the same tokens, batched or not (float32 sums of a few terms)


def evaluate(tmp: Path, src: Path, *args: str) -> dict[str, Any]:
    """``.venv-eval``'s ``python -m lit_minimind.eval src --log_samples ...`` from the repository root (the tasks'
    data_files are relative to it), offline, on the CPU; its JSON."""
    out = tmp / f"eval_{len(list(tmp.glob('eval_*.json')))}.json"
    env = cli_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp / "datasets"),
                  TOKENIZERS_PARALLELISM="false")
    run = subprocess.run([str(EVAL_PYTHON), "-m", "lit_minimind.eval", str(src), "--include_path", str(TASKS),
                          "--log_samples", "--device", "cpu", "--output", str(out), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert re.search(r"^\|\s*Tasks\s*\|Version\|Filter\|", run.stdout, re.M), run.stdout  # lm-eval's table
    assert run.stdout.rstrip().endswith(f"results: {out}")
    # the shipped tasks name each metric's aggregation and direction: none of lm-eval's per-metric warnings
    assert "is defined, but" not in run.stderr, [line for line in run.stderr.splitlines() if "is defined, but" in line]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model() -> Any:
    need_shared()
    return load_model(str(SRC))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    need_shared()
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The four local tasks, batch 1, the model's whole context."""
    if not EVAL_PYTHON.exists():
        pytest.skip(".venv-eval is absent (`make install-eval` builds it)")
    need_shared()
    return evaluate(tmp_path_factory.mktemp("eval"), SRC, "--tasks", ALL, "--tokenizer_path", str(TOKENIZER))


# -- the direct computation (plain torch, the project's venv) -----------------------------------------------------

def split_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's rule: the context's trailing whitespace goes to the continuation; the pair is encoded whole
    (after the BOS) and the continuation is what follows the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = [BOS_ID, *tokenizer.encode(context, add_special_tokens=False).ids] if context else [BOS_ID]
    whole = [BOS_ID, *tokenizer.encode(context + continuation, add_special_tokens=False).ids]
    assert whole[:len(ctx)] == ctx, (context, continuation)  # the fixtures' pairs split on a token boundary
    return ctx, whole[len(ctx):]


def score(model: Any, context: list[int], continuation: list[int], max_length: int | None = None) -> tuple[float, bool]:
    """log p(continuation | context) and whether every continuation token is the argmax, on the last
    ``max_length + 1`` tokens (left truncation)."""
    tokens = context + continuation
    if max_length is not None:
        tokens = tokens[-(max_length + 1):]
    with torch.no_grad():
        log_probs = F.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)
    rows = log_probs[len(tokens) - 1 - len(continuation):len(tokens) - 1]
    target = torch.tensor(continuation)
    return float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def rolling(model: Any, tokenizer: Any, text: str, max_length: int) -> float:
    """log p(text | BOS), each token predicted once: chunks of ``max_length`` predictions, each given the
    ``max_length`` tokens before its last one (lm-eval's disjoint rolling windows)."""
    full = [BOS_ID, *tokenizer.encode(text, add_special_tokens=False).ids]
    total = 0.0
    for a in range(1, len(full), max_length):
        b = min(a + max_length, len(full))
        context = full[max(0, b - 1 - max_length):a]
        total += score(model, context, full[a:b])[0]
    return total


def greedy(model: Any, tokenizer: Any, context: str, until: list[str], max_new: int, max_length: int | None = None) -> str:
    """The model's own greedy ``generate`` after BOS + context (its last ``max_length - max_new`` tokens),
    up to the EOS, decoded, cut at the first of each stop string."""
    ids = [BOS_ID, *tokenizer.encode(context, add_special_tokens=False).ids]
    if max_length is not None:
        ids = ids[-(max_length - max_new):]
    new = model.generate(torch.tensor([ids]), max_new_tokens=max_new, greedy=True, eos_token_id=EOS_ID)[0, len(ids):].tolist()
    if EOS_ID in new:
        new = new[:new.index(EOS_ID)]
    text = tokenizer.decode(new, skip_special_tokens=True)
    for term in until:
        text = text.split(term)[0]
    return text


def check_choices(result: dict[str, Any], task: str, model: Any, tokenizer: Any, max_length: int | None = None,
                  tol: float = TOL) -> float:
    """Every (context, choice) log-likelihood and is_greedy of ``task`` equal the direct ones, and so do acc and
    acc_norm (argmax of the log-likelihood, per character of the choice); returns acc."""
    samples = result["samples"][task]
    assert samples
    correct, correct_norm = [], []
    for sample in samples:
        direct = [score(model, *split_pair(tokenizer, context, choice), max_length=max_length)
                  for context, choice in sample["arguments"]]
        theirs = [resp[0] for resp in sample["resps"]]
        for (ll, is_greedy), (their_ll, their_greedy) in zip(direct, theirs, strict=True):
            assert abs(ll - their_ll) <= tol, (task, sample["doc_id"], ll, their_ll)
            assert is_greedy == their_greedy
        gold = int(sample["target"])
        lls = [ll for ll, _ in direct]
        lengths = [float(len(c)) for c in choices_of(sample)]
        correct.append(max(range(len(lls)), key=lls.__getitem__) == gold)
        correct_norm.append(max(range(len(lls)), key=lambda i: lls[i] / lengths[i]) == gold)
        assert float(sample["acc"]) == float(correct[-1])
    acc = sum(correct) / len(correct)
    assert result["results"][task]["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert result["results"][task]["acc_norm,none"] == pytest.approx(sum(correct_norm) / len(correct_norm), abs=1e-12)
    return acc


def choices_of(sample: dict[str, Any]) -> list[str]:
    """The task's choices (doc_to_choice), without the target delimiter: what acc_norm divides by."""
    doc = sample["doc"]
    return doc["choices"]["text"] if isinstance(doc["choices"], dict) else doc["choices"]


def check_generations(result: dict[str, Any], model: Any, tokenizer: Any, max_length: int | None = None) -> float:
    samples = result["samples"]["mm_gen"]
    matches = []
    for sample in samples:
        context, kwargs = sample["arguments"][0]
        text = greedy(model, tokenizer, context, kwargs["until"], kwargs["max_gen_toks"], max_length)
        assert sample["resps"][0][0] == text, sample["doc_id"]
        matches.append(text == sample["target"])
        assert float(sample["exact_match"]) == float(matches[-1])
    exact = sum(matches) / len(matches)
    assert result["results"]["mm_gen"]["exact_match,none"] == pytest.approx(exact, abs=1e-12)
    return exact


def check_rolling(result: dict[str, Any], model: Any, tokenizer: Any, max_length: int) -> None:
    for sample in result["samples"]["mm_ppl"]:
        (text,) = sample["arguments"][0]
        assert abs(rolling(model, tokenizer, text, max_length) - sample["resps"][0][0]) <= TOL, sample["doc_id"]


# -- the tests -----------------------------------------------------------------------------------------------------

@need_eval_venv
def test_multiple_choice_equals_the_model(full_run: dict[str, Any], model: Any, tokenizer: Any) -> None:
    """ARC's layout (delimiter " ") and a cloze whose contexts end with a space (delimiter ""): every
    log-likelihood, is_greedy, acc and acc_norm as computed here."""
    assert len(full_run["samples"]["mm_arc"]) == 24 and len(full_run["samples"]["mm_cloze"]) == 24
    check_choices(full_run, "mm_arc", model, tokenizer)
    check_choices(full_run, "mm_cloze", model, tokenizer)
    # the space moved: lm-eval asked for ("... ", "word"), the model scored " word" after "..."
    context, choice = full_run["samples"]["mm_cloze"][0]["arguments"][0]
    assert context.endswith(" ") and not choice.startswith(" ")


@need_eval_venv
def test_generation_equals_greedy_generate(full_run: dict[str, Any], model: Any, tokenizer: Any) -> None:
    """Each generation is the model's own greedy generate cut at "\\n" / "."; exact_match follows."""
    assert len(full_run["samples"]["mm_gen"]) == 24
    check_generations(full_run, model, tokenizer)


@need_eval_venv
def test_rolling_loglikelihood_equals_the_model(full_run: dict[str, Any], model: Any, tokenizer: Any) -> None:
    check_rolling(full_run, model, tokenizer, model.config.max_position_embeddings)


@need_eval_venv
def test_truncation_windows_and_batches(tmp_path: Path, model: Any, tokenizer: Any) -> None:
    """--max_length 20 (inputs left-truncated, generation contexts to 20 - 16 tokens, rolling windows of 20)
    and --batch_size 5 (right-padded batches): still the direct numbers."""
    result = evaluate(tmp_path, SRC, "--tasks", "mm_cloze,mm_gen,mm_ppl", "--tokenizer_path", str(TOKENIZER),
                      "--max_length", "20", "--batch_size", "5")
    assert result["config"]["max_length"] == 20
    check_choices(result, "mm_cloze", model, tokenizer, max_length=20)
    check_generations(result, model, tokenizer, max_length=20)
    check_rolling(result, model, tokenizer, 20)
    lengths = [len(tokenizer.encode(s["arguments"][0][0]).ids) for s in result["samples"]["mm_ppl"]]
    assert max(lengths) > 2 * 20  # several windows for the longest


@need_eval_venv
def test_hugging_face_directory(tmp_path: Path, full_run: dict[str, Any]) -> None:
    """The model exported as a Hugging Face directory (its own tokenizer) answers lm-eval as the .pth did."""
    directory = tmp_path / "hf"
    export_hf(SRC, directory, dtype="float32", tokenizer_path=TOKENIZER)
    result = evaluate(tmp_path, directory, "--tasks", "mm_arc", "--limit", "6")
    assert len(result["samples"]["mm_arc"]) == 6
    for ours, theirs in zip(result["samples"]["mm_arc"], full_run["samples"]["mm_arc"][:6], strict=True):
        assert ours["doc_id"] == theirs["doc_id"]
        for a, b in zip(ours["resps"], theirs["resps"], strict=True):
            assert abs(a[0][0] - b[0][0]) <= TOL and a[0][1] == b[0][1]


@need_eval_venv
def test_missing_data_one_line_exit_2(tmp_path: Path) -> None:
    """Local tasks' data_files are relative to the working directory: elsewhere, one error line and exit 2."""
    need_shared()
    run = subprocess.run([str(EVAL_PYTHON), "-m", "lit_minimind.eval", str(SRC), "--tokenizer_path", str(TOKENIZER),
                          "--tasks", "mm_arc", "--include_path", str(TASKS), "--output", str(tmp_path / "x.json")],
                         cwd=tmp_path, env=cli_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                                                   HF_DATASETS_CACHE=str(tmp_path / "datasets")),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1].startswith("error: a task's dataset could not be loaded (FileNotFoundError")
    assert "Traceback" not in run.stderr and not (tmp_path / "x.json").exists()


def test_without_lm_eval_one_line_exit_2() -> None:
    """In the project's venv (no lm-eval): one line naming the command that installs it, exit 2."""
    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm_eval is importable in this venv")
    run = subprocess.run([sys.executable, "-m", "lit_minimind.eval", "model.pth", "--tasks", "arc_easy"], cwd=ROOT,
                         env=cli_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and "make install-eval" in lines[0] and "lm_eval" in lines[0], run.stderr
