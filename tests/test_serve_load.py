"""The server under load, loopback only and bounded in count and time: continuous batching gives each request
exactly its own tokens, and no client (idle, slow, huge, gone, half-closed) holds anyone else.

In-process: the batched decoder (``lit_minimind.model.batched``) and its engine against ``sample_tokens`` alone.
Two real servers (subprocesses on free ports, the tiny random model of ``tests/test_serve.py``): ``loaded`` with
the default bounds, ``bounded`` with small ones (``--max_batch 2 --max_connections 8 --timeout 1 --deadline 5``).
"""

from __future__ import annotations

import json
import resource
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from lit_minimind.cli.serve_engine import Engine, Job
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from lit_minimind.model.batched import decode_alone, decode_step, exact_rows, prefill, rows_linear
from lit_minimind.model.minimind import sample_tokens
from tests.helpers.runs import need_shared
from tests.test_serve import KEY, TOKENIZER, Server, assert_openai_error, random_export, raw, stream_text

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[dev]')")


def random_model(moe: bool = False) -> MiniMindForCausalLM:
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, use_moe=moe))
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.normal_(0, 0.1)
    return model.eval()


# ---------------------------------------------------------------------------------------------- in-process


def test_rows_linear_is_a_lone_rows_product_bit_for_bit() -> None:
    """The premise of batching exactly: on this machine each row of ``rows_linear`` is what that row alone gives
    (a plain ``F.linear`` of ``B`` rows is not: MKL sums one row and a block of rows in other orders)."""
    model = random_model()
    assert exact_rows(model) is rows_linear
    head, x = model.lm_head, torch.randn(16, 64)
    alone = torch.cat([head(row.view(1, 1, -1)).view(1, -1) for row in x])
    assert torch.equal(rows_linear(head, x), alone)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_decode_step_rows_equal_each_sequence_alone(moe: bool) -> None:
    model = random_model(moe)
    prompts = [[5 + i] * (1 + 3 * i) for i in range(6)]  # six lengths: each attends over its own cache
    batched = [prefill(model, p)[0] for p in prompts]
    with torch.inference_mode():
        alone = [model(torch.tensor([p]), use_cache=True).past_key_values for p in prompts]
    linear = exact_rows(model, len(prompts))
    for step in range(4):
        tokens = [100 + 7 * i + step for i in range(len(prompts))]
        rows = decode_step(model, batched, tokens, linear)
        for i, token in enumerate(tokens):
            assert torch.equal(rows[i:i + 1], decode_alone(model, alone[i], token)), (step, i)


def test_engine_jobs_joining_and_leaving_get_exactly_their_tokens_alone() -> None:
    """Ten jobs through an engine of batches of 4 (six wait, then join as others leave; their lengths differ):
    greedy, seeded nucleus and top-k jobs each get ``sample_tokens``'s tokens, in fewer forwards than tokens."""
    model = random_model()
    engine = Engine(model, max_batch=4).start()
    settings = [(0.0, 1.0, 0), (0.9, 0.9, 0), (1.0, 1.0, 20), (0.7, 0.92, 0), (1.2, 0.5, 5)]
    jobs, expected = [], []
    for i in range(10):
        temperature, top_p, top_k = settings[i % len(settings)]
        ids, n = [3 + i] * (2 + i), 6 + 3 * i
        alone = list(sample_tokens(model, torch.tensor([ids]), n, temperature, top_p, top_k, None,
                                   torch.Generator().manual_seed(i)))
        expected.append(alone)
        jobs.append(Job(ids, n, temperature, top_p, top_k, None, torch.Generator().manual_seed(i)))
    for job in jobs:
        engine.submit(job)
    got = [[t for t in job.tokens() if t is not None] for job in jobs]
    assert got == expected
    assert all(job.finish == "length" for job in jobs)
    assert engine.steps < sum(len(t) for t in expected) * 0.6, engine.steps  # batched, not one job after another


def test_engine_drops_cancelled_and_late_jobs() -> None:
    engine = Engine(random_model(), max_batch=2).start()
    late = engine.submit(Job([5, 6], 10, 0.0, deadline=time.monotonic() - 1))
    assert [t for t in late.tokens() if t is not None] == [] and late.finish == "deadline"
    job = engine.submit(Job([5, 6], 100_000, 0.0, eos=None))
    first = next(t for t in job.tokens() if t is not None)
    job.cancel()
    rest = [t for t in job.tokens() if t is not None]
    assert isinstance(first, int) and len(rest) < 1000 and job.finish == "cancelled"
    broken = engine.submit(Job([10**6], 3, 0.0))  # past the vocabulary: its prefill raises inside the engine
    assert [t for t in broken.tokens() if t is not None] == [] and broken.finish == "error"
    after = engine.submit(Job([5, 6], 3, 0.0, eos=None))  # the engine went on
    assert len([t for t in after.tokens() if t is not None]) == 3 and after.finish == "length"


# ---------------------------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    need_shared()
    tmp = tmp_path_factory.mktemp("serve_load")
    export = random_export(tmp / "random_64.pth")
    common = [str(export), "--tokenizer_path", str(TOKENIZER), "--api_key", KEY]
    started = {"loaded": Server(tmp, "loaded", *common),
               "bounded": Server(tmp, "bounded", *common, "--max_batch", "2", "--max_connections", "8", "--timeout", "1",
                                 "--deadline", "5")}
    try:
        yield {name: server.wait() for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def loaded(servers: dict[str, Server]) -> Server:
    return servers["loaded"]


@pytest.fixture(scope="module")
def bounded(servers: dict[str, Server]) -> Server:
    return servers["bounded"]


def logged(server: Server, text: str, count: int = 1, within: float = 15.0) -> int:
    """How many times ``text`` is in the server's log, waiting up to ``within`` seconds for ``count``."""
    end = time.monotonic() + within
    while (seen := server.log.read_text().count(text)) < count and time.monotonic() < end:
        time.sleep(0.1)
    return seen


def chat_bytes(body: dict, http11: str = "") -> bytes:
    data = json.dumps(body)
    return (f"POST /v1/chat/completions HTTP/1.{1 if http11 else 0}\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{http11}Content-Length: {len(data)}\r\n\r\n{data}").encode()


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while piece := sock.recv(65536):
        data += piece
    return data


def test_twenty_streams_five_hang_up_the_others_each_get_exactly_their_own(loaded: Server) -> None:
    """20 concurrent ``openai`` streams (more than a batch: four wait and join), greedy and seeded; 5 hang up after
    two chunks (their generations would run 2,000 tokens); the other 15 get exactly what each gets alone."""
    client = loaded.client()
    asks = [dict(messages=[{"role": "user", "content": f"Item {i}: what is {word}?"}], max_tokens=24,
                 temperature=0.0 if i % 2 else 0.9, seed=1000 + i)
            for i, word in enumerate("ab cd ef gh ij kl mn op qr st uv wx yz ba dc fe hg ji lk nm".split())]
    hang = {1, 6, 10, 15, 19}
    expected = {i: client.chat.completions.create(model="m", **ask).choices[0].message.content
                for i, ask in enumerate(asks) if i not in hang}
    assert len(set(expected.values())) == len(expected)  # distinct: a mix-up could not go unseen
    got: dict[int, str] = {}
    start = threading.Barrier(len(asks))

    def ask(i: int) -> None:
        own = loaded.client()  # a connection pool of its own, as separate users have
        start.wait()
        if i in hang:
            stream = own.chat.completions.create(model="m", stream=True, **{**asks[i], "max_tokens": 2000},
                                                 extra_body={"ignore_eos": True})
            for n, _ in enumerate(stream):
                if n == 2:
                    break
            stream.close()
        else:
            got[i] = stream_text(own.chat.completions.create(model="m", stream=True, **asks[i]))[1]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert got == expected
    assert logged(loaded, "client disconnected", len(hang)) >= len(hang)


def test_eleven_hundred_idle_connections_and_a_request_still_answered(loaded: Server) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    idle = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection((loaded.host, loaded.port), timeout=30))
        begun = time.monotonic()
        reply = loaded.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4 and time.monotonic() - begun < 10, reply
        stream = loaded.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=4, temperature=0, stream=True)
        assert stream_text(stream)[3][-1] == "length"
    finally:
        for sock in idle:
            sock.close()


def test_a_15_mb_prompt_is_refused_in_under_a_second_with_little_memory(loaded: Server) -> None:
    status_file = Path(f"/proc/{loaded.proc.pid}/status")
    if not status_file.exists():
        pytest.skip("no /proc (the resident-memory check reads it)")

    def kib(field: str) -> int:
        line = next(x for x in status_file.read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1])

    raw(loaded, "GET", "/v1/models")
    before = kib("VmRSS")
    Path(f"/proc/{loaded.proc.pid}/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
    body = json.dumps({"messages": [{"role": "user", "content": "ab " * 5_000_000}]}).encode()
    begun = time.monotonic()
    status, parsed, _ = raw(loaded, "POST", "/v1/chat/completions", body)
    took = time.monotonic() - begun
    assert_openai_error(status, parsed, 400)
    assert parsed["error"]["code"] == "context_length_exceeded"
    assert took < 1.0, took
    assert kib("VmHWM") - before < 100 * 1024, (before, kib("VmHWM"))


def test_connections_beyond_the_bound_get_503_at_once(bounded: Server) -> None:
    held = [socket.create_connection((bounded.host, bounded.port), timeout=10) for _ in range(8)]
    try:
        time.sleep(0.3)  # the server has accepted them
        extra = socket.create_connection((bounded.host, bounded.port), timeout=10)
        answer = read_all(extra)
        extra.close()
        assert answer.startswith(b"HTTP/1.0 503") and b"too_many_connections" in answer, answer[:300]
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    assert raw(bounded, "GET", "/v1/models")[0] == 200


def test_a_stream_reader_that_stops_reading_holds_no_one_and_is_dropped(bounded: Server) -> None:
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # it reads nothing: the server's writes soon block
    slow.settimeout(30)
    slow.connect((bounded.host, bounded.port))
    try:
        slow.sendall(chat_bytes({"messages": [{"role": "user", "content": "Go on."}], "stream": True, "temperature": 0,
                                 "max_tokens": 20000, "ignore_eos": True}))
        time.sleep(0.5)
        begun = time.monotonic()
        reply = bounded.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8 and time.monotonic() - begun < 3
        assert logged(bounded, "client disconnected", 1, within=10) >= 1  # a write blocked for --timeout 1
    finally:
        slow.close()


def test_the_deadline_stops_a_long_generation(bounded: Server) -> None:
    begun = time.monotonic()
    reply = bounded.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "Go on."}],
                                                     max_tokens=30000, temperature=0, extra_body={"ignore_eos": True})
    took = time.monotonic() - begun
    assert reply.choices[0].finish_reason == "length" and 0 < reply.usage.completion_tokens < 30000
    assert 4 < took < 8, took
    assert "deadline: generation stopped after" in bounded.log.read_text()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_half_closed_client_gets_its_whole_answer(bounded: Server, stream: bool) -> None:
    sock = socket.create_connection((bounded.host, bounded.port), timeout=30)
    sock.sendall(chat_bytes({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
                             "stream": stream, "stream_options": {"include_usage": True}}))
    sock.shutdown(socket.SHUT_WR)  # done sending: still reading
    answer = read_all(sock)
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), answer[:300]
    if stream:
        assert b"data: [DONE]" in body and b'"completion_tokens": 8' in body, body[-500:]
    else:
        assert json.loads(body)["usage"]["completion_tokens"] == 8


def test_expect_100_continue_is_answered(bounded: Server) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\nExpect: 100-continue\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection((bounded.host, bounded.port), timeout=2)
    sock.sendall(head)
    assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # within the 2 s timeout, before any body
    sock.sendall(body.encode())
    answer = read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.0 200") and b'"completion_tokens": 3' in answer, answer[:300]
    # refused before the body: the answer comes at once, no body asked for
    sock = socket.create_connection((bounded.host, bounded.port), timeout=2)
    sock.sendall(head.replace(KEY.encode(), b"sk-wrong"))
    assert read_all(sock).startswith(b"HTTP/1.0 401")
    sock.close()


def test_a_plain_request_whose_client_closes_stops_its_generation(bounded: Server) -> None:
    """A non-streamed request writes nothing until its end; its client closing is found all the same (the headers
    early, then a space: the closed socket resets), well before the deadline."""
    before = bounded.log.read_text().count("client disconnected")
    sock = socket.create_connection((bounded.host, bounded.port), timeout=10)
    sock.sendall(chat_bytes({"messages": [{"role": "user", "content": "Go on."}], "temperature": 0,
                             "max_tokens": 20000, "ignore_eos": True}))
    time.sleep(0.3)
    sock.close()
    assert logged(bounded, "client disconnected", before + 1, within=4) == before + 1
