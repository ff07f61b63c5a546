"""Read wandb's offline run files (``run-<id>.wandb``) with wandb's own protobuf ``Record``.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0) then 32 KiB
blocks of chunks ``crc32(4) length(2) type(1) data``; types 1 full, 2 first, 3 middle, 4 last.
wandb ships no Python reader for it any more, so this small one lives with the tests.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[Any]:
    data = path.read_bytes()
    if len(data) <= HEADER:
        return []  # SIGKILLed before wandb's first flush
    assert data[:4] == b":W&B", f"{path} is not a wandb log"
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        left_in_block = BLOCK - (pos % BLOCK)
        if left_in_block < 7:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):
            break  # the tail of a file whose writer was SIGKILLed mid-record
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            pending = chunk
        elif kind == 2:
            pending = chunk
            continue
        elif kind == 3:
            pending += chunk
            continue
        elif kind == 4:
            pending += chunk
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(pending)
        except DecodeError:
            break  # a torn last record (SIGKILL)
        out.append(record)
        pending = b""
    return out


def run_id_of(run_dir: Path) -> str:
    """The run id wandb named the run's files by (``offline-run-<time>-<id>/run-<id>.wandb``): there
    before the first record is flushed, so also for a process killed at start-up."""
    (wandb_file,) = run_dir.glob("run-*.wandb")
    run_id = wandb_file.name.removeprefix("run-").removesuffix(".wandb")
    assert run_dir.name.endswith(f"-{run_id}"), run_dir
    return run_id


def run_summary(run_dir: Path) -> dict[str, Any]:
    """``{"id", "record_id", "history": [dict], "config": dict}`` of one offline run directory: ``id`` from
    the file's name (:func:`run_id_of`), ``record_id`` from the run record (``None`` if none was written before a kill)."""
    (wandb_file,) = run_dir.glob("run-*.wandb")
    history, config, run_id = [], {}, None
    for record in records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == "config":
            for item in record.config.update:
                config[item.key] = json.loads(item.value_json)
    assert run_id in (None, run_id_of(run_dir)), (run_dir, run_id)
    return {"id": run_id_of(run_dir), "record_id": run_id, "history": history, "config": config}
