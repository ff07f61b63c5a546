"""Tests for lit_minimind.data.tokenizer and lit_minimind.data.corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from lit_minimind.data.corpus import embedded_texts, write_embedded_corpus
from lit_minimind.data.dataset import PretrainDataset
from lit_minimind.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    build_default_tokenizer,
    default_cache_dir,
    encode,
    load_tokenizer,
)
from lit_minimind.errors import DataError

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MINIMIND_TOKENIZER = SHARED / "minimind" / "tokenizer"


@pytest.fixture(scope="module")
def minimind_tokenizer() -> Tokenizer:
    if not (MINIMIND_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"MiniMind tokenizer not found at {MINIMIND_TOKENIZER}")
    return load_tokenizer(MINIMIND_TOKENIZER)


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_default_tokenizer(tmp_path_factory.mktemp("cache_a"))


# --- load_tokenizer / encode ------------------------------------------------


def test_minimind_tokenizer_special_ids_and_roundtrip(minimind_tokenizer: Tokenizer) -> None:
    assert [minimind_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID]
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert minimind_tokenizer.get_vocab_size() == 6400
    text = "Hello, MiniMind! 你好，世界。 def f(x):\n    return x ** 2"
    ids = encode(minimind_tokenizer, text, max_tokens=1000)
    assert ids and not set(ids) & {PAD_ID, BOS_ID, EOS_ID}
    assert minimind_tokenizer.decode(ids) == text


def test_encode_truncates_to_first_max_tokens(minimind_tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20
    full = minimind_tokenizer.encode(text, add_special_tokens=False).ids
    assert len(full) > 10
    assert encode(minimind_tokenizer, text, 10) == full[:10]
    assert encode(minimind_tokenizer, text, 10_000) == full
    assert encode(minimind_tokenizer, text, 0) == []


def test_load_tokenizer_missing_dir(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    with pytest.raises(DataError, match="does not exist") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_load_tokenizer_path_is_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    with pytest.raises(DataError, match="not a directory") as err:
        load_tokenizer(path)
    assert str(path) in str(err.value)


def test_load_tokenizer_no_json(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no tokenizer.json") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_load_tokenizer_unreadable_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read tokenizer") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)


def test_load_tokenizer_wrong_special_ids(tmp_path: Path, built_dir: Path) -> None:
    data = json.loads((built_dir / "tokenizer.json").read_text(encoding="utf-8"))
    # Swap bos and eos ids in both the added tokens and the vocab.
    swap = {BOS_ID: EOS_ID, EOS_ID: BOS_ID}
    for token in data["added_tokens"]:
        token["id"] = swap.get(token["id"], token["id"])
    vocab = data["model"]["vocab"]
    vocab[SPECIAL_TOKENS[1]], vocab[SPECIAL_TOKENS[2]] = EOS_ID, BOS_ID
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(DataError, match="wrong special-token ids") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIT_MINIMIND_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("LIT_MINIMIND_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "lit_minimind"


# --- build_default_tokenizer ----------------------------------------------------


def test_build_default_tokenizer_format(built_dir: Path) -> None:
    tokenizer = load_tokenizer(built_dir)  # also checks special ids 0/1/2
    assert tokenizer.get_vocab_size() == 6400
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    config = json.loads((built_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["pad_token"], config["bos_token"], config["eos_token"]) == tuple(SPECIAL_TOKENS)
    text = "Assignment statements are used to (re)bind names to values. 你好"
    assert tokenizer.decode(encode(tokenizer, text, 1000)) == text
    # No leftover temporary directories next to the result.
    assert [p.name for p in built_dir.parent.iterdir()] == [built_dir.name]


def test_build_default_tokenizer_deterministic(built_dir: Path, tmp_path: Path) -> None:
    other = build_default_tokenizer(tmp_path)
    assert other != built_dir and other.name == built_dir.name
    assert (other / "tokenizer.json").read_bytes() == (built_dir / "tokenizer.json").read_bytes()
    text = " ".join(embedded_texts()[:5])
    a, b = load_tokenizer(built_dir), load_tokenizer(other)
    assert encode(a, text, 10_000) == encode(b, text, 10_000)


def test_build_default_tokenizer_reuses_cache(tmp_path: Path) -> None:
    first = build_default_tokenizer(tmp_path)
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert build_default_tokenizer(tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime_ns == stamp


def test_build_default_tokenizer_uses_env_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, built_dir: Path
) -> None:
    # Pre-seed the env cache with a finished build: must be found, not rebuilt.
    shutil.copytree(built_dir, tmp_path / built_dir.name)
    monkeypatch.setenv("LIT_MINIMIND_CACHE", str(tmp_path))
    assert build_default_tokenizer() == tmp_path / built_dir.name


# --- embedded corpus -----------------------------------------------------------


def test_embedded_texts_chunks() -> None:
    texts = embedded_texts()
    assert len(texts) > 100
    assert all(0 < len(t) <= 600 and t.strip() for t in texts)
    assert sum(map(len, texts)) > 100_000
    small = embedded_texts(chunk_chars=200)
    assert len(small) > len(texts) and max(map(len, small)) <= 200
    assert embedded_texts() == texts  # deterministic


def test_write_embedded_corpus(tmp_path: Path, built_dir: Path) -> None:
    path = write_embedded_corpus(tmp_path)
    stamp = path.stat().st_mtime_ns
    assert write_embedded_corpus(tmp_path) == path and path.stat().st_mtime_ns == stamp
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["text"] for line in lines] == embedded_texts()
    dataset = PretrainDataset(path, load_tokenizer(built_dir), max_length=64)
    assert len(dataset) == len(lines)
    input_ids, labels = dataset[len(dataset) - 1]
    assert input_ids.shape == labels.shape == (64,) and input_ids[0] == BOS_ID
