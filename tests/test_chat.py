"""``python -m lit_minimind.generate WEIGHTS --chat``: the chat plumbing (prompt, history, answer, eos).

A tiny random model answers gibberish, so these tests check what goes in and what comes out,
not what the model says.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from lit_minimind.checkpoint.weights import fp16_state_dict
from lit_minimind.cli import generate
from lit_minimind.data.chat_template import load_chat_template, render_chat
from lit_minimind.data.tokenizer import BOS_ID, EOS_ID, encode, load_tokenizer
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "minimind" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"MiniMind tokenizer not found at {TOKENIZER} (../shared is absent)")
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random MiniMind saved as MiniMind's fp16 weight export."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2))
    path = tmp_path_factory.mktemp("out") / "full_sft_64.pth"
    torch.save(fp16_state_dict(model), path)
    return path


class ScriptedModel:
    """Stands in for the model: records each prompt and answers ``reply`` + eos + junk."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.prompts: list[list[int]] = []

    def generate(self, input_ids: torch.Tensor, eos_token_id: int, **_: object) -> torch.Tensor:
        self.prompts.append(input_ids[0].tolist())
        tail = torch.tensor([[*self.reply, eos_token_id, *self.reply]])
        return torch.cat([input_ids, tail], dim=1)


def test_chat_keeps_history_prints_answer_until_eos(tokenizer: Tokenizer) -> None:
    reply = tokenizer.encode("Hello there.").ids
    model, out = ScriptedModel(reply), io.StringIO()
    conversation = generate.chat(model, tokenizer, None, ["First question?", "Second question?"], out, system="Be brief.")
    assert out.getvalue() == "Hello there.\nHello there.\n"  # the answer only, cut at eos
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "First question?"}]
    second = [*first, {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Second question?"}]
    assert conversation == [*second, {"role": "assistant", "content": "Hello there."}]
    rendered = [tokenizer.decode(p, skip_special_tokens=False) for p in model.prompts]
    assert rendered == [render_chat(first, add_generation_prompt=True), render_chat(second, add_generation_prompt=True)]
    assert rendered[1].endswith("<|im_start|>user\nSecond question?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def expected_chat(export: Path, questions: list[str], seed: int = 0, echo: bool = False, **kwargs: object) -> str:
    """What ``generate.chat`` prints for ``questions`` with ``export``'s weights (loaded the public way)
    and the CLI's sampling defaults (``kwargs`` override them): what ``main`` must print for the same flags."""
    model, tokenizer = generate.load_model(str(export)), load_tokenizer(TOKENIZER)
    sampling = {"max_new_tokens": 64, "temperature": 0.8, "top_p": 0.9, "top_k": 0, **kwargs}
    out = io.StringIO()
    generate.chat(model, tokenizer, load_chat_template(TOKENIZER), questions, out, echo=echo,
                  greedy=sampling["temperature"] == 0, generator=torch.Generator().manual_seed(seed), **sampling)
    return out.getvalue()


def test_cli_one_question(export: Path, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]) -> None:
    # sampled: a random model's greedy answer is the same newlines whatever it is asked
    rc = generate.main([str(export), "--tokenizer_path", str(TOKENIZER), "--chat", "zebra quokka narwhal?",
                        "--max_new_tokens", "12", "--seed", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert out == expected_chat(export, ["zebra quokka narwhal?"], seed=1, max_new_tokens=12)
    assert out != expected_chat(export, ["zebra quokka narwhal"], seed=1, max_new_tokens=12)  # the question counts
    assert out.strip() and "zebra quokka" not in out and "<|im_start|>" not in out  # the answer only
    # (what chat() renders as the prompt: test_chat_keeps_history_prints_answer_until_eos)


def test_cli_reads_turns_from_stdin(export: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("first turn\n\nsecond turn\n"))  # the blank line is skipped
    rc = generate.main([str(export), "--tokenizer_path", str(TOKENIZER), "--chat", "--max_new_tokens", "8",
                        "--temperature", "0.8", "--seed", "3"])
    assert rc == 0
    expected = expected_chat(export, ["first turn", "second turn"], seed=3, echo=True, max_new_tokens=8)
    out = capsys.readouterr().out
    assert out == expected
    # a pipe's transcript: each answer after its turn, so two answers never run together
    assert out.startswith("user> first turn\n") and out.count("user> ") == 2 and "\nuser> second turn\n" in out
    assert expected.replace("user> first turn\n", "").replace("user> second turn\n", "") == \
        expected_chat(export, ["first turn", "second turn"], seed=3, max_new_tokens=8)  # the same answers
    # another seed samples other answers: the output above follows --seed
    assert expected_chat(export, ["first turn", "second turn"], seed=4, max_new_tokens=8) != expected


def test_prompt_and_chat_are_exclusive(export: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        generate.main([str(export), "--prompt", "a", "--chat", "b"])
    assert exit_info.value.code == 2  # a usage error, as argparse reports one


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 1-step training run's files: a Lightning .ckpt, MiniMind's _resume.pth and the fp16 export."""
    from tests.helpers.runs import need_shared, run_cli, tiny_args

    need_shared()
    run_dir = tmp_path_factory.mktemp("trained")
    run = run_cli(run_dir, tiny_args("--trainer.max_steps", "1", save_interval=2))
    assert run.returncode == 0, run.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize("which", ["ckpt", "resume"])
def test_generate_from_a_checkpoint_uses_its_weights(trained: Path, which: str, tokenizer: Tokenizer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``generate`` takes a Lightning ``.ckpt`` or MiniMind's ``_resume.pth`` (the same file) and uses its weights."""
    source = next((trained / "checkpoints").glob("*.ckpt")) if which == "ckpt" else \
        trained / "checkpoints" / "pretrain_64_resume.pth"
    saved = torch.load(source, weights_only=True)["model"]  # MiniMind's keys (its fp16 copy of the weights)
    loaded = generate.load_model(str(source)).state_dict()
    assert saved.keys() <= loaded.keys()
    assert all(torch.equal(loaded[k].half(), saved[k].half()) for k in saved), "not the checkpoint's weights"
    rc = generate.main([str(source), "--tokenizer_path", str(TOKENIZER), "--prompt", "Hello", "--max_new_tokens", "8"])
    assert rc == 0

    def sampled(weights: dict[str, torch.Tensor] | None) -> str:
        """The CLI's default sampling (seed 0) of a model built here with ``weights`` (None: a fresh one)."""
        torch.manual_seed(1)
        model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2)).eval()
        if weights is not None:
            model.load_state_dict({k: v.float() for k, v in weights.items()})
        ids = torch.tensor([[BOS_ID, *encode(tokenizer, "Hello", model.config.max_position_embeddings)]])
        new = model.generate(ids, max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=0, eos_token_id=EOS_ID,
                             generator=torch.Generator().manual_seed(0))[0, ids.shape[1]:].tolist()
        return f"Hello{tokenizer.decode(new)}\n"

    out = capsys.readouterr().out
    assert out == sampled(saved) and out != sampled(None), "not the text of the checkpoint's weights"


MEMORIZED = Path(__file__).resolve().parent / "fixtures" / "serve" / "memorized_64.pth"  # tests/test_serve.py's


@pytest.mark.parametrize("think", [False, True])
def test_chat_think_opens_the_thinking_block(tokenizer: Tokenizer, think: bool, capsys: pytest.CaptureFixture[str]) -> None:
    scripted = ScriptedModel(tokenizer.encode("Because.").ids)
    generate.chat(scripted, tokenizer, load_chat_template(TOKENIZER), ["why?"], io.StringIO(), think=think)
    text = tokenizer.decode(scripted.prompts[0], skip_special_tokens=False)
    assert text.endswith("<think>\n" if think else "<think>\n\n</think>\n\n"), text[-40:]
    # and the CLI's --think reaches it: a model trained to reason when the block is open answers each prompt its way
    question = "Why is the sky blue?"
    rc = generate.main([str(MEMORIZED), "--tokenizer_path", str(TOKENIZER), "--chat", question, "--max_new_tokens", "24",
                        "--temperature", "0", *(["--think"] if think else [])])
    assert rc == 0
    answers = {t: expected_chat(MEMORIZED, [question], max_new_tokens=24, temperature=0, think=t) for t in (False, True)}
    assert answers[False] != answers[True], "both prompts give the same answer: the check below could not fail"
    assert capsys.readouterr().out == answers[think]
