"""Run every benchmark (make bench) and write summary.md: port overhead, checkpoint cost, resume cost, verify speed,
data set-up, checkpoints on object storage, the restart breakdown. Each writes ``<name>.json`` and ``<name>.png`` under
the results directory (default ``benchmarks/results/``); after a full run into the default directory the tables in
``benchmarks/README.md`` (between the ``bench-results`` markers) are refreshed. ``python -m benchmarks.run_all [--quick]
[--only NAME ...] [--results-dir DIR] [--threads N] [--no-readme]``; ``--quick``: toy sizes, numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import bench_checkpoint, bench_data, bench_overhead, bench_remote, bench_restart, bench_resume, bench_verify
from benchmarks.common import RESULTS_DIR, execute, say
from lit_minimind.checkpoint.atomic import atomic_write_bytes

BENCHMARKS = {m.NAME: m for m in (bench_overhead, bench_checkpoint, bench_resume, bench_verify, bench_data, bench_remote, bench_restart)}
README = Path(__file__).resolve().parent / "README.md"
START, END = "<!-- bench-results:start -->", "<!-- bench-results:end -->"


def summary(payloads: dict[str, dict[str, Any]]) -> str:
    env = next(iter(payloads.values()))["environment"]
    threads = next(iter(payloads.values())).get("threads")
    load = env.get("loadavg_at_start")
    lines = [
        f"Measured on {env['cpu_count']} CPU cores ({env['processor']}, {env['platform']}), "
        f"Python {env['python']}, torch {env['torch']}, Lightning {env['lightning']}, {threads} torch thread(s) "
        f"per process; load average (1, 5, 15 min) when the first one started "
        f"{', '.join(f'{x:.2f}' for x in load) if load else 'n/a'}"
        f"{' (--quick: toy sizes, numbers mean nothing)' if any(p['quick'] for p in payloads.values()) else ''}.",
        "",
    ]
    if "overhead" in payloads:
        p = payloads["overhead"]
        lines += [f"### 1. Port overhead: Lightning vs plain PyTorch (tokens/s, higher is better; {p['environment']['date']})", "",
                  f"`python -m lit_minimind.fit` with a probe callback vs the plain loop, each run a process; {p['reps']} "
                  "alternating repetitions after a warm-up run of each side; ratio = port / plain within a repetition, "
                  "median (min–max); Δ last loss = largest difference of the last loss between the two sides (0: the same "
                  "training).", "", p["table"], ""]
        lines += p.get("notes", []) + [""]
        at = p["attribution"]
        lines += [f"Where the time of a micro-batch goes ({at['config']['name']}, accumulation 1; stamps at the same "
                  "boundaries on both sides: torch's forward and optimizer-step hooks, Lightning's callback hooks; the data "
                  "timed alone over the same loader; median over the timed batches of a run, then over runs):", "",
                  p["attribution_table"], ""]
        if "loop_overhead_ms" in p:
            met = "yes" if p["loop_overhead_target_met"] else "NO"
            mean = p.get("loop_overhead_mean_ms")
            lines += [f"Loop overhead (`loop_overhead_ms`): **{p['loop_overhead_ms']:+.3f} ms** per micro-batch; target "
                      f"≤ {p['loop_overhead_target_ms']} ms: {met}"
                      + (f" (by the mean over batches, which also counts the work done once per `log_interval`: "
                         f"{mean:+.3f} ms)." if mean is not None else "."), ""]
        comp = p.get("compile") or {}
        if p.get("compile_table"):
            lines += [f"`--model.compile true` vs eager, through Lightning ({len(comp['speedup']['values'])} alternating "
                      "repetitions; the compile runs in the warm-up batches, outside the timed window; cold compile s = the "
                      "first compiled run's start → first batch minus the eager run's, in a fresh inductor cache):", "", p["compile_table"], ""]
    if "checkpoint" in payloads:
        p = payloads["checkpoint"]
        lines += [f"### 2. Checkpoint cost (one `ResumeCallback.save` vs MiniMind's save; seconds and bytes, lower is better; {p['environment']['date']})", "",
                  f"The CLI with a save after every batch and a probe callback; {p['reps']} saves of each kind after a warm-up "
                  "one; stall = the loop's wait in `ResumeCallback.save` (`save_seconds`), ÷ bare = ÷ a bare `torch.save` of "
                  "the same checkpoint dict within the repetition; bytes = every file one save leaves (a hard link counted "
                  f"once); files on the disk of `{Path(p['disk_dir']).name}/` (the cache dir), `os.sync()` between saves.",
                  "", p["table"], "", p["detail_table"], "",
                  "Per-byte work on this machine: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in p["rates_gb_per_s"].items())
                  + ".", ""]
        if p.get("profile_table"):
            lines += ["Where the stall of one save goes (cProfile of one more save of each kind, training thread only):", "",
                      p["profile_table"], ""]
    if "resume" in payloads:
        p = payloads["resume"]
        lines += [f"### 3. Resume cost vs position (launch → first trained batch; seconds, lower is better; {p['environment']['date']})", "",
                  f"{p['lines']:,}-line jsonl ({p['data_bytes'] / 2**20:.0f} MiB), batch {p['batch_size']}, "
                  f"seq {p['max_seq_len']}, model {p['model']['hidden_size']}x{p['model']['num_hidden_layers']}; "
                  f"{p['reps']} rotated repetitions; phases (medians) cut at a probe callback's hook events.", "", p["table"], "",
                  p["verdict"], ""]
    if "verify" in payloads:
        p = payloads["verify"]
        crc = ", ".join(f"{k} {v:.2f} GB/s" for k, v in p["crc32_in_memory_gb_per_s"].items())
        read = p.get("verify_bytes_read")
        lines += [f"### 4. Verifying a checkpoint without a manifest (GB/s, higher is better; {p['environment']['date']})", "",
                  f"A {p['file_bytes'] / 1e6:.0f} MB resume-shaped `torch.save` file ({p['records']} records); "
                  f"{p['reps']} rotated repetitions after a warm-up; `verify_file` checks every record's CRC-32 and "
                  f"every other byte of the zip structure; the baseline, `{p['baseline']}`, one CRC-32 of the whole file "
                  "(what a manifest check needs); speed = baseline time / variant time within a repetition. `cold`: "
                  "the file's pages dropped first (`posix_fadvise(DONTNEED)`).", "", p["table"], "",
                  (f"`verify_file` read {read:,} bytes of the {p['file_bytes']:,}-byte file (one pass); "
                   if read is not None else "") + f"`zlib.crc32` alone in memory: {crc}.", ""]
    if "data" in payloads:
        p = payloads["data"]
        lines += [f"### 6. Data set-up at MiniMind's size (seconds, lower is better; {p['environment']['date']})", "",
                  f"A seeded {p['records']:,}-record `{{\"text\"}}` file ({p['data_bytes'] / 1e9:.2f} GB, the size of "
                  "`pretrain_t2t_mini.jsonl`), in the page cache; every number from a fresh process: "
                  "`MiniMindDataModule.setup()` with an empty cache (the index built, every line validated) and with "
                  "the index cached; MiniMind's `load_dataset('json')` into a fresh and a warm Arrow cache; median "
                  f"(min–max) of {p['reps']} alternating repetitions (next start: 3).", "", p["table"], ""]
    if "remote" in payloads:
        p = payloads["remote"]
        lines += [f"### 7. Checkpoints on object storage (moto's S3 server on localhost, through s3fs; {p['environment']['date']})", "",
                  "Upload: a bare `s3fs.put_file` vs ours (upload, size + CRC-32 read back from the remote, manifest "
                  "object); loop stall: the median loop's wait per save (`ResumeCallback.save_seconds`), local directories (async save) vs "
                  "`s3://` directories (the same local save, then the background upload).", "", p["table"], ""]
    if "restart" in payloads:
        p = payloads["restart"]
        lines += [f"### 8. Restart breakdown (a resume start of the 64x2 model, launch → first optimizer step; seconds, "
                  f"lower is better; {p['environment']['date']})", "",
                  f"{p['reps']} rotated repetitions; phases cut at lines the process prints (`-X importtime`, `Seed set`, "
                  "Lightning's `Restoring states` / `Restored all states`, the first console line), stamped as read; the "
                  "parts without a line of their own timed in isolation in a fresh process.", "", p["table"], "",
                  p["verdict"], ""]
    return "\n".join(lines)


def update_readme(text: str, readme: Path = README) -> bool:
    if not readme.exists():
        return False
    content = readme.read_text()
    if START not in content or END not in content:
        return False
    head, rest = content.split(START, 1)
    _, tail = rest.split(END, 1)
    atomic_write_bytes(f"{head}{START}\n{text.rstrip()}\n{END}{tail}", readme)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes, seconds (the smoke test)")
    parser.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default 1)")
    parser.add_argument("--no-readme", action="store_true", help="do not refresh the tables in benchmarks/README.md")
    args = parser.parse_args(argv)
    start, payloads, failed = time.perf_counter(), {}, []
    for name in args.only:
        try:
            payloads[name] = execute(BENCHMARKS[name], args.results_dir, args.quick, threads=args.threads)
        except Exception:  # report, keep going with the others, fail at the end
            traceback.print_exc()
            failed.append(name)
        say("")
    if payloads and not args.quick:  # the summary also shows the latest full results of benchmarks not run now
        for name in BENCHMARKS:
            path = args.results_dir / f"{name}.json"
            if name not in payloads and name not in failed and path.exists() and not (earlier := json.loads(path.read_text()))["quick"]:
                payloads[name] = earlier
        payloads = {name: payloads[name] for name in BENCHMARKS if name in payloads}
    if payloads:
        text = summary(payloads)
        atomic_write_bytes(text + "\n", args.results_dir / "summary.md")
        full_default = not args.quick and args.results_dir.resolve() == RESULTS_DIR.resolve() and set(payloads) == set(BENCHMARKS)
        if full_default and not args.no_readme and update_readme(text):
            say(f"tables refreshed in {README}")
        say(f"results in {args.results_dir}/ (summary.md, *.json, *.png); {(time.perf_counter() - start) / 60:.1f} min")
    if failed:
        say(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
