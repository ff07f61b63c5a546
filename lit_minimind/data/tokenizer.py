"""Tokenizer loading, encoding and a built-in default tokenizer (no ``transformers``).

MiniMind's tokenizer is a byte-level BPE with vocab 6400 whose first three ids
are the special tokens ``<|endoftext|>`` (pad), ``<|im_start|>`` (bos) and
``<|im_end|>`` (eos). This module works on plain ``tokenizers.Tokenizer``
objects loaded from a directory holding ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lit_minimind.checkpoint.atomic import atomic_directory
from lit_minimind.data.corpus import corpus_fingerprint, embedded_texts
from lit_minimind.errors import DataError

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, bos, eos
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = SPECIAL_TOKENS
DEFAULT_VOCAB_SIZE = 6400
TOKENIZER_FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    """``$LIT_MINIMIND_CACHE`` if set, else ``~/.cache/lit_minimind``."""
    env = os.environ.get("LIT_MINIMIND_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lit_minimind"


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load ``<path>/tokenizer.json`` and check the MiniMind special-token ids.

    Padding and truncation stored in the file are disabled so that
    :func:`encode` returns exactly the tokenizer's ids.

    Raises:
        DataError: the directory or file is missing or unreadable, or the
            special tokens are not ids 0/1/2.
    """
    directory = Path(path)
    if not directory.exists():
        raise DataError(f"tokenizer directory {directory} does not exist")
    if not directory.is_dir():
        raise DataError(
            f"tokenizer path {directory} is not a directory "
            "(pass the directory that contains tokenizer.json)"
        )
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise DataError(f"tokenizer directory {directory} has no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception on bad json
        raise DataError(f"cannot read tokenizer {file}: {exc}") from exc

    actual = [tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS]
    if actual != [PAD_ID, BOS_ID, EOS_ID]:
        found = ", ".join(f"{tok}={i}" for tok, i in zip(SPECIAL_TOKENS, actual))
        raise DataError(
            f"tokenizer {file} has the wrong special-token ids: expected "
            f"{PAD_TOKEN}=0, {BOS_TOKEN}=1, {EOS_TOKEN}=2, found {found}"
        )
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def encode(tokenizer: Tokenizer, text: str, max_tokens: int) -> list[int]:
    """Ids of ``text`` without added special tokens, keeping the first ``max_tokens``.

    Equivalent to HF ``tokenizer(text, add_special_tokens=False,
    max_length=max_tokens, truncation=True).input_ids``.
    """
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    return tokenizer.encode(text, add_special_tokens=False).ids[:max_tokens]


def build_default_tokenizer(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Train (once) a MiniMind-style tokenizer on the embedded corpus; return its dir.

    Byte-level BPE, vocab 6400, special tokens pad/bos/eos at ids 0/1/2, as in
    MiniMind's ``trainer/train_tokenizer.py``. The directory name is keyed by a
    hash of the corpus and format version, so an existing build is reused.
    The build happens in a temporary directory that is renamed into place, so
    concurrent or interrupted builds never leave a half-written tokenizer.
    Training is deterministic: every build yields the same ``tokenizer.json``.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    texts = embedded_texts()
    key = corpus_fingerprint([f"tokenizer-v{TOKENIZER_FORMAT_VERSION}", *texts])
    target = cache_dir / f"tokenizer-{key[:16]}"
    if (target / "tokenizer.json").is_file():
        return target

    try:
        with atomic_directory(target) as tmp:
            tokenizer = _train_bpe(texts, DEFAULT_VOCAB_SIZE)
            tokenizer.save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n", encoding="utf-8")
    except FileExistsError:  # another process finished first: its result is identical
        if not (target / "tokenizer.json").is_file():
            raise
    return target


def _train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with the MiniMind special tokens at ids 0/1/2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _tokenizer_config() -> dict:
    """Minimal HF ``tokenizer_config.json`` matching MiniMind's special tokens."""
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
