"""Checkpoints on object storage: upload throughput and the training loop's stall with a remote directory.

moto's S3 server on localhost (its own process, nice 15) stands in for a bucket, through ``s3fs``. Upload of a 256 MB
checkpoint: a bare ``s3fs.put_file`` vs ``RemoteDir.commit`` (size + CRC-32 read back from the remote, a manifest
object), alternating after a warm-up. Loop stall: the CLI (256x4, a save every 2 of 24 batches) with
:class:`benchmarks.probes.Probe` (``ResumeCallback.manager.save_seconds`` of each save but the first), local directories vs
``s3://`` ones (the same local save, then a background upload); target remote ÷ local <= 1.2.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "remote"
TARGET_STALL_RATIO, SAVE_EVERY = 1.2, 2
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
    """moto's S3 server with one bucket, at low priority: it stands for another machine."""

    def __init__(self) -> None:
        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        self.proc = subprocess.Popen(["nice", "-n", "15", sys.executable, "-c", SERVER, KEY_ID, SECRET, self.bucket],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        port = int(self.proc.stdout.readline())  # type: ignore[union-attr]
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": KEY_ID,
                    "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}

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
    os.environ.update(server.env)
    remote = RemoteDir(f"s3://{server.bucket}/throughput")

    def upload(variant: str) -> float:
        name, start = f"{variant}.ckpt", time.perf_counter()
        if variant == "bare":
            remote.fs.put_file(str(path), remote.path(name))
        else:
            remote.commit(name, path, {**manifest, "file": name})
        seconds = time.perf_counter() - start
        remote.remove(name)
        return seconds

    seconds = bc.rotated(["bare", "ours"], reps, upload, warmup=["bare", "ours"])  # warm-up: connections, imports
    return {"bytes": size, "mb_per_s": {v: bc.stats([size / s / 1e6 for s in seconds[v]]) for v in seconds},
            "ours_over_bare": bc.ratios(seconds["bare"], seconds["ours"])}  # a throughput ratio


def loop_stall(server: Server, hidden: int, layers: int, batches: int, reps: int, workdir: Path) -> dict[str, Any]:
    data, tok = bc.default_data()
    flags = {"trainer.max_steps": batches, "trainer.logger": "false", "resume.save_interval": SAVE_EVERY}

    def stalls(variant: str) -> list[float]:
        run_dir, url = workdir / variant, f"s3://{server.bucket}/{variant}-{time.monotonic_ns()}"
        dirs = {"resume.ckpt_dir": f"{url}/checkpoints", "resume.out_dir": f"{url}/out"} if variant == "remote" else {}
        cmd = bc.fit_cmd(run_dir, data, tok, (hidden, layers, 64, 2), {**flags, **dirs}, *bc.probe())
        run = bc.launch(cmd, run_dir, env=bc.child_env(**server.env))
        shutil.rmtree(run_dir, ignore_errors=True)
        return [s["s"] for s in bc.event(run, "end")["saves"][1:]]  # the first allocates the snapshot

    runs = bc.rotated(["local", "remote"], reps, stalls)
    summary = {v: bc.stats([s for r in rs for s in r]) for v, rs in runs.items()}
    ratio = summary["remote"]["median"] / summary["local"]["median"]
    return {"hidden": hidden, "layers": layers, "saves_per_run": batches // SAVE_EVERY, "stall_s": summary,
            "remote_over_local": ratio, "target": TARGET_STALL_RATIO, "target_met": ratio <= TARGET_STALL_RATIO}


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    reps = reps or (2 if quick else 5)
    megabytes, (hidden, layers), batches = (4, (64, 2), 8) if quick else (256, (256, 4), 24)
    server = Server()
    try:
        with bc.workdir("remote") as tmp:
            upload = upload_throughput(server, megabytes, reps, tmp)
            stall = loop_stall(server, hidden, layers, batches, 1 if quick else reps, tmp)
    finally:
        server.stop()
    m, s = upload["mb_per_s"], stall["stall_s"]
    rows = [[f"upload of a {upload['bytes'] / 1e6:.0f} MB checkpoint, MB/s", f"{m['bare']['median']:.1f}",
             f"{m['ours']['median']:.1f}", f"{upload['ours_over_bare']['median']:.2f} (throughput; ours adds the "
             "remote read-back check and the manifest)"],
            [f"loop stall of a save, {hidden}x{layers} model, s", f"{s['local']['median']:.4f} (local async)",
             f"{s['remote']['median']:.4f} (s3:// dirs)", f"{stall['remote_over_local']:.2f} (target <= "
             f"{TARGET_STALL_RATIO}: {'met' if stall['target_met'] else 'NOT met'})"]]
    return {"reps": reps, "upload": upload, "stall": stall,
            "table": bc.table(["measure", "baseline", "ours", "ours ÷ baseline"], rows)}


if __name__ == "__main__":
    from benchmarks.run_all import main
    raise SystemExit(main(alone=NAME))
