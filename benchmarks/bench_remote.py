"""Checkpoints on object storage: upload throughput and the training loop's stall with a remote directory.

An S3-compatible server (moto's threaded server on localhost, in its own process at nice 15) stands
in for the bucket; everything goes through ``s3fs`` and HTTP as with a real one (its absolute speed is
localhost's and moto's, not a cloud's: the ratios are the point).

* **Upload throughput** of one checkpoint-sized file (an ``atomic_save`` of random tensors):
  ``bare`` = ``s3fs.put_file`` of the file, ``ours`` =
  :meth:`lit_minimind.checkpoint.remote.RemoteDir.upload` (data, size + CRC-32 read back from the
  remote, manifest object: the commit). Alternating repetitions; MB/s and ours ÷ bare.
* **Loop stall of a save**: the real CLI (``python -m benchmarks._save_probe``: ``ResumeCallback.save``
  timed) trains with a save every 2 batches, once with local directories (the default async save) and
  once with ``s3://`` directories (the same local save, then the background upload); median stall per
  save and remote ÷ local (target <= 1.2). The upload process stands still while the loop takes a
  save's snapshot (:meth:`lit_minimind.resume.upload.Uploader.paused`); the server on the same machine
  still competes for CPU and memory bandwidth, which a bucket elsewhere would not.

``python -m benchmarks.bench_remote [--quick] [--reps N]``
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    ROOT,
    alternating,
    bench_parser,
    cache_dir,
    default_data,
    environment,
    say,
    set_threads,
    stats,
    table,
    write_json,
)

TARGET_STALL_RATIO = 1.2
SAVE_EVERY = 2  # batches between saves
KEY_ID, SECRET = "AKIABENCHREMOTE", "bench-remote-secret"


SERVER = """
import logging, sys
import boto3
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
port = server.get_host_and_port()[1]
boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1", aws_access_key_id=sys.argv[1],
             aws_secret_access_key=sys.argv[2]).create_bucket(Bucket=sys.argv[3])
print(port, flush=True)
sys.stdin.read()  # until the benchmark closes it
"""


class Server:
    """moto's S3 server with one bucket, in its own process at low priority: the bucket stands for
    another machine, so it should take as little as it can from the training it is compared with."""

    def __init__(self) -> None:
        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        self.proc = subprocess.Popen(["nice", "-n", "15", sys.executable, "-c", SERVER, KEY_ID, SECRET, self.bucket],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def upload_throughput(server: Server, megabytes: int, reps: int, workdir: Path) -> dict[str, Any]:
    import torch

    from lit_minimind.checkpoint.atomic import atomic_save, read_manifest
    from lit_minimind.checkpoint.remote import RemoteDir

    path = workdir / "file.ckpt"
    g = torch.Generator().manual_seed(0)
    atomic_save({f"t{i}": torch.rand(megabytes * 2**20 // 4 // 16, generator=g) for i in range(16)}, path)
    manifest, size = read_manifest(path), path.stat().st_size
    os.environ.update(server.env())
    remote = RemoteDir(f"s3://{server.bucket}/throughput")
    fs = remote.fs
    seconds: dict[str, list[float]] = {"bare": [], "ours": []}
    for rep in range(reps + 1):  # the first: warm-up (connections, imports)
        for variant in alternating(["bare", "ours"], rep):
            name = f"{variant}-{rep}.ckpt"
            start = time.perf_counter()
            if variant == "bare":
                fs.put_file(str(path), remote.path(name))
            else:
                with open(path, "rb") as f:
                    remote.upload(f, name, {**manifest, "file": name})
            if rep:
                seconds[variant].append(time.perf_counter() - start)
            remote.remove(name)
    rates = {v: stats([size / s / 1e6 for s in seconds[v]]) for v in seconds}
    ratio = stats([b / o for b, o in zip(seconds["bare"], seconds["ours"])])  # ours' throughput / bare's
    return {"bytes": size, "mb_per_s": rates, "ours_over_bare": ratio}


def loop_stall(server: Server, hidden: int, layers: int, batches: int, reps: int, workdir: Path) -> dict[str, Any]:
    data, tok = default_data()
    args = ["--data.data_path", str(data), "--data.tokenizer_path", str(tok), "--model.hidden_size", str(hidden),
            "--model.num_hidden_layers", str(layers), "--data.max_seq_len", "64", "--data.batch_size", "2",
            "--trainer.max_steps", str(batches), "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.logger", "false", "--log_interval", "1000",
            "--resume.save_interval", str(SAVE_EVERY)]
    env = {**os.environ, **server.env(), "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    stalls: dict[str, list[float]] = {"local": [], "remote": []}
    for rep in range(reps):
        for variant in alternating(["local", "remote"], rep):
            run_dir = workdir / f"{variant}-{rep}"
            run_dir.mkdir()
            extra = [] if variant == "local" else [
                "--resume.ckpt_dir", f"s3://{server.bucket}/{variant}-{rep}/checkpoints",
                "--resume.out_dir", f"s3://{server.bucket}/{variant}-{rep}/out"]
            proc = subprocess.run([sys.executable, "-m", "benchmarks._save_probe", *args, *extra], cwd=run_dir, env=env,
                                  capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"{variant} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
            times = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("@@save ")]
            stalls[variant] += times[1:]  # the first save allocates the snapshot buffers, in both
            shutil.rmtree(run_dir, ignore_errors=True)
    summary = {v: stats(stalls[v]) for v in stalls}
    ratio = summary["remote"]["median"] / summary["local"]["median"]
    return {"hidden": hidden, "layers": layers, "saves_per_run": batches // 2, "stall_s": summary,
            "remote_over_local": ratio, "target": TARGET_STALL_RATIO, "target_met": ratio <= TARGET_STALL_RATIO}


def run(quick: bool = False, results_dir: Path = RESULTS_DIR, reps: int | None = None,
        threads: int | None = None) -> dict[str, Any]:
    threads = set_threads(threads)
    reps = reps or (2 if quick else 5)
    megabytes, (hidden, layers), batches = (4, (64, 2), 8) if quick else (256, (256, 4), 24)
    say(f"== checkpoints on object storage (moto S3 server on localhost; {reps} alternating repetitions) ==")
    server = Server()
    workdir = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="bench-remote-"))
    try:
        upload = upload_throughput(server, megabytes, reps, workdir)
        stall = loop_stall(server, hidden, layers, batches, reps if not quick else 1, workdir)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    m = upload["mb_per_s"]
    rows = [
        [f"upload of a {upload['bytes'] / 1e6:.0f} MB checkpoint, MB/s", f"{m['bare']['median']:.1f}",
         f"{m['ours']['median']:.1f}", f"{upload['ours_over_bare']['median']:.2f} (throughput; ours adds the remote "
         "read-back check and the manifest)"],
        [f"loop stall of a save, {hidden}x{layers} model, s", f"{stall['stall_s']['local']['median']:.4f} (local async)",
         f"{stall['stall_s']['remote']['median']:.4f} (s3:// dirs)",
         f"{stall['remote_over_local']:.2f} (target <= {TARGET_STALL_RATIO}: {'met' if stall['target_met'] else 'NOT met'})"],
    ]
    text = table(["measure", "baseline", "ours", "ours ÷ baseline"], rows)
    say(text)
    payload = {"benchmark": "remote", "quick": quick, "reps": reps, "threads": threads, "environment": environment(),
               "upload": upload, "stall": stall, "table": text}
    write_json(results_dir / "remote.json", payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "alternating repetitions (default 5, quick 2)")
    args = parser.parse_args(argv)
    run(args.quick, args.results_dir, args.reps, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
