"""The exported directory in transformers itself: ``AutoModelForCausalLM`` / ``AutoTokenizer`` without
remote code give our logits, token ids, chat-template text and greedy generation.

transformers never runs in the project's venv (it breaks torchmetrics): ``make test-hf`` builds
``.venv-hf`` (torch, transformers, safetensors) and the reference side runs there
(``tests/helpers/hf_reference.py``); without that venv these tests skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lit_minimind.cli.export import export_hf
from lit_minimind.cli.generate import load_model
from lit_minimind.data.chat_template import load_chat_template, render_chat
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, build_default_tokenizer, encode, load_tokenizer
from tests.helpers.runs import MINIMIND, ROOT, TOKENIZER, cli_env, need_shared

HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"
# minutes in all: `make test-hf` runs them (not `make test`, not `make test-slow`)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HF_PYTHON.exists(), reason=".venv-hf is absent (`make test-hf` builds it)")]

PROMPT = "The quick brown fox"
TEXTS = ["Hello, world!", "你好，世界。MiniMind 是一个小模型。", "<|im_start|>user\nhi<|im_end|>\n", "  spaces\tand\nnewlines  "]


def conversations() -> list[list[Any]]:
    records = [json.loads(line)["conversations"] for line in (MINIMIND / "sft" / "sft.jsonl").read_text().splitlines()[:4]]
    chats: list[list[Any]] = [[r, False, {}] for r in records]
    chats += [[records[1][:1], True, {}], [records[1][:1], True, {"open_thinking": True}]]
    return chats


def reference(directory: Path, request: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], torch.Tensor]:
    """transformers' answers for ``request`` on ``directory``."""
    (tmp_path / "request.json").write_text(json.dumps(request, ensure_ascii=False))
    out = tmp_path / "reference"
    out.mkdir()
    run = subprocess.run([str(HF_PYTHON), str(ROOT / "tests" / "helpers" / "hf_reference.py"), str(directory),
                          str(tmp_path / "request.json"), str(out)], env=cli_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), load_file(out / "logits.safetensors")["logits"]


@pytest.mark.parametrize("kind,source", [("dense", "parity/dense_weights.pth"), ("moe", "parity/moe_weights.pth"),
                                         ("dense", "original_run/out__pretrain_64.pth"),
                                         ("moe", "original_run/out__pretrain_64_moe.pth")])
def test_transformers_matches_ours(tmp_path: Path, kind: str, source: str) -> None:
    need_shared()
    src = MINIMIND / source
    directory = tmp_path / "hf"
    export_hf(src, directory, dtype="float32", tokenizer_path=TOKENIZER)
    ours = load_model(str(src))
    tokenizer = load_tokenizer(TOKENIZER)
    input_ids = torch.load(MINIMIND / "parity" / f"{kind}_expected.pth", weights_only=True)["input_ids"]
    prompt_ids = [BOS_ID, *encode(tokenizer, PROMPT, 1000)]
    request = {"input_ids": input_ids.tolist(), "prompt_ids": prompt_ids, "max_new_tokens": 32,
               "texts": TEXTS, "chats": conversations()}
    result, logits = reference(directory, request, tmp_path)

    assert result["model_class"] == ("Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM")
    with torch.no_grad():
        our_logits = ours(input_ids).logits
    assert (logits - our_logits).abs().max().item() <= 1e-5

    our_new = ours.generate(torch.tensor([prompt_ids]), max_new_tokens=32, greedy=True, eos_token_id=EOS_ID)[0, len(prompt_ids):]
    assert result["generated"] == our_new.tolist()
    cli = subprocess.run([sys.executable, "-m", "lit_minimind.generate",
                          str(src), "--tokenizer_path", str(TOKENIZER), "--prompt", PROMPT, "--temperature", "0",
                          "--max_new_tokens", "32"], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == PROMPT + result["generated_text"] + "\n"

    assert result["ids"] == [encode(tokenizer, t, 10**6) for t in TEXTS]
    assert result["ids_default"] == result["ids"]  # MiniMind's tokenizer adds no special tokens
    template = load_chat_template(TOKENIZER)
    assert result["chats"] == [render_chat(m, template, add_generation_prompt=gen, **extra) for m, gen, extra in conversations()]


def test_default_tokenizer_in_transformers(tmp_path: Path) -> None:
    """The embedded default tokenizer (what a run without --data.tokenizer_path trains with) exports too."""
    need_shared()
    directory = tmp_path / "hf"
    export_hf(MINIMIND / "original_run" / "out__pretrain_64.pth", directory, dtype="float32")
    tokenizer_dir = build_default_tokenizer()
    tokenizer = load_tokenizer(tokenizer_dir)
    request = {"input_ids": [[1, 2, 3]], "prompt_ids": [BOS_ID], "max_new_tokens": 1, "texts": TEXTS,
               "chats": conversations()}
    result, _ = reference(directory, request, tmp_path)
    assert result["ids"] == [encode(tokenizer, t, 10**6) for t in TEXTS]
    template = load_chat_template(tokenizer_dir)
    assert result["chats"] == [render_chat(m, template, add_generation_prompt=gen, **extra) for m, gen, extra in conversations()]


def test_transformers_reward_model_scores_grpo_rollouts(tmp_path: Path) -> None:
    """A transformers reward model directory with remote code (InternLM2-1.8B-Reward's ``get_score`` API, as MiniMind
    loads it) scores GRPO's answers from a Python of its own: the scores are the model's own, clipped to [-3, 3];
    a run adds them to the rule rewards; a Python without transformers stops with one line."""
    need_shared()
    from lit_minimind.model.grpo import SCORE_CLIP, TransformersScorer, fold_history, rule_rewards
    from tests.helpers.runs import QUIET, SFT_EXPORT, run_cli

    directory = tmp_path / "toy_reward"
    cases = [([{"role": "user", "content": "What is 2 + 2?"}], "Four."),
             ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello"}, {"role": "user", "content": "你好吗？"}], "很好，谢谢。"),
             ([{"role": "user", "content": "Say something long."}], "words " * 60)]
    (tmp_path / "requests.json").write_text(json.dumps([fold_history(m, a) for m, a in cases], ensure_ascii=False))
    made = subprocess.run([str(HF_PYTHON), str(ROOT / "tests" / "helpers" / "hf_toy_reward.py"), str(directory),
                           str(TOKENIZER), str(tmp_path / "requests.json"), str(tmp_path / "scores.json")],
                          env=cli_env(), capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    want = [max(min(s, SCORE_CLIP), -SCORE_CLIP) for s in json.loads((tmp_path / "scores.json").read_text())["scores"]]
    assert len(set(want)) == 3 and any(abs(s) == SCORE_CLIP for s in want) and any(abs(s) < SCORE_CLIP for s in want)
    scorer = TransformersScorer(directory, str(HF_PYTHON))
    try:
        assert [scorer.get_score(m, a) for m, a in cases] == want
    finally:
        scorer.close()

    args = ["--model.objective", "grpo", "--from_weight", str(SFT_EXPORT), "--data.data_path",
            str(MINIMIND / "sft" / "sft.jsonl"), "--data.tokenizer_path", str(TOKENIZER), "--model.hidden_size", "64",
            "--model.num_hidden_layers", "2", "--data.max_seq_len", "64", "--data.batch_size", "2",
            "--model.num_generations", "2", "--model.max_gen_len", "8", "--trainer.max_steps", "1",
            "--trainer.accelerator", "cpu", "--log_interval", "1", "--model.reward_model", str(directory),
            "--trainer.callbacks+=tests.helpers.rollouts.RolloutLog", *QUIET]
    run = run_cli(tmp_path, [*args, "--model.reward_python", str(HF_PYTHON)])
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads((tmp_path / "rollouts.jsonl").read_text().splitlines()[0])
    texts = load_tokenizer(TOKENIZER).decode_batch(row["completion_ids"], skip_special_tokens=True)
    assert any(abs(r - rule_rewards(t)[0]) > 1e-3 for r, t in zip(row["rewards"], texts)), "the scorer added nothing"
    (tmp_path / "again").mkdir()
    without = run_cli(tmp_path / "again", args)  # this venv has no transformers
    assert without.returncode == 2
    assert "cannot import transformers" in without.stderr and "--model.reward_python" in without.stderr


def test_rl_prompt_batches_are_miniminds_tokenizer_calls(tmp_path: Path) -> None:
    """Over-long RL prompts cut as MiniMind's scripts cut them: PPO's ``tokenizer(truncation=True, max_length)``
    keeps each prompt's first tokens, GRPO's slice of the padded batch its last; both left-padded."""
    from lit_minimind.data.rlaif import RLAIFDataset, collate_prompts

    need_shared()
    directory = tmp_path / "hf"
    export_hf(MINIMIND / "parity" / "dense_weights.pth", directory, dtype="float32", tokenizer_path=TOKENIZER)
    tokenizer, template = load_tokenizer(TOKENIZER), load_chat_template(TOKENIZER)
    data = {side: RLAIFDataset(MINIMIND / "sft" / "sft.jsonl", tokenizer, max_length=24, chat_template=template,
                               add_system_ratio=0.0, thinking_ratio=0.0, truncation_side=side, cache_dir=tmp_path)
            for side in ("left", "right")}
    batches = [[0, 1, 2, 3], [4], [5, 6]]
    request = {"input_ids": [[1, 2, 3]], "prompt_ids": [BOS_ID], "max_new_tokens": 1, "texts": [], "chats": [],
               "prompt_batches": [[[data["left"][i][0] for i in b], 24] for b in batches]}
    result, _ = reference(directory, request, tmp_path)
    assert any(len(encode(tokenizer, data["left"][i][0], 10**6)) > 24 for b in batches for i in b)  # cut somewhere
    assert result["ppo_batches"] != result["grpo_batches"]  # the two rules differ on these prompts
    for side, key in (("right", "ppo_batches"), ("left", "grpo_batches")):
        for b, (ids, mask) in zip(batches, result[key]):
            ours = collate_prompts([data[side][i] for i in b])
            assert ours["input_ids"].tolist() == ids, (side, b)
            assert ours["attention_mask"].tolist() == mask, (side, b)
