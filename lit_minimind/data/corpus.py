"""A small built-in text corpus: the documentation shipped with every Python.

``pydoc_data.topics.topics`` holds the language-reference pages used by
``help()`` (79 topics, ~465k characters on CPython 3.11). It needs no download,
which makes it a convenient corpus for training the default tokenizer and for
smoke-test pretraining runs. Its exact content depends on the Python version,
so everything derived from it is cached under a hash of the text itself.

:func:`embedded_conversations` derives a small chat corpus (MiniMind SFT format) from the
same pages, the default data of ``--data.kind sft``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from pydoc_data.topics import topics

from lit_minimind.checkpoint.atomic import atomic_write_bytes

CORPUS_FORMAT_VERSION = 1
DEFAULT_CHUNK_CHARS = 600


def embedded_texts(chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """Return the pydoc topics, sorted by key, cut into chunks of <= ``chunk_chars``.

    Chunks are built from whole paragraphs (separated by blank lines). A
    paragraph longer than ``chunk_chars`` is split on line boundaries, and a
    single over-long line is hard-split, so no chunk ever exceeds the limit.
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    chunks: list[str] = []
    for key in sorted(topics):
        paragraphs = [p.strip("\n") for p in topics[key].split("\n\n")]
        pieces = [
            piece
            for p in paragraphs
            if p.strip()
            for piece in _split_long(p, chunk_chars)
        ]
        chunks.extend(_pack(pieces, chunk_chars, sep="\n\n"))
    return chunks


def corpus_fingerprint(texts: list[str]) -> str:
    """Stable hex digest of a list of texts (used as a cache key)."""
    payload = json.dumps([CORPUS_FORMAT_VERSION, texts], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def write_embedded_corpus(
    cache_dir: str | os.PathLike[str], chunk_chars: int = DEFAULT_CHUNK_CHARS
) -> Path:
    """Write :func:`embedded_texts` as MiniMind pretrain jsonl and return its path.

    One ``{"text": ...}`` object per line. The file name contains a hash of the
    content, so an existing file is reused as is; it is written to a temporary
    file and renamed into place, so readers never see a partial file.
    """
    texts = embedded_texts(chunk_chars)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"corpus-{corpus_fingerprint(texts)[:16]}.jsonl"
    if path.is_file():
        return path
    body = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
    atomic_write_bytes(body, path)
    return path


SFT_FORMAT_VERSION = 1
_NOT_PROSE = re.compile(r"^(New in version|Changed in version|Deprecated since)|\n[=\-*]{3,}")


def embedded_conversations(max_chars: int = DEFAULT_CHUNK_CHARS) -> list[dict]:
    """A chat corpus from the pydoc topics: one MiniMind SFT record per distinct topic title.

    The user asks ``What is <title>?`` and the assistant answers with the topic's first prose
    paragraph (line breaks joined, at most ``max_chars``); when the topic has a second one,
    ``Tell me more.`` gets it as a second turn. Records are ``{"conversations": [...]}``.
    """
    records: list[dict] = []
    seen: set[str] = set()
    for key in sorted(topics):
        paragraphs = [p.strip("\n") for p in topics[key].split("\n\n") if p.strip()]
        title = paragraphs[0].split("\n")[0].strip()
        prose = [
            " ".join(p.split())[:max_chars]
            for p in paragraphs[1:]
            if not p[0].isspace() and not p.startswith("object.") and not _NOT_PROSE.search(p) and len(p) >= 40
        ]
        if not prose or title in seen:
            continue
        seen.add(title)
        subject = "the " + title[4:] if title.startswith("The ") else title
        turns = [{"role": "user", "content": f"What is {subject}?"}, {"role": "assistant", "content": prose[0]}]
        if len(prose) > 1:
            turns += [{"role": "user", "content": "Tell me more."}, {"role": "assistant", "content": prose[1]}]
        records.append({"conversations": turns})
    return records


def write_embedded_sft_corpus(cache_dir: str | os.PathLike[str], max_chars: int = DEFAULT_CHUNK_CHARS) -> Path:
    """Write :func:`embedded_conversations` as MiniMind SFT jsonl (cached like the pretrain corpus)."""
    return _write_cached_jsonl(embedded_conversations(max_chars), cache_dir, f"sft-v{SFT_FORMAT_VERSION}", "sft-corpus")


def embedded_pairs(max_chars: int = DEFAULT_CHUNK_CHARS) -> list[dict]:
    """Preference pairs from :func:`embedded_conversations`, MiniMind DPO records: ``chosen`` is each
    conversation's first question and answer, ``rejected`` the same answer with its words in reverse
    order (fluent text preferred to a corrupted copy); answers that reversal leaves unchanged are skipped."""
    pairs = []
    for record in embedded_conversations(max_chars):
        question, answer = record["conversations"][:2]
        corrupted = " ".join(reversed(answer["content"].split()))
        if corrupted == answer["content"]:
            continue  # one word (or a palindrome of words): nothing to prefer
        pairs.append({"chosen": [question, answer], "rejected": [question, {"role": "assistant", "content": corrupted}]})
    return pairs


def write_embedded_dpo_corpus(cache_dir: str | os.PathLike[str], max_chars: int = DEFAULT_CHUNK_CHARS) -> Path:
    """Write :func:`embedded_pairs` as MiniMind DPO jsonl (cached like the pretrain corpus)."""
    return _write_cached_jsonl(embedded_pairs(max_chars), cache_dir, f"dpo-v{SFT_FORMAT_VERSION}", "dpo-corpus")


def _write_cached_jsonl(records: list[dict], cache_dir: str | os.PathLike[str], version: str, name: str) -> Path:
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{name}-{corpus_fingerprint([version, *lines])[:16]}.jsonl"
    if not path.is_file():
        atomic_write_bytes("".join(line + "\n" for line in lines), path)
    return path


def _split_long(paragraph: str, limit: int) -> list[str]:
    """Split a paragraph into pieces of <= ``limit`` chars, preferring line breaks."""
    if len(paragraph) <= limit:
        return [paragraph]
    lines: list[str] = []
    for line in paragraph.split("\n"):
        lines.extend(line[i : i + limit] for i in range(0, max(len(line), 1), limit))
    return _pack(lines, limit, sep="\n")


def _pack(pieces: list[str], limit: int, sep: str) -> list[str]:
    """Greedily join consecutive pieces with ``sep`` while staying <= ``limit``."""
    out: list[str] = []
    current: list[str] = []
    size = 0
    for piece in pieces:
        added = len(piece) + (len(sep) if current else 0)
        if current and size + added > limit:
            out.append(sep.join(current))
            current, size = [], 0
            added = len(piece)
        current.append(piece)
        size += added
    if current:
        out.append(sep.join(current))
    return out
