"""``python -m lit_minimind.train_tokenizer DATA.jsonl --out_dir DIR``: MiniMind's tokenizer, trained on your text.

What MiniMind's ``trainer/train_tokenizer.py`` (jingyaogong/minimind, d65ef2c) does, with its files as output:
a byte-level BPE (``tokenizers``), vocabulary 6400 by default, its 36 special and reserved tokens at ids 0-35 in
its order (``<|endoftext|>`` = pad, ``<|im_start|>`` = bos, ``<|im_end|>`` = eos, ...), trained on the first
10,000 lines of DATA. DIR receives ``tokenizer.json``, ``tokenizer_config.json`` (with MiniMind's chat template),
``vocab.json`` and ``merges.txt``, byte for byte what MiniMind's script writes from the same input; every other
command takes DIR as ``--data.tokenizer_path``.
Without DATA it trains on the embedded corpus (Python's pydoc pages, the default data of ``lit_minimind.fit``).

DATA is a jsonl of conversations (MiniMind's SFT format, ``{"conversations": [{"role": ..., "content": ...}]}``:
one text per record, the non-empty ``content`` of its turns joined by newlines, as MiniMind's script reads it;
``reasoning_content`` is not read) or of pretraining text (``{"text": ...}``: the text, as MiniMind's earlier
script read ``pretrain_hq.jsonl``); one file, one format: the first record's. What MiniMind's script skips is
skipped (blank lines, lines that are not JSON, records without conversations; the first of each kind said on
stderr); where it fails (a record that is not an object, a field of the wrong type) one line names the file and
line (exit 2), as for an empty file, a file without text or a ``--vocab_size`` too small for the 36 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lit_minimind.checkpoint.atomic import atomic_write_bytes
from lit_minimind.cli.plain import description
from lit_minimind.data.chat_template import MINIMIND_CHAT_TEMPLATE
from lit_minimind.data.corpus import write_embedded_corpus
from lit_minimind.data.tokenizer import default_cache_dir
from lit_minimind.errors import DataError, UsageError

# MiniMind's special tokens (marked special), its additional tokens and its reserved buffer, in its order: ids 0-35.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>",
]
ADDITIONAL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
RESERVED_TOKENS = 36
ALL_TOKENS = [*SPECIAL_TOKENS, *ADDITIONAL_TOKENS,
              *(f"<|buffer{i}|>" for i in range(1, RESERVED_TOKENS - len(SPECIAL_TOKENS) - len(ADDITIONAL_TOKENS) + 1))]
BYTES = 256  # the byte-level alphabet, always in the vocabulary
MIN_VOCAB_SIZE = RESERVED_TOKENS + BYTES
MINIMIND_MAX_LINES = 10_000  # MiniMind's script reads the first 10,000 lines of its file
FILES = ("tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.json")  # written in this order


class Reading:
    """What :func:`read_texts` has read of DATA, and what it says on ``log`` (nothing when ``None``): the first line
    of each kind it skips; with ``progress``, a line every ``interval`` seconds while reading (lines, MB of the
    file's MB) and, after a read that long, one when it ends (the merges come next). On a terminal (``tty``) the
    tokenizers library draws its bars instead, and a skipped line's message clears the bar's line first."""

    def __init__(self, path: Path, log: TextIO | None = None, progress: bool = True, interval: float = 5.0) -> None:
        self.path, self.log, self.progress, self.interval = path, log, progress and log is not None, interval
        self.tty = log is not None and log.isatty()
        self.lines, self.stopped = 0, False
        self.skipped: dict[str, int] = {}  # kind -> lines
        self.first_skipped: dict[str, str] = {}  # kind -> what its first line was, said once a text was found
        self.found = False
        self.format: str | None = None  # the first record's: "conversations" or "text"
        self.start = self.last = time.monotonic()

    def tick(self, lines: int, f: TextIO) -> None:
        self.lines = lines
        if self.progress and time.monotonic() - self.last >= self.interval:
            self.last = time.monotonic()
            mb, total = f.buffer.tell() / 1e6, self.path.stat().st_size / 1e6
            self.say(f"read {lines:,} lines ({mb:,.1f} of {total:,.1f} MB) in {self.last - self.start:.0f} s")

    def skip(self, kind: str, message: str) -> None:
        if kind not in self.skipped:
            self.first_skipped[kind] = message
            if self.found:
                self.say_skipped(kind)
        self.skipped[kind] = self.skipped.get(kind, 0) + 1

    def found_text(self) -> None:
        """A text to train on: the skipped lines so far are said (without any, the error says what was skipped)."""
        self.found = True
        for kind in self.first_skipped:
            self.say_skipped(kind)

    def say_skipped(self, kind: str) -> None:
        self.say(f"{self.first_skipped[kind]}: skipped, as MiniMind's script skips it (further such lines are counted)")

    def nothing_found(self, max_lines: int) -> str:
        """Why there is no text to train on."""
        lines = f"its first {max_lines:,} lines hold" if self.stopped else "it holds"
        skipped = "; ".join(f"{n:,} {kind}, the first {self.first_skipped[kind]}" for kind, n in self.skipped.items())
        return (f"{self.path}: no text to train on ({lines} no record with a non-empty \"text\" or \"content\""
                f"{skipped and f'; skipped: {skipped}'})")

    def done(self) -> None:
        if self.progress and time.monotonic() - self.start >= self.interval:
            self.say(f"read {self.describe()} in {time.monotonic() - self.start:.1f} s; computing the merges")

    def describe(self) -> str:
        limit = [f"MiniMind's limit of {self.lines:,} lines: --max_lines 0 reads every line"] if self.stopped else []
        skipped = ", ".join(f"{n:,} {kind}" for kind, n in self.skipped.items())
        notes = [self.format or "no text", *limit, *([f"skipped {skipped}"] if skipped else [])]
        return f"{self.lines:,} lines of {self.path} ({'; '.join(notes)})"

    def say(self, line: str) -> None:
        if self.log is not None:
            print(("\r\033[2K" if self.tty else "") + line, file=self.log, flush=True)


def record_text(record: Any, where: str) -> tuple[str | None, str]:
    """``(format, text)`` of one record: ``"conversations"`` and the text MiniMind's script trains on (the non-empty
    contents of its turns, joined by newlines), ``"text"`` and its text, or ``(None, "")`` for a record with neither
    field (skipped, as MiniMind's script skips a record without conversations). An empty text is skipped too.

    Raises:
        DataError: not an object, or a field of the wrong type (where MiniMind's script fails).
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list):
            raise DataError(f"{where}: \"conversations\" must be a list of turns, got {type(turns).__name__}")
        contents = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise DataError(f"{where}: a turn of \"conversations\" must be an object, got {type(turn).__name__}")
            content = turn.get("content")
            if content:
                if not isinstance(content, str):
                    raise DataError(f"{where}: a turn's \"content\" must be a string, got {type(content).__name__}")
                contents.append(content)
        return "conversations", "\n".join(contents)
    if "text" in record:
        text = record["text"]
        if not isinstance(text, str):
            raise DataError(f"{where}: \"text\" must be a string, got {type(text).__name__}")
        return "text", text
    return None, ""


def read_texts(path: Path, max_lines: int = MINIMIND_MAX_LINES, reading: Reading | None = None) -> Iterator[str]:
    """The texts of DATA's first ``max_lines`` lines (0: every line), read as MiniMind's script reads them: UTF-8
    with undecodable bytes dropped, Python's universal newlines; blank lines, empty texts, lines that are not JSON,
    records without ``conversations`` or ``text`` and records of the other format than the first record's skipped
    (the first of each kind said on ``reading``'s log).

    Raises:
        DataError: a record MiniMind's script fails on (not an object, a field of the wrong type), file and line named.
    """
    reading = reading or Reading(path)
    with open(path, encoding="utf-8", errors="ignore") as f:
        for number, line in enumerate(f, 1):
            if max_lines and number > max_lines:
                reading.stopped = True
                break
            reading.tick(number, f)
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line.rstrip("\n"))
            except json.JSONDecodeError as err:
                reading.skip("not JSON", f"{where}: not JSON ({err.msg} at character {err.pos + 1})")
                continue
            kind, text = record_text(record, where)
            if kind is None:
                keys = ", ".join(map(str, list(record)[:5])) or "none"
                reading.skip("without text", f"{where}: no \"conversations\" or \"text\" field (keys: {keys})")
                continue
            reading.format = reading.format or kind
            if kind != reading.format:
                reading.skip(f"{kind} records", f"{where}: a \"{kind}\" record in a file of {reading.format} "
                                                f"(its first record's format)")
            elif text:
                if not reading.found:
                    reading.found_text()
                yield text
    reading.done()


def train(texts: Iterator[str], vocab_size: int, show_progress: bool = False) -> Tokenizer:
    """MiniMind's BPE: byte-level, no prefix space, the 36 tokens first, then the byte alphabet, then the merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=ALL_TOKENS)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """MiniMind's ``tokenizer_config.json``: the 36 tokens (special or not), its role tokens, its chat template."""
    decoder = {str(tokenizer.token_to_id(token)): {
        "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": token in SPECIAL_TOKENS} for token in ALL_TOKENS}
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": "<|im_start|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "legacy": True,
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "sp_model_kwargs": {},
        "spaces_between_special_tokens": False,
        "unk_token": "<|endoftext|>",
        "image_token": "<|image_pad|>",
        "audio_token": "<|audio_pad|>",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
        "audio_bos_token": "<|audio_start|>",
        "audio_eos_token": "<|audio_end|>",
        "chat_template": MINIMIND_CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, bytes]:
    """The bytes of MiniMind's four files: ``tokenizer.json`` as its script rewrites it (only the 21 special tokens
    marked special, ``json.dump`` with indent 2), the model's ``vocab.json`` and ``merges.txt``, the config (indent 4)."""
    data = json.loads(tokenizer.to_str(pretty=True))
    for token in data.get("added_tokens", []):
        if token["content"] not in SPECIAL_TOKENS:
            token["special"] = False
    with tempfile.TemporaryDirectory() as tmp:
        vocab, merges = (Path(p).read_bytes() for p in tokenizer.model.save(tmp))
    return {
        "tokenizer.json": json.dumps(data, ensure_ascii=False, indent=2).encode("utf-8"),
        "vocab.json": vocab,
        "merges.txt": merges,
        "tokenizer_config.json": json.dumps(tokenizer_config(tokenizer), ensure_ascii=False, indent=4).encode("utf-8"),
    }


def check_data(path: Path) -> None:
    """One line for a DATA that cannot be read at all."""
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a file (pass a .jsonl file)")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")


def train_tokenizer(data: str | Path, out_dir: str | Path, vocab_size: int = 6400, max_lines: int = MINIMIND_MAX_LINES,
                    log: TextIO | None = None, progress_every: float = 5.0) -> Tokenizer:
    """Train on DATA and write MiniMind's files into ``out_dir`` (each file atomically, ``tokenizer.json`` last);
    progress lines go to ``log`` (none when ``None``; a terminal gets the library's bars), one every
    ``progress_every`` seconds while DATA is read. Returns the tokenizer.

    Raises:
        UsageError: ``vocab_size`` below 292 (36 tokens + 256 bytes) or ``max_lines`` negative.
        DataError: DATA missing, empty, without any text, or a record MiniMind's script fails on.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise UsageError(f"--vocab_size {vocab_size}: at least {MIN_VOCAB_SIZE} ({RESERVED_TOKENS} special and reserved "
                         f"tokens + {BYTES} bytes)")
    if max_lines < 0:
        raise UsageError(f"--max_lines {max_lines}: 0 (every line) or more")
    path = Path(data)
    check_data(path)
    reading = Reading(path, log, progress=log is not None and not log.isatty(), interval=progress_every)
    texts = read_texts(path, max_lines, reading)
    first = next(texts, None)
    if first is None:
        raise DataError(reading.nothing_found(max_lines))
    start = time.monotonic()
    tokenizer = train(_chain(first, texts), vocab_size, show_progress=reading.tty)
    if log is not None:
        print(f"trained on {reading.describe()} in {time.monotonic() - start:.1f} s: {tokenizer.get_vocab_size():,} "
              "tokens", file=log, flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = tokenizer_files(tokenizer)
    for name in FILES:
        atomic_write_bytes(files[name], out / name)
    return tokenizer


def _chain(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.train_tokenizer", description=description(__doc__))
    parser.add_argument("data", nargs="?", default=None, metavar="DATA",
                        help="jsonl of conversations ({\"conversations\": [...]}) or of text ({\"text\": ...}); "
                             "default: the embedded corpus (Python's pydoc pages as text records)")
    parser.add_argument("--out_dir", required=True, help="the tokenizer directory to write (made if missing; "
                                                         "MiniMind's four files in it are replaced)")
    parser.add_argument("--vocab_size", type=int, default=6400,
                        help="vocabulary size, the 36 special and reserved tokens included (MiniMind's 6400; the model's "
                             "--model.vocab_size must be at least this)")
    parser.add_argument("--max_lines", type=int, default=MINIMIND_MAX_LINES,
                        help="read the first N lines of DATA, as MiniMind's script does (10000); 0 reads every line")
    args = parser.parse_args(argv)
    if args.data is None:
        args.data = write_embedded_corpus(default_cache_dir())
        print(f"no DATA: the embedded corpus ({args.data})", file=sys.stderr, flush=True)
    try:
        tokenizer = train_tokenizer(args.data, args.out_dir, args.vocab_size, args.max_lines, log=sys.stderr)
    except (DataError, UsageError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir} (vocabulary {tokenizer.get_vocab_size():,}): "
          f"use it as --data.tokenizer_path {args.out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
