"""``python -m lit_minimind.serve``: the OpenAI-compatible server and its chat page, against real clients.

Two real servers run as subprocesses on free localhost ports (``--port 0``: the port the OS gave is read
from the server's ``listening`` line):

- ``plain``: a tiny random MiniMind (it writes varied text and never stops by itself) behind ``--api_key``:
  the ``openai`` client streaming and not, greedy and seeded output equal to ``python -m
  lit_minimind.generate``, 8 concurrent streams, 100 malformed requests, 401s, a client that disconnects,
  the loopback-only default.
- ``memorized``: ``tests/fixtures/serve/memorized_64.pth``, a tiny MiniMind trained
  (``tests/fixtures/serve/make_model.py``) until its greedy answers to two prompts are a reasoning block and a
  tool call: the reasoning split, ``tool_calls`` and MiniMind's ``scripts/chat_api.py`` request shape are
  checked end to end on what a model generates, and the chat page in headless Chromium (skipped without it).

The parsing, stop strings and sampling are also unit-tested in-process below.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from lit_minimind.checkpoint.weights import fp16_state_dict
from lit_minimind.cli import serve
from lit_minimind.model import MiniMindConfig, MiniMindForCausalLM
from tests.helpers.runs import MINIMIND, ROOT, cli_env, need_shared

TOKENIZER = MINIMIND / "tokenizer"
FIXTURES = ROOT / "tests" / "fixtures" / "serve"
MEMORIZED = FIXTURES / "memorized_64.pth"
KEY = "sk-test-key"
LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SKY = [{"role": "user", "content": "Why is the sky blue?"}]  # memorized, with open_thinking
SKY_REASONING, SKY_ANSWER = "Blue light scatters more.", "Because of Rayleigh scattering."
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]  # memorized, with tools=[WEATHER]

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[dev]')")


def local_http() -> Any:
    """The openai client's HTTP client, ignoring any HTTP(S)_PROXY of the environment (the server is on localhost)."""
    return openai.DefaultHttpxClient(trust_env=False)


class Server:
    """``python -m lit_minimind.serve`` in a subprocess; stderr (its request log) goes to a file."""

    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.log = tmp / f"{name}.stderr"
        self.proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.serve", *args, "--port", "0"],
                                     cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True)
        self.host = self.port = None

    def wait(self) -> "Server":
        line = self.proc.stdout.readline()  # the server prints one line once it listens
        match = LISTENING.search(line)
        assert match, f"no listening line: {line!r}\n{self.log.read_text()[-3000:]}"
        self.host, self.port = match.group(1), int(match.group(2))
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self, key: str | None = KEY, **kwargs: Any) -> "openai.OpenAI":
        return openai.OpenAI(api_key=key or "none", base_url=self.url + "/v1", max_retries=0, timeout=60,
                             http_client=local_http(), **kwargs)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def random_export(path: Path) -> Path:
    """A random MiniMind (hidden 64, 2 layers) as an fp16 export; weights ~N(0, 0.1), not 0.02: its greedy text
    varies (at 0.02 it repeats the prompt's last token, blank lines here)."""
    torch.manual_seed(0)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2))
    with torch.no_grad():
        for weight in (p for p in model.parameters() if p.dim() == 2):
            weight.normal_(0, 0.1)
    torch.save(fp16_state_dict(model), path)
    return path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    need_shared()
    tmp = tmp_path_factory.mktemp("serve")
    export = random_export(tmp / "random_64.pth")
    started = {"plain": Server(tmp, "plain", str(export), "--tokenizer_path", str(TOKENIZER), "--api_key", KEY),
               "memorized": Server(tmp, "memorized", str(MEMORIZED), "--tokenizer_path", str(TOKENIZER))}
    started["plain"].export = export  # for the generate comparison
    try:
        yield {name: server.wait() for name, server in started.items()}  # both start side by side
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def plain(servers: dict[str, Server]) -> Server:
    return servers["plain"]


@pytest.fixture(scope="module")
def memorized(servers: dict[str, Server]) -> Server:
    return servers["memorized"]


def raw(server: Server, method: str, path: str, body: bytes | str | None = None, key: str | None = KEY,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any] | None, bytes]:
    """One HTTP request: (status, the JSON body or None, the raw body)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    all_headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                   **(headers or {})}
    conn.request(method, path, body=body.encode() if isinstance(body, str) else body, headers=all_headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    return response.status, parsed, data


def assert_openai_error(status: int, body: Any, expected: int | tuple[int, ...]) -> None:
    assert status in (expected if isinstance(expected, tuple) else (expected,)), (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body


def stream_text(stream: Any) -> tuple[str, str, list[Any], list[str | None]]:
    """(reasoning, content, tool call deltas, finish reasons) of an ``openai`` chat stream."""
    reasoning, content, calls, finishes = [], [], [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        calls.extend(delta.tool_calls or [])
        finishes.append(chunk.choices[0].finish_reason)
    return "".join(reasoning), "".join(content), calls, finishes


# ---------------------------------------------------------------------------------------------- the API


def test_listens_on_loopback_only_by_default(plain: Server) -> None:
    import psutil

    listening = [c.laddr for c in psutil.Process(plain.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", plain.port)]
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))  # no packet is sent: the address a route outward would use
        outward = probe.getsockname()[0]
    except OSError:
        outward = None
    finally:
        probe.close()
    if outward and not outward.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((outward, plain.port), timeout=5).close()


def test_openai_client_non_streaming_and_streaming(plain: Server) -> None:
    client = plain.client()
    [model] = client.models.list().data
    assert model.id == "random_64"
    question = [{"role": "user", "content": "What is the for statement?"}]
    reply = client.chat.completions.create(model=model.id, messages=question, temperature=0, max_tokens=16)
    assert reply.object == "chat.completion" and reply.model == "random_64"
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"  # a random model never says eos
    assert choice.message.content and reply.usage.completion_tokens == 16
    stream = client.chat.completions.create(model=model.id, messages=question, temperature=0, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # the same greedy answer, streamed in pieces
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16


def test_stop_strings(plain: Server) -> None:
    client = plain.client()
    question = [{"role": "user", "content": "Tell me more."}]
    full = client.chat.completions.create(model="m", messages=question, temperature=0, max_tokens=24).choices[0].message.content
    cut = full[len(full) // 3: len(full) // 3 + 2]
    assert cut.strip()
    for stream in (False, True):
        reply = client.chat.completions.create(model="m", messages=question, temperature=0, max_tokens=24, stop=[cut, "\x00"],
                                               stream=stream)
        if stream:
            _, content, _, finishes = stream_text(reply)
            finish = finishes[-1]
        else:
            content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert content == full[: full.index(cut)].strip() and finish == "stop", (stream, content)


def run_generate(export: Path, question: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lit_minimind.generate", str(export), "--tokenizer_path", str(TOKENIZER),
                             "--chat", question, "--max_new_tokens", "20", *flags], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_output_equals_generate_greedy_and_seeded(plain: Server) -> None:
    """The server answers what ``python -m lit_minimind.generate --chat`` prints: greedily, and sampled with the
    same temperature, top_p and seed (the server's sampler draws as ``generate`` does)."""
    question = "What is the with statement?"
    runs = {"greedy": run_generate(plain.export, question, "--temperature", "0"),
            "sampled": run_generate(plain.export, question, "--temperature", "0.8", "--top_p", "0.9", "--seed", "3")}
    client = plain.client()
    messages = [{"role": "user", "content": question}]
    served = {"greedy": client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=20),
              "sampled": client.chat.completions.create(model="m", messages=messages, temperature=0.8, top_p=0.9, seed=3,
                                                        max_tokens=20)}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        assert not re.search(r"</?think>|</?tool_call>", out), out  # nothing the server would split off
        assert served[name].choices[0].message.content == out.strip() != "", name
    assert served["greedy"].choices[0].message.content != served["sampled"].choices[0].message.content


def test_eight_concurrent_streams_each_get_their_own_completion(plain: Server) -> None:
    questions = [f"Question number {i}: what is {word}?" for i, word in
                 enumerate(["assert", "yield", "lambda", "class", "import", "global", "return", "while"])]
    client = plain.client()
    expected = [client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], temperature=0,
                                               max_tokens=12).choices[0].message.content for q in questions]
    assert len(set(expected)) == len(questions)  # distinct answers: a mix-up could not go unseen
    got: list[str | None] = [None] * len(questions)
    start = threading.Barrier(len(questions))

    def ask(i: int) -> None:
        own = plain.client()  # a client (connection pool) of its own, as separate users have
        start.wait()
        stream = own.chat.completions.create(model="m", messages=[{"role": "user", "content": questions[i]}],
                                             temperature=0, max_tokens=12, stream=True)
        got[i] = stream_text(stream)[1]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert got == expected


def malformed_requests() -> list[tuple[str, str, bytes | str | None, dict[str, str], int | tuple[int, ...]]]:
    """(method, path, body, extra headers, expected status): 100 requests the server must refuse."""
    ok = [{"role": "user", "content": "hi"}]

    def body(**fields: Any) -> str:
        return json.dumps({"model": "m", "messages": ok, **fields})

    bad = [
        ("POST", "/v1/chat/completions", "{not json", {}, 400),
        ("POST", "/v1/chat/completions", "", {}, 400),
        ("POST", "/v1/chat/completions", b"\xff\xfe\x00garbage", {}, 400),
        ("POST", "/v1/chat/completions", "[1, 2, 3]", {}, 400),
        ("POST", "/v1/chat/completions", "null", {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"model": "m"}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": []}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": "hi"}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": ["hi"]}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"content": "hi"}]}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user"}]}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 42}]}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), {}, 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "assistant", "content": None,
                                                                   "tool_calls": "call"}]}), {}, 400),
        ("POST", "/v1/chat/completions", body(max_tokens=0), {}, 400),
        ("POST", "/v1/chat/completions", body(max_tokens=-5), {}, 400),
        ("POST", "/v1/chat/completions", body(max_tokens=10**9), {}, 400),  # beyond the model's context
        ("POST", "/v1/chat/completions", body(max_tokens=32768), {}, 400),  # the context, with a prompt before it
        ("POST", "/v1/chat/completions", body(max_tokens="many"), {}, 400),
        ("POST", "/v1/chat/completions", body(max_tokens=1.5), {}, 400),
        ("POST", "/v1/chat/completions", body(max_tokens=True), {}, 400),
        ("POST", "/v1/chat/completions", body(max_completion_tokens=0), {}, 400),
        ("POST", "/v1/chat/completions", body(temperature=-1), {}, 400),
        ("POST", "/v1/chat/completions", body(temperature="hot"), {}, 400),
        ("POST", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', {}, 400),
        ("POST", "/v1/chat/completions", body(top_p=0), {}, 400),
        ("POST", "/v1/chat/completions", body(top_p=1.5), {}, 400),
        ("POST", "/v1/chat/completions", body(top_k=-1), {}, 400),
        ("POST", "/v1/chat/completions", body(stream="yes"), {}, 400),
        ("POST", "/v1/chat/completions", body(n=3), {}, 400),
        ("POST", "/v1/chat/completions", body(stop=""), {}, 400),
        ("POST", "/v1/chat/completions", body(stop=[1, 2]), {}, 400),
        ("POST", "/v1/chat/completions", body(stop=["a", "b", "c", "d", "e"]), {}, 400),
        ("POST", "/v1/chat/completions", body(tools={"type": "function"}), {}, 400),
        ("POST", "/v1/chat/completions", body(tools="get_weather"), {}, 400),
        ("POST", "/v1/chat/completions", body(tools=[1]), {}, 400),
        ("POST", "/v1/chat/completions", body(open_thinking="yes"), {}, 400),
        ("POST", "/v1/chat/completions", body(chat_template_kwargs=[1]), {}, 400),
        ("POST", "/v1/chat/completions", body(chat_template_kwargs={"open_thinking": 1}), {}, 400),
        ("POST", "/v1/chat/completions", body(seed="x"), {}, 400),
        ("POST", "/v1/chat/completions", body(stream_options=5), {}, 400),
        ("POST", "/v1/chat/completions", body(), {"Content-Length": "-3"}, 400),
        ("POST", "/v1/chat/completions", body(), {"Content-Length": "abc"}, 400),
        ("POST", "/v1/chat/completions", "x" * 10, {"Content-Length": str(10**10)}, 413),
        ("GET", "/v1/chat/completions", None, {}, 405),
        ("POST", "/v1/models", "{}", {}, 405),
        ("GET", "/v1/completions", None, {}, 404),
        ("POST", "/v1/embeddings", "{}", {}, 404),
        ("GET", "/v1/models/gpt-4", None, {}, 404),
        ("GET", "/admin", None, {}, 404),
        ("DELETE", "/v1/chat/completions", None, {}, 405),
        ("PUT", "/v1/chat/completions", "{}", {}, 405),
    ]
    variants = [("POST", "/v1/chat/completions", body(max_tokens=-i), {}, 400) for i in range(1, 30)] + \
               [("GET", f"/v1/nothing/{i}", None, {}, 404) for i in range(30)]
    return (bad + variants)[:100]


def test_hundred_malformed_requests_then_a_normal_one(plain: Server) -> None:
    requests = malformed_requests()
    assert len(requests) == 100
    for method, path, body, headers, expected in requests:
        status, parsed, data = raw(plain, method, path, body, headers=headers)
        assert b"Traceback" not in data
        assert_openai_error(status, parsed, expected)
    # http.server's own refusals (no valid request line, a header line too long) are in the same shape
    for garbage in (b"GARBAGE\r\n\r\n", b"GET /\xff HTTP/1.1 extra\r\n\r\n"):
        with socket.create_connection((plain.host, plain.port), timeout=30) as sock:
            sock.sendall(garbage)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.split()[1].startswith(b"4"), head
        assert_openai_error(int(head.split()[1]), json.loads(payload), 400)
    reply = plain.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens == 4
    assert "Traceback" not in plain.log.read_text()


def test_hostile_requests_get_400s_in_openais_shape_and_the_server_goes_on(plain: Server) -> None:
    """What an attacker tried on 2026-12-04 got 500s or hung (the traceback only in the server's log): each is now
    refused in OpenAI's error shape, and the server answers the next request."""
    hi = '[{"role": "user", "content": "hi"}]'
    hostile = [
        ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", {}, 400),  # nested deeper than Python's stack
        ('{"messages": ' + hi + ', "max_tokens": 1' + "0" * 5000 + "}", {}, 400),  # a 5,001-digit integer
        ('{"messages": [{"role": ["user"], "content": "hi"}]}', {}, 400),  # a role that is a list
        ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', {}, 400),  # a lone surrogate
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', {}, 400),
        (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                  "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]}), {}, 400),
        ('{"messages": ' + hi + ', "seed": ' + str(2**64) + "}", {}, 400),
        ('{"messages": ' + hi + ', "seed": -1}', {}, 400),
        ('{"messages": ' + hi + "}", {"Content-Length": "3_4"}, 400),  # int() would read 34
        ('{"messages": ' + hi + "}", {"Content-Type": "text/plain"}, 415),  # a browser's cross-site simple request
        ('{"messages": ' + hi + "}", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ('{"messages": ' + hi + "}", {"Host": "evil.example:8998"}, 403),  # DNS rebinding
    ]
    for body, headers, expected in hostile:
        status, parsed, data = raw(plain, "POST", "/v1/chat/completions", body, headers=headers)
        assert b"Traceback" not in data
        assert_openai_error(status, parsed, expected)
    assert "Traceback" not in plain.log.read_text()
    for host in ("localhost", "127.0.0.1", "[::1]", "LOCALHOST:1"):  # loopback names and IP literals are served
        assert raw(plain, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    assert raw(plain, "GET", "/v1/models", headers={"Host": "evil.example"})[0] == 403
    assert raw(plain, "GET", "/v1/models", key=None, headers={"Authorization": f"bearer {KEY}"})[0] == 200  # any case


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(plain: Server) -> None:
    """15 MB of prompt: refused from its size alone (no token stands for more than the vocabulary's longest entry),
    not rendered and tokenized first (37 s and 3.3 GB before)."""
    body = json.dumps({"messages": [{"role": "user", "content": "ab " * 5_000_000}]})
    status, parsed, _ = raw(plain, "POST", "/v1/chat/completions", body)
    assert_openai_error(status, parsed, 400)
    assert parsed["error"]["code"] == "context_length_exceeded" and "bytes per token" in parsed["error"]["message"]


def test_host_flag_empty_is_refused_and_ipv6_loopback_listens(plain: Server, tmp_path: Path) -> None:
    """``--host ''`` would bind every interface under a warning reading "listening on :": one error line instead;
    ``--host ::1``, listed as loopback, listens on IPv6 and answers there."""
    assert serve.main([str(plain.export), "--host", ""]) == 2
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.serve", str(plain.export), "--tokenizer_path",
                             str(TOKENIZER), "--host", "::1", "--port", "0"], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        match = re.search(r"listening on http://\[::1\]:(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        conn = http.client.HTTPConnection("::1", int(match.group(1)), timeout=30)
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "warning" not in proc.stderr.read()  # loopback: no "reachable from other machines"


def test_api_key_required_on_every_request(plain: Server) -> None:
    for key in (None, "sk-wrong"):
        for method, path, body in (("GET", "/", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}]})),
                                   ("GET", "/nowhere", None)):
            status, parsed, _ = raw(plain, method, path, body, key=key)
            assert_openai_error(status, parsed, 401)
            assert parsed["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        plain.client(key="sk-wrong").models.list()
    assert raw(plain, "GET", "/v1/models")[0] == 200


def test_client_disconnecting_mid_stream_stops_its_generation(plain: Server) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "Go on forever."}], "stream": True, "temperature": 0,
                       "max_tokens": 20000, "ignore_eos": True})
    sock = socket.create_connection((plain.host, plain.port), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    received = b""
    while received.count(b'"content": "') < 3:  # the role chunk, then two pieces of text
        piece = sock.recv(4096)
        assert piece, received  # the server answered and closed (an error) instead of streaming
        received += piece
    sock.close()
    begun, stopped = time.monotonic(), []
    while not stopped and time.monotonic() - begun < 30:  # its next write fails: the handler cancels its job
        time.sleep(0.1)
        stopped = re.findall(r"client disconnected: generation stopped after (\d+) tokens", plain.log.read_text())
    assert stopped and int(stopped[-1]) < 2000, stopped
    plain.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.slow
def test_lora_adapters_answer_as_generate_does(tmp_path: Path) -> None:
    """``--lora``: greedy output equals ``generate --lora`` and differs from the base's. The adapters have the keys and
    shapes of MiniMind's own LoRA file (``post/out__lora_tutor_64.pth``) with larger random values: MiniMind's 5-step
    adapters leave a random base's greedy text unchanged, a test that could not fail."""
    need_shared()
    torch.manual_seed(1)
    adapters = {k: (torch.randn_like(v.float()) * 0.3).half()
                for k, v in torch.load(MINIMIND / "post" / "out__lora_tutor_64.pth", weights_only=True).items()}
    lora = tmp_path / "lora_random_64.pth"
    torch.save(adapters, lora)
    base = random_export(tmp_path / "random_64.pth")
    question = "Explain recursion."
    server = Server(tmp_path, "lora", str(base), "--lora", str(lora), "--tokenizer_path", str(TOKENIZER))
    try:
        procs = [run_generate(base, question, "--lora", str(lora), "--temperature", "0"),
                 run_generate(base, question, "--temperature", "0")]
        server.wait()
        reply = server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": question}],
                                                        temperature=0, max_tokens=20)
        with_lora, without = (proc.communicate(timeout=120)[0].strip() for proc in procs)
        assert all(proc.returncode == 0 for proc in procs)
        assert reply.choices[0].message.content == with_lora != without
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- reasoning, tools


def test_reasoning_split_streaming_and_not(memorized: Server) -> None:
    client = memorized.client()
    for extra in ({"open_thinking": True}, {"chat_template_kwargs": {"open_thinking": True}},
                  {"chat_template_kwargs": {"enable_thinking": True}}):
        reply = client.chat.completions.create(model="m", messages=SKY, temperature=0, max_tokens=40, extra_body=extra)
        message = reply.choices[0].message
        assert (message.reasoning_content, message.content, reply.choices[0].finish_reason) == \
            (SKY_REASONING, SKY_ANSWER, "stop"), extra
        reasoning, content, calls, finishes = stream_text(client.chat.completions.create(
            model="m", messages=SKY, temperature=0, max_tokens=40, extra_body=extra, stream=True))
        assert (reasoning, content, calls, finishes[-1]) == (SKY_REASONING, SKY_ANSWER, [], "stop"), extra


def test_minimind_chat_api_request_shape(memorized: Server) -> None:
    """MiniMind's ``scripts/chat_api.py``: its client call, streaming and not, read the way it reads the reply."""
    client = openai.OpenAI(api_key="sk-123", base_url=memorized.url + "/v1", max_retries=0, http_client=local_http())
    for stream in (True, False):
        response = client.chat.completions.create(
            model="minimind-local:latest", messages=SKY, stream=stream, temperature=0.8, max_tokens=2048, top_p=0.8,
            extra_body={"chat_template_kwargs": {"open_thinking": True}, "reasoning_effort": "medium"})
        if not stream:
            assert response.choices[0].message.content == SKY_ANSWER
            assert response.choices[0].message.reasoning_content == SKY_REASONING
            continue
        reasoning, answer = "", ""
        for chunk in response:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            answer += delta.content or ""
        assert (reasoning, answer) == (SKY_REASONING, SKY_ANSWER)


def test_tool_calls_streaming_and_not(memorized: Server) -> None:
    client = memorized.client()
    reply = client.chat.completions.create(model="m", messages=PARIS, tools=[WEATHER], temperature=0, max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    _, content, calls, finishes = stream_text(client.chat.completions.create(
        model="m", messages=PARIS, tools=[WEATHER], temperature=0, max_tokens=60, stream=True))
    assert content == "" and finishes[-1] == "tool_calls"
    [streamed] = calls
    assert streamed.index == 0 and streamed.function.name == "get_weather"
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    # the call, its result and the next turn render through the chat template (a 200, whatever the model says)
    follow = [*PARIS, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": '{"weather": "sunny"}'}]
    assert client.chat.completions.create(model="m", messages=follow, tools=[WEATHER], max_tokens=4).choices


# ---------------------------------------------------------------------------------------------- units


@pytest.mark.parametrize("open_thinking, text, expected", [
    (True, "a b\n</think>\n\nanswer <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>  ",
     [("reasoning", "a b"), ("content", "answer"), ("tool_call", {"name": "f", "arguments": '{"x": 1}'})]),
    (False, "plain <tool_call>not json</tool_call> end", [("content", "plain <tool_call>not json</tool_call> end")]),
    (False, "<think>hm</think>\n\nok", [("reasoning", "hm"), ("content", "ok")]),
    (False, "x <tool_call>{\"name\": \"f\"", [("content", "x <tool_call>{\"name\": \"f\"")]),  # never closed
    (True, "still thinking <", [("reasoning", "still thinking <")]),
    (False, "a <tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_call>b<tool_call>{\"name\": \"g\"}</tool_call>",
     [("content", "a"), ("tool_call", {"name": "f", "arguments": "{}"}), ("content", " b"),
      ("tool_call", {"name": "g", "arguments": "{}"})]),
])
def test_reply_parser_any_split_gives_the_same_events(open_thinking: bool, text: str, expected: list) -> None:
    def merged(events: list) -> list:
        out: list = []
        for kind, value in events:
            if out and kind == out[-1][0] != "tool_call":
                out[-1] = (kind, out[-1][1] + value)
            else:
                out.append((kind, value))
        return out

    for size in (len(text), 1, 2, 3, 7):
        parser = serve.ReplyParser(open_thinking)
        events = [e for i in range(0, len(text), size) for e in parser.push(text[i: i + size])] + parser.flush()
        assert merged(events) == expected, size


def test_text_stream_pieces_add_up_to_the_decoding_of_all_tokens() -> None:
    """Incremental decoding (only the tokens since the last complete character): the pieces of random token streams,
    multi-byte characters split across tokens and special tokens included, add up to the decoding of all of them,
    and no piece ends inside a character."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    texts = ["héllo wörld — 你好，世界！ 🙂 done", "plain ascii text", "\u00e9\u00e9\u00e9 \U0001f600\U0001f600"]
    generator = torch.Generator().manual_seed(0)
    streams = [tokenizer.encode(t).ids for t in texts]
    streams += [torch.randint(0, tokenizer.get_vocab_size(), (200,), generator=generator).tolist() for _ in range(20)]
    for ids in streams:
        stream = serve.TextStream(tokenizer)
        pieces = [stream.push(token) for token in ids] + [stream.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(piece.endswith("\ufffd") for piece in pieces[:-1] if piece and ids == streams[0])


def test_stop_filter_holds_back_what_may_be_a_stop_string() -> None:
    text = "one two </end> three"
    for size in (1, 2, 5, len(text)):
        stops = serve.StopFilter(["</end>", "zzz"])
        out = "".join(stops.push(text[i: i + size]) for i in range(0, len(text), size) if not stops.stopped)
        assert out == "one two " and stops.stopped, size
    stops = serve.StopFilter(["</end>"])
    assert stops.push("tail </en") == "tail " and stops.flush() == "</en"


def test_sample_tokens_draws_what_model_generate_draws() -> None:
    torch.manual_seed(1)
    model = MiniMindForCausalLM(MiniMindConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=300)).eval()
    prompt = torch.tensor([[1, 5, 9, 42]])
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 0.7, "top_p": 0.5, "top_k": 50}):
        expected = model.generate(prompt, max_new_tokens=20, greedy=sampling["temperature"] == 0, eos_token_id=None,
                                  generator=torch.Generator().manual_seed(7), **sampling)[0, 4:].tolist()
        got = list(serve.sample_tokens(model, prompt, 20, eos_token_id=None, generator=torch.Generator().manual_seed(7),
                                       **sampling))
        assert got == expected, sampling


def test_parse_request_open_thinking_and_defaults() -> None:
    base = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}]}
    request = serve.parse_request(json.dumps(base).encode())
    assert request.messages == [{"role": "system", "content": "be brief"}]
    assert (request.temperature, request.top_p, request.stream, request.open_thinking) == (0.7, 0.92, False, False)
    for extra in ({"open_thinking": True}, {"chat_template_kwargs": {"open_thinking": True}},
                  {"chat_template_kwargs": {"enable_thinking": True}}):
        assert serve.parse_request(json.dumps({**base, **extra}).encode()).open_thinking, extra
    assert serve.parse_request(json.dumps({**base, "stop": "x", "tools": [WEATHER], "tool_choice": "none"}).encode()).tools is None


# ---------------------------------------------------------------------------------------------- the page


def _chromium() -> tuple[str, str] | None:
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


class WebDriver:
    """The W3C WebDriver protocol over HTTP (urllib): chromedriver without the selenium package."""

    ELEMENT = "element-6066-11e4-a52e-4f735466cecf"

    def __init__(self, browser: str, driver: str, log: Path) -> None:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            self.port = free.getsockname()[1]
        self.proc = subprocess.Popen([driver, f"--port={self.port}"], stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:  # poll its port until it answers
            try:
                if self._call("GET", "/status")["ready"]:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, log.read_text()[-2000:]
            time.sleep(0.1)
        options = {"binary": browser, "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                               "--window-size=1100,760"]}
        capabilities = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
        self.session = self._call("POST", "/session", capabilities)["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def __call__(self, method: str, path: str, body: dict | None = None) -> Any:
        return self._call(method, f"/session/{self.session}{path}", body)

    def element(self, css: str) -> str:
        return self("POST", "/element", {"using": "css selector", "value": css})[self.ELEMENT]

    def script(self, source: str) -> Any:
        return self("POST", "/execute/sync", {"script": source, "args": []})

    def quit(self) -> None:
        try:
            self("DELETE", "")
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def test_chat_page_in_headless_chromium(memorized: Server, tmp_path: Path) -> None:
    """Type a question on the page, see the answer stream in and the reasoning shown apart; screenshot it
    (``LIT_MINIMIND_SCREENSHOT=docs/serve_chat.png`` keeps a copy there)."""
    found = _chromium()
    if found is None:
        pytest.skip("chromium and chromedriver not found (Debian: apt-get install chromium chromium-driver)")
    browser = WebDriver(*found, tmp_path / "chromedriver.log")
    try:
        browser("POST", "/url", {"url": memorized.url + "/"})
        assert browser("GET", "/title") == "lit-minimind chat"
        # count the answer's updates: a streamed answer appears in several pieces, not at once
        browser.script("window.updates = 0; new MutationObserver(() => window.updates++).observe("
                       "document.getElementById('log'), {childList: true, subtree: true, characterData: true});")
        browser("POST", f"/element/{browser.element('#think')}/click", {})
        browser("POST", f"/element/{browser.element('#input')}/value", {"text": SKY[0]["content"]})
        browser("POST", f"/element/{browser.element('#send')}/click", {})
        deadline = time.monotonic() + 60
        while (state := browser.script(
                "const m = document.querySelector('.msg.assistant');"
                "return m && {state: m.dataset.state, answer: m.querySelector('.answer').textContent,"
                "reasoning: m.querySelector('.reasoning-text').textContent,"
                "reasoningShown: !m.querySelector('details.reasoning').hidden, updates: window.updates};")) is None \
                or state["state"] == "streaming":
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        assert state["state"] == "done", state
        assert (state["answer"], state["reasoning"], state["reasoningShown"]) == (SKY_ANSWER, SKY_REASONING, True)
        assert state["updates"] > 4, state  # the user bubble, then reasoning and answer in pieces
        shot = tmp_path / "serve_chat.png"
        shot.write_bytes(base64.b64decode(browser("GET", "/screenshot")))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("LIT_MINIMIND_SCREENSHOT"):
            shutil.copy(shot, ROOT / os.environ["LIT_MINIMIND_SCREENSHOT"])
    finally:
        browser.quit()


# ---------------------------------------------------------------------------------------------- packaging


@pytest.mark.slow
def test_the_wheel_ships_the_chat_page(tmp_path: Path) -> None:
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", "out", "checkpoints", "lightning_logs"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("lit_minimind-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_minimind/conf/default.yaml" in names  # setup.cfg's package data: the page and the configs
    assert "lit_minimind/web/chat.html" in names and "lit_minimind/serve.py" in names and "lit_minimind/cli/serve.py" in names


def test_page_is_package_data_and_loads() -> None:
    page = serve._page().decode()
    assert "<script>" in page and "v1/chat/completions" in page
    assert not re.search(r"""(src|href)=["']https?://""", page)  # no CDN: nothing fetched from elsewhere
