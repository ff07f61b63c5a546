"""Serving throughput: continuous batching against one request at a time, at 1, 4 and 16 concurrent clients.

``python -m lit_minimind.serve`` serves a seeded random MiniMind of the 128 x 2 shape (fp16 export, the embedded
tokenizer) twice: batched (``--max_batch 16``) and one request at a time (``--max_batch 1``: the engine admits one
request, the next waits, as the server's former lock did). Each of ``C`` client threads streams ``REQUESTS``
chat completions one after another (its own prompt, ``ignore_eos``, exactly ``TOKENS`` tokens each, greedy) over
plain HTTP; measured: aggregate completion tokens/s (all tokens / wall time) and the time to first token (from the
request sent to its first content chunk), median over the requests. A last table times the model alone in-process
(``lit_minimind.model.batched.decode_step``, no HTTP), the ceiling the server works under. Both servers and every
client share the same 2 cores here: the limit is the CPU (the decoding thread, the handler threads' per-token
text, JSON and writes, and the clients' parsing), not the model's arithmetic.

``python -m benchmarks.bench_serve [--quick] [--reps N]``: the tables, and ``benchmarks/results/serve.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import common as bc

NAME = "serve"
HIDDEN, LAYERS, TOKENS, REQUESTS = 128, 2, 64, 2
CLIENTS = (1, 4, 16)
MODES = {"batched": "16", "one at a time": "1"}
LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
WORDS = "river lamp cloud stone apple tiger music paper garden window rocket violin forest silver candle orbit".split()


def export(path: Path) -> Path:
    """A seeded random MiniMind of the benchmark's shape, as an fp16 export; weights ~N(0, 0.1) (as
    ``tests/test_serve.py``'s): its greedy text varies, where at 0.02 it is blank lines, no content to time."""
    import torch

    from lit_minimind.checkpoint.weights import fp16_state_dict
    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM

    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS))
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.normal_(0, 0.1)
    torch.save(fp16_state_dict(model), path)
    return path


class Served:
    """The server in a subprocess, on a free loopback port."""

    def __init__(self, weights: Path, max_batch: str, log: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.serve", str(weights), "--port", "0",
                                      "--max_batch", max_batch], stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True, env=bc.child_env(), cwd=bc.ROOT)
        match = LISTENING.search(self.proc.stdout.readline())
        if not match:
            self.stop()
            raise bc.BenchError(f"the server did not start: {log.read_text()[-2000:]}")
        self.host, self.port = match.group(1), int(match.group(2))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def stream(host: str, port: int, prompt: str, tokens: int) -> dict[str, Any]:
    """One streamed chat completion: its seconds to the first content chunk, its total seconds, its tokens, its text."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    begun = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first, count, text = None, 0, []
    for line in response:
        if line.startswith(b'data: {') and b'"content": "' in line and b'"role"' not in line:
            first = time.perf_counter() - begun if first is None else first
            text.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
        if line.startswith(b'data: {"id"') and b'"usage": {' in line:
            count = json.loads(line[6:])["usage"]["completion_tokens"]
    conn.close()
    return {"ttft": first if first is not None else float("nan"), "seconds": time.perf_counter() - begun, "tokens": count,
            "prompt": prompt, "text": "".join(text)}


def load(server: Served, clients: int, requests: int, tokens: int) -> dict[str, Any]:
    """``clients`` threads, each streaming ``requests`` completions in turn: aggregate tokens/s, TTFT median."""
    results: list[dict[str, float]] = []
    lock, start = threading.Lock(), threading.Barrier(clients + 1)

    def client(i: int) -> None:
        start.wait()
        for r in range(requests):
            result = stream(server.host, server.port, f"Client {i}, question {r}: tell me about the {WORDS[i % 16]}.", tokens)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    begun = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begun
    total = sum(r["tokens"] for r in results)
    if total != clients * requests * tokens:
        raise bc.BenchError(f"{total} tokens came back, {clients * requests * tokens} expected")
    ttfts = sorted(r["ttft"] for r in results)
    return {"tokens": total, "seconds": wall, "tokens_per_s": total / wall, "ttft_median": ttfts[len(ttfts) // 2],
            "ttft_max": ttfts[-1], "texts": {r["prompt"]: r["text"] for r in results}}


def model_alone(weights: Path, steps: int) -> dict[int, float]:
    """decode_step's tokens/s at each batch size, in-process, one torch thread (the server's default)."""
    import torch

    from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
    from lit_minimind.model.batched import decode_step, exact_rows, prefill

    torch.set_num_threads(1)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS))
    model.load_state_dict({k: v.float() for k, v in torch.load(weights, weights_only=True).items()})
    model.eval()
    linear, rates = exact_rows(model), {}
    for batch in CLIENTS:
        caches = [prefill(model, list(range(5, 30 + i)))[0] for i in range(batch)]
        decode_step(model, caches, [7] * batch, linear)
        begun = time.perf_counter()
        for _ in range(steps):
            decode_step(model, caches, [7] * batch, linear)
        rates[batch] = batch * steps / (time.perf_counter() - begun)
    return rates


def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    reps = reps or 1
    requests, tokens = (1, 16) if quick else (REQUESTS, TOKENS)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {mode: {c: [] for c in CLIENTS} for mode in MODES}
    with bc.workdir("serve") as tmp:
        weights = export(tmp / "random_128.pth")
        for rep in range(reps):
            for mode in bc.alternating(list(MODES), rep):
                server = Served(weights, MODES[mode], tmp / f"{mode}.log")
                try:
                    load(server, 2, 1, 4)  # warm-up: the first forwards, the first threads
                    for clients in CLIENTS:
                        runs[mode][clients].append(result := load(server, clients, requests, tokens))
                        bc.say(f"  rep {rep + 1}/{reps} {mode}, {clients} client(s): {result['tokens_per_s']:.0f} "
                               f"tokens/s, TTFT {result['ttft_median'] * 1000:.0f} ms")
                finally:
                    server.stop()
        alone = model_alone(weights, 20 if quick else 200)
    rates = {mode: {c: bc.stats(runs[mode][c], "tokens_per_s") for c in CLIENTS} for mode in MODES}
    ttft = {mode: {c: bc.stats(runs[mode][c], "ttft_median") for c in CLIENTS} for mode in MODES}
    rows = []
    for clients in CLIENTS:
        for mode in MODES:
            rows.append([clients, mode, bc.fmt_num(rates[mode][clients]["median"]),
                         f"{ttft[mode][clients]['median'] * 1000:.0f}",
                         f"{max(r['ttft_max'] for r in runs[mode][clients]) * 1000:.0f}"])
        speedup = rates["batched"][clients]["median"] / rates["one at a time"][clients]["median"]
        rows.append([clients, "batched / one at a time", f"×{speedup:.2f}", "", ""])
    table = bc.table(["clients", "server", "aggregate tokens/s", "TTFT median ms", "TTFT max ms"], rows)
    model_table = bc.table(["batch", "decode_step tokens/s (model alone, no HTTP)", "× batch 1"],
                           [[b, bc.fmt_num(r), f"×{r / alone[1]:.2f}"] for b, r in alone.items()])
    same = all(a["texts"] == b["texts"] for c in CLIENTS for a, b in zip(runs["batched"][c], runs["one at a time"][c]))
    for mode in MODES:  # the texts are compared, not kept
        for c in CLIENTS:
            for result in runs[mode][c]:
                result.pop("texts")
    at16 = rates["batched"][16]["median"] / rates["one at a time"][16]["median"]
    verdict = (f"At 16 clients the batched server gives {rates['batched'][16]['median']:.0f} tokens/s against "
               f"{rates['one at a time'][16]['median']:.0f} one at a time (×{at16:.2f}; aim ×4: "
               f"{bc.yes(at16 >= 4)}); the model alone decodes ×{alone[16] / alone[1]:.2f} faster at batch 16 than 1. Every "
               f"completion the same batched as one at a time: {bc.yes(same)}.")
    return {"reps": reps, "model": {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS}, "requests_per_client": requests,
            "tokens_per_request": tokens, "same_completions": same, "runs": runs, "tokens_per_s": rates, "ttft": ttft,
            "model_alone_tokens_per_s": alone, "table": table, "model_table": model_table, "verdict": verdict}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_serve", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy size: the numbers mean nothing")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per server (default 1)")
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    payload = {"benchmark": NAME, "quick": args.quick, "environment": bc.environment(), **run(args.quick, args.reps)}
    print(payload["table"], payload["model_table"], payload["verdict"], sep="\n\n", flush=True)
    from lit_minimind.checkpoint.atomic import atomic_write_bytes

    atomic_write_bytes(json.dumps(payload, indent=1, default=str) + "\n", args.results_dir / f"{NAME}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
