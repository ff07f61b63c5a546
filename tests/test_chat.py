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
from lit_minimind.data.chat_template import render_chat
from lit_minimind.data.tokenizer import EOS_ID, load_tokenizer
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


def recording_generate(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], list[int]]]:
    """Record (prompt ids, generated ids) of every real ``MiniMindForCausalLM.generate`` call."""
    calls: list[tuple[list[int], list[int]]] = []
    real = MiniMindForCausalLM.generate

    def wrapped(self, input_ids, *args, **kwargs):
        out = real(self, input_ids, *args, **kwargs)
        calls.append((input_ids[0].tolist(), out[0, input_ids.shape[1]:].tolist()))
        return out

    monkeypatch.setattr(MiniMindForCausalLM, "generate", wrapped)
    return calls


def answer_of(tokenizer: Tokenizer, new: list[int]) -> str:
    return tokenizer.decode(new[: new.index(EOS_ID)] if EOS_ID in new else new, skip_special_tokens=True)


def test_cli_one_question(export: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    calls = recording_generate(monkeypatch)
    rc = generate.main([str(export), "--tokenizer_path", str(TOKENIZER), "--chat", "zebra quokka narwhal?",
                        "--max_new_tokens", "12", "--temperature", "0"])
    assert rc == 0
    [(prompt, new)] = calls
    assert tokenizer.decode(prompt, skip_special_tokens=False) == render_chat(
        [{"role": "user", "content": "zebra quokka narwhal?"}], add_generation_prompt=True)
    out = capsys.readouterr().out
    assert out == answer_of(tokenizer, new) + "\n"
    assert "zebra quokka" not in out and "<|im_start|>" not in out


def test_cli_reads_turns_from_stdin(export: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    calls = recording_generate(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("first turn\n\nsecond turn\n"))  # the blank line is skipped
    rc = generate.main([str(export), "--tokenizer_path", str(TOKENIZER), "--chat", "--max_new_tokens", "8",
                        "--temperature", "0.8", "--seed", "3"])
    assert rc == 0 and len(calls) == 2
    answers = [answer_of(tokenizer, new) for _, new in calls]
    assert capsys.readouterr().out == "".join(a + "\n" for a in answers)
    history = [{"role": "user", "content": "first turn"}, {"role": "assistant", "content": answers[0]},
               {"role": "user", "content": "second turn"}]
    assert tokenizer.decode(calls[1][0], skip_special_tokens=False) == render_chat(history, add_generation_prompt=True)


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
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``generate`` takes a Lightning ``.ckpt`` or MiniMind's ``_resume.pth`` (the same file) and uses its weights."""
    source = next((trained / "checkpoints").glob("*.ckpt")) if which == "ckpt" else \
        trained / "checkpoints" / "pretrain_64_resume.pth"
    saved = torch.load(source, weights_only=True)["model"]  # MiniMind's keys
    loaded = {}
    real = MiniMindForCausalLM.generate

    def spy(self, input_ids, *args, **kwargs):
        loaded.update(self.state_dict())
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(MiniMindForCausalLM, "generate", spy)
    rc = generate.main([str(source), "--tokenizer_path", str(TOKENIZER), "--prompt", "Hello", "--max_new_tokens", "4",
                        "--temperature", "0"])
    assert rc == 0 and capsys.readouterr().out.startswith("Hello")
    assert saved.keys() <= loaded.keys()
    # (its "model" is MiniMind's fp16 copy of the weights)
    assert all(torch.equal(loaded[k].half(), saved[k].half()) for k in saved), "not the checkpoint's weights"


@pytest.mark.parametrize("think", [False, True])
def test_chat_think_opens_the_thinking_block(export: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
                                             think: bool) -> None:
    calls = recording_generate(monkeypatch)
    rc = generate.main([str(export), "--tokenizer_path", str(TOKENIZER), "--chat", "why?", "--max_new_tokens", "4",
                        "--temperature", "0", *(["--think"] if think else [])])
    assert rc == 0
    [(prompt, _)] = calls
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.endswith("<think>\n" if think else "<think>\n\n</think>\n\n"), text[-40:]
