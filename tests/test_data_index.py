"""The cached record index (lit_minimind.data.index): hit, rebuild, damage, one build per node."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lit_minimind.data.dataset import JsonlRecords, check_pretrain_record
from lit_minimind.data.index import index_paths, record_offsets, scan_offsets
from lit_minimind.data.sft import check_sft_record
from lit_minimind.errors import DataError
from tests.helpers.runs import ROOT, TINY_JSONL, cli_env, need_shared, run_cli, tiny_args

BUILT = "lit_minimind: indexed "


def write(path: Path, texts: list[str], blank_after: int | None = None) -> Path:
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in texts]
    if blank_after is not None:
        lines.insert(blank_after, "   ")
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def expected_offsets(path: Path) -> list[int]:
    offsets, position = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        if not line.isspace():
            offsets.append(position)
        position += len(line)
    return offsets


def builds(capfd: pytest.CaptureFixture[str]) -> int:
    return capfd.readouterr().err.count(BUILT)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write(tmp_path / "d.jsonl", [f"record {i} " + "x" * (i % 7) for i in range(50)], blank_after=10)


def test_cache_hit_maps_the_index_without_a_rescan(data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    first = record_offsets(data, check_pretrain_record, cache)
    assert builds(capfd) == 1
    assert first.tolist() == expected_offsets(data) and first.dtype == np.uint64
    second = record_offsets(data, check_pretrain_record, cache)
    assert builds(capfd) == 0  # no scan: the index vouches for the unchanged file
    npy = index_paths(data, cache)[0]
    assert isinstance(second, np.memmap) and Path(second.filename) == npy and not second.flags.writeable
    assert second.tolist() == first.tolist()
    # a dataset and its pickled copy (a spawned DataLoader worker) map the same file
    records = JsonlRecords(data, check_pretrain_record, cache_dir=cache)
    clone = pickle.loads(pickle.dumps(records))
    assert isinstance(clone.offsets, np.memmap) and Path(clone.offsets.filename) == npy
    assert clone.record(10) == {"text": "record 10 xxx"}
    assert builds(capfd) == 0


def test_sft_data_uses_the_same_index(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    need_shared()
    from lit_minimind.data.sft import SFTDataset
    from lit_minimind.data.tokenizer import load_tokenizer
    from tests.helpers.runs import TOKENIZER

    chat = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "sft.jsonl"
    path.write_text((json.dumps(chat) + "\n") * 5 + "\n" + json.dumps(chat) + "\n")
    tokenizer, cache = load_tokenizer(TOKENIZER), tmp_path / "cache"
    first = SFTDataset(path, tokenizer, max_length=32, cache_dir=cache)
    assert builds(capfd) == 1 and len(first) == 6
    again = SFTDataset(path, tokenizer, max_length=32, cache_dir=cache)
    assert builds(capfd) == 0 and isinstance(again.offsets, np.memmap)
    assert [t.tolist() for t in again[5]] == [t.tolist() for t in first[5]]
    header = json.loads(index_paths(path, cache)[1].read_text())
    assert header["key"]["validator"] == "lit_minimind.data.sft.check_sft_record" and header["lines"] == 7


def test_another_validator_is_another_index(data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    record_offsets(data, check_pretrain_record, cache)
    assert builds(capfd) == 1
    with pytest.raises(DataError, match=r"line 1: .*pretraining record"):
        record_offsets(data, check_sft_record, cache)  # validated for pretraining is not validated for SFT


@pytest.mark.parametrize("change", ["append", "touch", "same-size-same-mtime"])
def test_changed_file_is_rebuilt(data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], change: str) -> None:
    cache = tmp_path / "cache"
    record_offsets(data, check_pretrain_record, cache)
    assert builds(capfd) == 1
    stat = data.stat()
    if change == "append":
        with open(data, "a") as f:
            f.write('{"text": "one more"}\n')
    elif change == "touch":
        os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    else:  # a record rewritten in place with the same length, the mtime put back
        body = data.read_bytes()
        data.write_bytes(body.replace(b'"record 49 ', b'"recorD 49 '))
        os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    offsets = record_offsets(data, check_pretrain_record, cache)
    assert builds(capfd) == 1
    assert offsets.tolist() == expected_offsets(data)
    header = json.loads(index_paths(data, cache)[1].read_text())
    assert header["key"]["mtime_ns"] == data.stat().st_mtime_ns and header["records"] == len(offsets)


def _damage_truncate(npy: Path, header: Path) -> None:
    npy.write_bytes(npy.read_bytes()[:-5])


def _damage_flip(npy: Path, header: Path) -> None:
    body = bytearray(npy.read_bytes())
    body[-3] ^= 0x40  # an offset changed: the CRC-32 in the header no longer matches
    npy.write_bytes(bytes(body))


def _damage_foreign(npy: Path, header: Path) -> None:
    records = json.loads(header.read_text())["records"]
    np.save(npy, np.arange(records, dtype=np.float64))


def _damage_header(npy: Path, header: Path) -> None:
    header.write_text('{"format": "lit-minimind-jsonl-index", "ver')


def _damage_count(npy: Path, header: Path) -> None:
    payload = json.loads(header.read_text())
    payload["records"] -= 1
    header.write_text(json.dumps(payload))


def _damage_missing(npy: Path, header: Path) -> None:
    npy.unlink()


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip, _damage_foreign, _damage_header, _damage_count,
                                    _damage_missing], ids=lambda f: f.__name__.removeprefix("_damage_"))
def test_damaged_index_is_rebuilt(data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str], damage) -> None:
    cache = tmp_path / "cache"
    record_offsets(data, check_pretrain_record, cache)
    assert builds(capfd) == 1
    npy, header, _ = index_paths(data, cache)
    damage(npy, header)
    offsets = record_offsets(data, check_pretrain_record, cache)
    assert builds(capfd) == 1
    assert offsets.tolist() == expected_offsets(data)
    assert record_offsets(data, check_pretrain_record, cache).tolist() == expected_offsets(data)
    assert builds(capfd) == 0  # and the rebuilt index is used


def test_unusable_cache_still_validates(data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "not-a-dir"
    cache.write_text("a file where the cache directory should be")
    assert record_offsets(data, check_pretrain_record, cache).tolist() == expected_offsets(data)
    assert "cannot use the index cache" in capfd.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 1}\n')
    with pytest.raises(DataError, match="line 2"):
        record_offsets(bad, check_pretrain_record, cache)


def test_a_bad_line_is_never_cached(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    cache, path = tmp_path / "cache", tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": 2}\n')
    for _ in range(2):
        with pytest.raises(DataError, match=r"d.jsonl: line 3: \"text\" must be a string"):
            record_offsets(path, check_pretrain_record, cache)
    assert not index_paths(path, cache)[1].exists()


@pytest.mark.parametrize("workers", [2, 3, 7])
def test_parallel_scan_matches_and_names_the_first_bad_line(tmp_path: Path, workers: int) -> None:
    texts = [f"t{i}" * (1 + i % 13) for i in range(400)]
    path = write(tmp_path / "d.jsonl", texts, blank_after=150)
    serial, lines = scan_offsets(path, check_pretrain_record)
    parallel, lines_p = scan_offsets(path, check_pretrain_record, workers=workers)
    assert parallel.tolist() == serial.tolist() == expected_offsets(path) and lines_p == lines == 401
    body = path.read_text().splitlines(keepends=True)
    body[300] = '{"text": false}\n'  # line 301, in a late range
    body[250] = "not json\n"  # line 251: the first bad line
    path.write_text("".join(body))
    with pytest.raises(DataError, match=r"d.jsonl: line 251: not valid JSON"):
        scan_offsets(path, check_pretrain_record, workers=workers)


def signal_self_at_record(record: dict, where: str) -> None:
    """A record check (module level: picklable) that signals its own process at the record "SIGTERM" or "SIGKILL"."""
    check_pretrain_record(record, where)
    if record["text"] in ("SIGTERM", "SIGKILL"):
        os.kill(os.getpid(), getattr(signal, record["text"]))


def test_a_parallel_scan_survives_a_stop_signal_and_a_dead_worker_is_an_error(tmp_path: Path) -> None:
    """The scan's processes ignore SIGTERM (the group's stop belongs to the main process: the scan completes);
    one killed outright is one DataError naming its range, never a hang."""
    texts = [f"t{i}" for i in range(300)]
    texts[250] = "SIGTERM"  # in the second range
    path = write(tmp_path / "d.jsonl", texts)
    offsets, lines = scan_offsets(path, signal_self_at_record, workers=2)
    assert offsets.tolist() == expected_offsets(path) and lines == 300
    texts[250] = "SIGKILL"
    path = write(tmp_path / "e.jsonl", texts)
    with pytest.raises(DataError, match=r"e.jsonl: the process indexing bytes \d+-\d+ died \(exit -9\)"):
        scan_offsets(path, signal_self_at_record, workers=2)


_RACER = """
import sys
from lit_minimind.data.dataset import check_pretrain_record
from lit_minimind.data.index import record_offsets
offsets = record_offsets(sys.argv[1], check_pretrain_record, sys.argv[2])
print("offsets", type(offsets).__name__, len(offsets), int(offsets[-1]), flush=True)
"""


def test_two_processes_one_build(tmp_path: Path) -> None:
    """Two real processes start while a third holds the build lock: both wait, then one builds
    and the other maps its index."""
    path = write(tmp_path / "d.jsonl", [f"record {i}" for i in range(3000)])
    cache = tmp_path / "cache"
    lock = index_paths(path, cache)[2]
    lock.parent.mkdir(parents=True)
    env = cli_env()
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(path), str(cache)], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for proc in procs:  # each says it waits: both are blocked on the lock
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert line.startswith("lit_minimind: waiting for another process to index"), line
        fcntl.flock(held, fcntl.LOCK_UN)
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], results
    errs = "".join(err for _, err in results)
    assert errs.count(BUILT) == 1, errs
    outs = {out.strip() for out, _ in results}
    assert outs == {f"offsets memmap 3000 {expected_offsets(path)[-1]}"}


def test_bad_line_stops_the_cli_before_training(tmp_path: Path) -> None:
    """A file changed after its index was built: the stale index is not trusted, the CLI names the line."""
    need_shared()
    data = tmp_path / "tiny.jsonl"
    data.write_bytes(TINY_JSONL.read_bytes())
    env = cli_env(LIT_MINIMIND_CACHE=str(tmp_path / "cache"))
    record_offsets(data, check_pretrain_record, tmp_path / "cache")  # a valid index of the good file
    lines = data.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[6] = '{"text": ["not", "a", "string"]}\n'
    data.write_text("".join(lines), encoding="utf-8")
    run = run_cli(tmp_path, tiny_args("--data.data_path", str(data)), env=env)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f'error: {data}: line 7: "text" must be a string, got array'], run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "indexed" not in run.stderr and not run.lines


def test_indexes_of_deleted_files_are_pruned(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    gone = write(tmp_path / "gone.jsonl", ["a", "b"])
    record_offsets(gone, check_pretrain_record, cache)
    gone.unlink()
    kept = write(tmp_path / "kept.jsonl", ["c"])
    record_offsets(kept, check_pretrain_record, cache)  # a build prunes
    assert sorted(p.name.split("-")[0] for p in (cache / "index").iterdir()) == ["kept.jsonl"] * 3


@pytest.mark.slow  # two 2-process DDP runs (gloo): about a minute on 2 cores
def test_ddp_ranks_build_once_then_map(tmp_path: Path) -> None:
    need_shared()
    data = tmp_path / "tiny.jsonl"
    data.write_bytes(TINY_JSONL.read_bytes())
    env = cli_env(LIT_MINIMIND_CACHE=str(tmp_path / "cache"))
    first = run_cli(tmp_path, tiny_args("--data.data_path", str(data), epochs=1, devices=2), env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count(BUILT) == 1, first.stderr[-3000:]  # two ranks, one build
    resumed = run_cli(tmp_path, tiny_args("--data.data_path", str(data), "--ckpt_path", "last", epochs=2, devices=2),
                      env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count(BUILT) == 0 and sorted(resumed.steps) == [(2, s) for s in range(1, 7)]
