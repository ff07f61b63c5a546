"""``python -m lit_minimind.train_tokenizer``: MiniMind's tokenizer training, file for file.

The expected files are what MiniMind's own ``trainer/train_tokenizer.py`` (d65ef2c) wrote from the same corpora
(``tests/fixtures/tokenizer/make_minimind_tokenizer.py`` says how); with ``MINIMIND_SRC`` set to a MiniMind checkout,
one test also runs MiniMind's script itself on a corpus drawn afresh."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from io import StringIO
from pathlib import Path
from types import ModuleType

import pytest
import tokenizers

from lit_minimind.cli.train_tokenizer import ALL_TOKENS, main, train_tokenizer
from lit_minimind.data.chat_template import MINIMIND_CHAT_TEMPLATE, load_chat_template, render_chat
from lit_minimind.data.tokenizer import load_tokenizer
from tests.helpers.runs import SHARED, TOKENIZER, cli_env, need_shared, run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))
FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def generator() -> ModuleType:
    """The fixture's generator, for its corpora."""
    spec = importlib.util.spec_from_file_location("make_minimind_tokenizer", FIXTURE / "make_minimind_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def corpus_file(case: str, directory: Path) -> Path:
    """The case's corpus, rebuilt byte for byte (checked against the SHA-256 MiniMind's run recorded)."""
    source = EXPECTED["cases"][case]["corpus"]
    if source.startswith("<shared>/"):
        need_shared()
    make = generator()
    data = make.corpus(source, SHARED)
    assert make.sha256(data) == EXPECTED["cases"][case]["corpus_sha256"], f"the {case} corpus is not the fixture's"
    path = directory / f"{case}.jsonl"
    path.write_bytes(data)
    return path


def assert_same_files(out: Path, expected: Path) -> None:
    """The four files byte for byte; a difference names the first merge or token that differs."""
    versions = f"tokenizers {tokenizers.__version__} here, {EXPECTED['tokenizers']} in MiniMind's run"
    mine, theirs = (json.loads((d / "vocab.json").read_text(encoding="utf-8")) for d in (out, expected))
    assert mine == theirs, (f"vocabulary differs ({versions}): "
                            f"{sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[:5]}")
    mine, theirs = ((d / "merges.txt").read_text(encoding="utf-8").splitlines() for d in (out, expected))
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    assert mine == theirs, f"merge {first} differs ({versions}): {mine[first:first + 1]} != {theirs[first:first + 1]}"
    for name in FILES:
        assert (out / name).read_bytes() == (expected / name).read_bytes(), f"{name} differs from MiniMind's ({versions})"


def command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_minimind.train_tokenizer", *args], env=cli_env(),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["chat", "text", "dirty"])
def test_the_command_writes_minimind_files(case: str, tmp_path: Path) -> None:
    # chat: 10,200 lines of conversations, MiniMind's defaults (it reads 10,000 lines, the vocabulary fills up);
    # text: {"text": ...} records, which MiniMind's script (conversations only) was given as one-turn conversations;
    # dirty: what MiniMind's script skips (a BOM, lines not JSON, other records) or drops (bytes not UTF-8), CRLF
    data, vocab_size = corpus_file(case, tmp_path), EXPECTED["cases"][case]["vocab_size"]
    extra = [] if vocab_size == 6400 else ["--vocab_size", str(vocab_size)]
    done = command(str(data), "--out_dir", str(tmp_path / "tok"), *extra)
    assert done.returncode == 0, done.stderr
    assert_same_files(tmp_path / "tok", FIXTURE / case)
    assert f"use it as --data.tokenizer_path {tmp_path / 'tok'}" in done.stdout
    assert len(json.loads((tmp_path / "tok" / "vocab.json").read_text())) == vocab_size
    if case == "chat":
        assert (f"trained on 10,000 lines of {data} (conversations; MiniMind's limit of 10,000 lines: --max_lines 0 "
                "reads every line) in ") in done.stderr, done.stderr
    if case == "dirty":  # the first skipped line of each kind, then the counts
        said = [line.split(": ")[0] for line in done.stderr.splitlines() if "skipped, as MiniMind's script" in line]
        assert said == [f"{data}:1", f"{data}:11", f"{data}:52"], done.stderr
        assert "(conversations; skipped 6 not JSON, 1 without text, 1 text records)" in done.stderr, done.stderr


@pytest.mark.parametrize("case", ["sft", "min"])
def test_train_tokenizer_writes_minimind_files(case: str, tmp_path: Path) -> None:
    # sft: the reference data's 48 conversations run out of pairs before 6400 tokens; min: vocab 292, no merge at all
    data = corpus_file(case, tmp_path)
    tokenizer = train_tokenizer(data, tmp_path / "tok", EXPECTED["cases"][case]["vocab_size"])
    assert_same_files(tmp_path / "tok", FIXTURE / case)
    assert tokenizer.get_vocab_size() == EXPECTED["cases"][case]["vocab"] < 6400


@pytest.mark.skipif(not os.environ.get("MINIMIND_SRC"), reason="MINIMIND_SRC (a MiniMind checkout at d65ef2c) not set")
def test_minimind_script_itself_on_a_fresh_corpus(tmp_path: Path) -> None:
    seed = random.randrange(10**6)
    print(f"corpus: chat_corpus(lines=3000, seed={seed})")  # shown when the comparison fails
    data = tmp_path / "fresh.jsonl"
    data.write_text(generator().chat_corpus(lines=3000, seed=seed), encoding="utf-8")
    theirs = subprocess.run([sys.executable, str(FIXTURE / "make_minimind_tokenizer.py"), "--minimind-src",
                             os.environ["MINIMIND_SRC"], "--one", str(data), str(tmp_path / "minimind"), "3000"],
                            capture_output=True, text=True, timeout=300)
    assert theirs.returncode == 0, theirs.stderr
    done = command(str(data), "--out_dir", str(tmp_path / "tok"), "--vocab_size", "3000")
    assert done.returncode == 0, done.stderr
    assert_same_files(tmp_path / "tok", tmp_path / "minimind")


def test_the_directory_is_minimind_s_layout_and_loads(tmp_path: Path) -> None:
    need_shared()
    tokenizer = train_tokenizer(corpus_file("sft", tmp_path), tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")  # the project's loader: pad, bos, eos at 0, 1, 2
    assert [loaded.token_to_id(token) for token in ALL_TOKENS] == list(range(36))
    assert loaded.get_vocab_size() == tokenizer.get_vocab_size()
    # MiniMind's shipped tokenizer directory: the same config, the same tokenizer.json but for the vocabulary
    ours = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert ours == json.loads((TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    ours, shipped = (json.loads((d / "tokenizer.json").read_text(encoding="utf-8")) for d in (tmp_path / "tok", TOKENIZER))
    for model in (ours["model"], shipped["model"]):
        del model["vocab"], model["merges"]
    assert ours == shipped
    assert load_chat_template(tmp_path / "tok") == MINIMIND_CHAT_TEMPLATE
    chat = render_chat([{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "A sequence."}],
                       load_chat_template(tmp_path / "tok"))
    ids = loaded.encode(chat, add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> ... <|im_end|> twice: the role tokens are single ids
    assert loaded.decode(ids, skip_special_tokens=False) == chat


def test_a_tiny_fit_trains_with_the_trained_tokenizer(tmp_path: Path) -> None:
    # the chat fixture is MiniMind's script's output, equal to the port's (above): 6400 tokens, the model's vocab_size
    run = run_cli(tmp_path, ["--data.tokenizer_path", str(FIXTURE / "chat"), "--trainer.max_steps", "2",
                             "--model.hidden_size", "64", "--data.max_seq_len", "64", "--data.batch_size", "4",
                             "--log_interval", "1", "--trainer.enable_progress_bar", "false"], limit=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(run.steps) == [(1, 1), (1, 2)]  # MiniMind's lines: epoch 1, steps 1 and 2
    assert (tmp_path / "out" / "pretrain_64.pth").is_file()


def test_a_tokenizer_larger_than_the_model_is_refused_in_one_line(tmp_path: Path) -> None:
    # 7000 tokens against the model's 6400: without the check, an IndexError in the embedding at the first batch
    train_tokenizer(corpus_file("chat", tmp_path), tmp_path / "tok", vocab_size=7000, log=StringIO())
    run = run_cli(tmp_path, ["--data.tokenizer_path", str(tmp_path / "tok"), "--trainer.max_steps", "2",
                             "--model.hidden_size", "64", "--data.max_seq_len", "64"], limit=240)
    assert run.returncode == 2, run.stderr[-3000:]
    assert (f"tokenizer {tmp_path / 'tok'} has 7000 tokens, more than the model's 6400: pass --model.vocab_size 7000"
            in run.stderr)
    assert not (tmp_path / "out" / "pretrain_64.pth").exists()


BAD = {  # name: (file content, extra flags, the error after "error: " with {p} for the file)
    "empty": ("", [], "{p}: empty file"),
    "not an object": ('{"text": "a"}\n[1, 2]\n', [], "{p}:2: expected a JSON object, got list"),
    "content not a string": ('{"conversations": [{"role": "user", "content": ["x"]}]}\n', [],
                             "{p}:1: a turn's \"content\" must be a string, got list"),
    "text not a string": ('{"text": 5}\n', [], "{p}:1: \"text\" must be a string, got int"),
    "no text at all": ('{"conversations": []}\n{"conversations": [{"role": "user", "content": ""}]}\n', [],
                       '{p}: no text to train on (it holds no record with a non-empty "text" or "content")'),
    "nothing but skipped lines": ('oops\n{"content": "b"}\n\n', [],
                                  '{p}: no text to train on (it holds no record with a non-empty "text" or "content"; '
                                  'skipped: 1 not JSON, the first {p}:1: not JSON (Expecting value at character 1); '
                                  '1 without text, the first {p}:2: no "conversations" or "text" field (keys: content))'),
    "vocab too small": ('{"text": "a"}\n', ["--vocab_size", "291"],
                        "--vocab_size 291: at least 292 (36 special and reserved tokens + 256 bytes)"),
    "no file": (None, [], "{p}: no such file"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_naming_the_file_and_line(name: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    content, flags, message = BAD[name]
    data = tmp_path / "data.jsonl"
    if content is not None:
        data.write_text(content, encoding="utf-8")
    assert main([str(data), "--out_dir", str(tmp_path / "tok"), *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {message.format(p=data)}\n"
    assert not (tmp_path / "tok" / "tokenizer.json").exists()


def test_a_bad_record_stops_the_real_command_in_one_line(tmp_path: Path) -> None:
    # raised inside the iterator the library's trainer consumes: still one line, exit 2, nothing written
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n' * 5000 + '{"text": null}\n', encoding="utf-8")
    done = command(str(data), "--out_dir", str(tmp_path / "tok"))
    assert done.returncode == 2
    assert done.stderr == f'error: {data}:5001: "text" must be a string, got NoneType\n'
    assert not (tmp_path / "tok" / "tokenizer.json").exists()


def test_lines_past_max_lines_are_not_read(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "only this"}\n{"text": ["never read"]}\n', encoding="utf-8")
    log = StringIO()
    train_tokenizer(data, tmp_path / "tok", max_lines=1, log=log)
    assert (f"trained on 1 lines of {data} (text; MiniMind's limit of 1 lines: --max_lines 0 reads every line)"
            in log.getvalue())
    assert main([str(data), "--out_dir", str(tmp_path / "all"), "--max_lines", "0"]) == 2  # line 2 read: refused


def test_progress_lines_while_reading(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(3)), encoding="utf-8")
    log = StringIO()
    train_tokenizer(data, tmp_path / "tok", vocab_size=292, log=log, progress_every=0)
    lines = log.getvalue().splitlines()
    size = data.stat().st_size / 1e6
    assert lines[0].startswith(f"read 1 lines (0.0 of {size:,.1f} MB) in 0 s"), lines
    assert lines[-2].startswith(f"read 3 lines of {data} (text) in ") and lines[-2].endswith("s; computing the merges")
    assert lines[-1].startswith(f"trained on 3 lines of {data} (text) in ") and lines[-1].endswith(" s: 292 tokens")
