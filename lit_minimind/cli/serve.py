"""``python -m lit_minimind.serve SRC``: an OpenAI-compatible chat server and a chat page for a trained model.

MiniMind's ``scripts/serve_openai_api.py`` on the Python standard library (``http.server``, no FastAPI):

- ``POST /v1/chat/completions``, streamed (server-sent events: ``data: {chunk}`` lines, then
  ``data: [DONE]``) or not; ``temperature``, ``top_p``, ``max_tokens`` (or ``max_completion_tokens``),
  ``stop``, ``seed``, and the extensions ``top_k`` and ``ignore_eos`` (vLLM's names).
- ``open_thinking`` in the body or in ``chat_template_kwargs`` (``enable_thinking`` too): the prompt
  opens the ``<think>`` block and the text up to ``</think>`` is returned as ``reasoning_content``, the
  rest as ``content``.
- ``tools``: rendered by the chat template; ``<tool_call>{json}</tool_call>`` blocks the model writes come
  back as ``tool_calls`` with ``finish_reason: "tool_calls"``, not as content.
- ``GET /v1/models``; ``GET /``: the chat page (``lit_minimind/web/chat.html``).

SRC is anything ``python -m lit_minimind.generate`` loads (the same code loads it): fp16 export,
``*_resume.pth``, Lightning ``.ckpt`` or Hugging Face directory; ``--lora FILE`` adds adapters. The model
runs on the CPU in float32. One model serves every client with continuous batching
(``lit_minimind.cli.serve_engine``): the requests in flight (up to ``--max_batch``, the others wait in the order
they came) are decoded together, one forward per token for all, each joining and leaving between two tokens,
and each gets exactly the tokens it gets alone (greedy or seeded). Work is bounded: open connections
(``--max_connections``, one thread each; more get 503), a read or write that blocks (``--timeout``: an idle
connection, a stream reader that stopped reading is dropped, never holding anyone else), a request's wall-clock
time (``--deadline``). A client that goes away stops its generation within a few tokens; one that only
half-closes its socket still gets its answer. Bad requests get OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``) with a 4xx status, never a traceback. A request is bounded
before any work: its body's size, then its text's bytes against the context, then its tokens; a ``Host`` that is
not a loopback name, an IP address or an allowed name (``--allowed_hosts``) gets 403, a POST that is not JSON 415.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import math
import secrets
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import torch
from tokenizers import Tokenizer

from lit_minimind.cli.generate import load
from lit_minimind.cli.plain import description
from lit_minimind.cli.serve_engine import Engine, Job
from lit_minimind.data.chat_template import load_chat_template, render_chat
from lit_minimind.data.tokenizer import EOS_ID
from lit_minimind.errors import CheckpointError
from lit_minimind.model import MiniMindForCausalLM
from lit_minimind.model.minimind import sample_tokens

__all__ = ["APIError", "ChatRequest", "ReplyParser", "StopFilter", "main", "parse_request", "sample_tokens"]

MAX_BODY = 16 * 1024 * 1024  # bytes of one request body
DEFAULT_MAX_TOKENS = 8192  # MiniMind's ChatRequest default (capped by the room left in the context)
ROLES = {"system", "developer", "user", "assistant", "tool"}  # developer: OpenAI's newer name for system
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
STREAM_BUFFER = 64 * 1024  # bytes of a stream the kernel holds for a client that does not read (then writes block)


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------- requests


@dataclass
class ChatRequest:
    """A validated ``/v1/chat/completions`` body."""

    messages: list[dict[str, Any]]
    stream: bool = False
    temperature: float = 0.7  # MiniMind's defaults
    top_p: float = 0.92
    top_k: int = 0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    open_thinking: bool = False
    seed: int | None = None
    ignore_eos: bool = False
    include_usage: bool = False


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(400, f"'{name}' must be a number, got {json.dumps(value)[:80]}", name, "invalid_type")
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"'{name}' must be in {bound}, got {value}", name, "invalid_value")
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"'{name}' must be an integer, got {json.dumps(value)[:80]}", name, "invalid_type")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {json.dumps(value)[:80]}", name, "invalid_type")
    return value


def _text(content: Any, where: str) -> str | None:
    """A message's content as text: a string, None, or OpenAI's list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return None
    if isinstance(content, str):
        return _utf8(content, where)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise APIError(400, f"{where}.content: only text parts are supported ({{\"type\": \"text\", \"text\": ...}})",
                               where + ".content", "invalid_value")
            parts.append(part["text"])
        return _utf8("".join(parts), where)
    raise APIError(400, f"{where}.content must be a string or a list of text parts", where + ".content", "invalid_type")


def _utf8(text: str, where: str) -> str:
    """``text`` if it can be encoded (JSON's ``\\ud800`` escapes decode to lone surrogates, which cannot)."""
    if text.isascii():  # no surrogate, and no copy of a long text to find out
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{where}.content holds a lone surrogate (an unpaired \\ud800-\\udfff escape)",
                       where + ".content", "invalid_value") from None
    return text


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(400, f"{where} must be an object with 'role' and 'content'", where, "invalid_type")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise APIError(400, f"{where}.role: unknown role {json.dumps(role)[:80]} (one of: {', '.join(sorted(ROLES))})",
                       where + ".role", "invalid_value")
    content = _text(message.get("content"), where)
    tool_calls = message.get("tool_calls")
    if content is None and not (role == "assistant" and tool_calls):
        raise APIError(400, f"{where}.content is missing", where + ".content", "invalid_value")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content or ""}
    if role == "assistant":
        if tool_calls is not None:
            if not isinstance(tool_calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str)
                    and isinstance(c["function"].get("arguments"), (str, dict)) for c in tool_calls):
                raise APIError(400, f"{where}.tool_calls must be a list of {{\"function\": {{\"name\", \"arguments\"}}}}",
                               where + ".tool_calls", "invalid_value")
            out["tool_calls"] = tool_calls
        if isinstance(message.get("reasoning_content"), str):
            out["reasoning_content"] = message["reasoning_content"]
    return out


def parse_request(raw: bytes) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body; raise :class:`APIError` (400) naming the first bad field."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise APIError(400, f"the body is not valid JSON ({err})", None, "invalid_json") from None
    except RecursionError:  # nested deeper than Python's stack
        raise APIError(400, "the body is not valid JSON (nested too deeply)", None, "invalid_json") from None
    except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise APIError(400, f"the body is not valid JSON ({str(err).splitlines()[0]})", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", None, "invalid_json")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    request = ChatRequest(messages=[_message(m, i) for i, m in enumerate(messages)])
    request.stream = _flag(body, "stream")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    request.temperature = request.temperature if temperature is None else temperature
    request.top_p = request.top_p if top_p is None else top_p
    request.top_k = _integer(body, "top_k") or 0
    if request.top_k < 0:
        raise APIError(400, f"'top_k' must be >= 0, got {request.top_k}", "top_k", "invalid_value")
    for name in ("max_tokens", "max_completion_tokens"):
        value = _integer(body, name)
        if value is not None:
            if value < 1:
                raise APIError(400, f"'{name}' must be at least 1, got {value}", name, "invalid_value")
            request.max_tokens = value
    n = _integer(body, "n")
    if n not in (None, 1):
        raise APIError(400, f"'n' must be 1 (one completion per request), got {n}", "n", "invalid_value")
    request.seed = _integer(body, "seed")
    if request.seed is not None and not 0 <= request.seed < 2**63:
        raise APIError(400, f"'seed' must be an integer in [0, 2**63), got {request.seed}", "seed", "invalid_value")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise APIError(400, "'stop' must be a non-empty string or a list of at most 4", "stop", "invalid_value")
    request.stop = stop or []
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise APIError(400, "'tools' must be a list of tool objects", "tools", "invalid_type")
        request.tools = tools if tools and body.get("tool_choice") != "none" else None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise APIError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    kwargs = kwargs or {}
    thinking = [body.get("open_thinking"), kwargs.get("open_thinking"), kwargs.get("enable_thinking")]
    if any(v is not None and not isinstance(v, bool) for v in thinking):
        raise APIError(400, "'open_thinking' must be a boolean", "open_thinking", "invalid_type")
    request.open_thinking = any(v is True for v in thinking)  # MiniMind's get_open_thinking
    request.ignore_eos = _flag(body, "ignore_eos")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    request.include_usage = bool((options or {}).get("include_usage"))
    return request


# ---------------------------------------------------------------------------------------------- generation


class TextStream:
    """Token ids in, new text out, incrementally: only the tokens since the last complete character are decoded
    (decoding all so far at every token grew quadratically: 1.5 s for 4,000 tokens), and text is held back while
    it ends inside a multi-byte character (as transformers' ``TextStreamer``). Byte-level BPE decodes to the
    concatenation of its tokens' bytes, so the pieces add up to the decoding of all the tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.pending = tokenizer, []  # the tokens since the last complete character

    def push(self, token: int) -> str:
        self.pending.append(token)
        text = self.tokenizer.decode(self.pending, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        self.pending = []  # every token so far ends on a character boundary
        return text

    def flush(self) -> str:
        text, self.pending = self.tokenizer.decode(self.pending, skip_special_tokens=True), []
        return text


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of one of ``markers``."""
    for n in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class StopFilter:
    """The text before the first ``stop`` string; what may be the beginning of one is held back."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held, self.stopped = stops, "", False

    def push(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = _partial_suffix(text, self.stops)
        self.held = text[len(text) - keep:]
        return text[: len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class _Channel:
    """One text field (reasoning or content) streamed stripped: leading whitespace dropped, trailing held
    until more text follows, so the concatenated deltas are the field's ``.strip()``."""

    def __init__(self) -> None:
        self.started, self.held = False, ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        core = text.rstrip()
        self.held = text[len(core):]
        return core


class ReplyParser:
    """The generated text split as MiniMind's server splits it, incrementally.

    With ``open_thinking`` the text up to ``</think>`` is reasoning; after it (or from the start) content,
    in which ``<think>...</think>`` is reasoning too and each ``<tool_call>{json}</tool_call>`` with a JSON
    object naming a function is a tool call (a block that is not such JSON stays content). ``push`` and
    ``flush`` return events ``("reasoning", text)``, ``("content", text)``, ``("tool_call", {"name",
    "arguments"})``; text that may be the start of a tag is held back until it is known.
    """

    TAGS = {"reasoning": ["</think>"], "content": ["<tool_call>", "<think>"], "tool": ["</tool_call>"]}

    def __init__(self, open_thinking: bool = False) -> None:
        self.mode = "reasoning" if open_thinking else "content"
        self.pending = ""
        self.block = ""  # the inside of an open <tool_call>
        self.channels = {"reasoning": _Channel(), "content": _Channel()}

    def _text(self, events: list, text: str, mode: str | None = None) -> None:
        mode = mode or self.mode
        if mode == "tool":
            self.block += text
            return
        text = self.channels[mode].push(text)
        if text:
            events.append((mode, text))

    def _close_tool(self, events: list) -> None:
        call = _tool_call(self.block)
        if call is not None:
            events.append(("tool_call", call))
        else:
            self._text(events, f"<tool_call>{self.block}</tool_call>", "content")
        self.block = ""

    def push(self, text: str) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        self.pending += text
        while True:
            tags = self.TAGS[self.mode]
            found = [(i, tag) for tag in tags if (i := self.pending.find(tag)) >= 0]
            if not found:
                keep = _partial_suffix(self.pending, tags)
                self._text(events, self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return events
            i, tag = min(found)
            self._text(events, self.pending[:i])
            self.pending = self.pending[i + len(tag):]
            if tag == "</tool_call>":
                self._close_tool(events)
            self.mode = {"</think>": "content", "<think>": "reasoning", "<tool_call>": "tool", "</tool_call>": "content"}[tag]

    def flush(self) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        self._text(events, self.pending)
        self.pending = ""
        if self.mode == "tool":  # never closed: the text as it was
            self._text(events, "<tool_call>" + self.block, "content")
            self.block, self.mode = "", "content"
        return events


def _tool_call(block: str) -> dict[str, str] | None:
    try:
        call = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return {"name": call["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}


# ---------------------------------------------------------------------------------------------- the server


class ClientGone(Exception):
    """The client closed its connection (or stopped reading): stop generating for it."""


@dataclass
class Served:
    """The model and what a request needs besides it."""

    model: MiniMindForCausalLM
    tokenizer: Tokenizer
    template: str
    name: str
    api_key: str | None = None
    engine: Engine | None = None  # started by make_server when None
    deadline: float = 600.0  # seconds a request may take, from its body read to its last token (--deadline)
    created: int = field(default_factory=lambda: int(time.time()))
    allowed_hosts: frozenset[str] = frozenset()  # Host names answered besides the loopback ones and IP literals
    max_token_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        """At most how many bytes of text one token stands for, for the cheap length bound before a prompt is
        tokenized: its vocabulary's longest entry in UTF-8 (byte-level BPE writes each byte as one character of at
        most 2 bytes: an upper bound)."""
        self.max_token_bytes = max(len(token.encode("utf-8", "surrogatepass")) for token in self.tokenizer.get_vocab())

    @property
    def context(self) -> int:
        return int(self.model.config.max_position_embeddings)


def _page() -> bytes:
    return resources.files("lit_minimind").joinpath("web/chat.html").read_bytes()


class Handler(BaseHTTPRequestHandler):
    server_version = "lit-minimind-serve"
    protocol_version = "HTTP/1.0"  # one request per connection; a stream ends when the connection closes
    timeout = 60  # seconds a read or a write may block (a stalled client is a gone client)
    served: Served  # set on the subclass made by make_server

    # ------------------------------------------------------------------ plumbing

    def log_message(self, format: str, *args: Any) -> None:
        print(f"{self.client_address[0]}:{self.client_address[1]} - {format % args}", file=sys.stderr, flush=True)

    def _send(self, status: int, body: bytes, content_type: str = "application/json", extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any, extra: dict | None = None) -> None:
        self._send(status, json.dumps(obj, ensure_ascii=False).encode(), extra=extra)

    def _error(self, err: APIError) -> None:
        extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        self._json(err.status, err.body(), extra)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, headers, unsupported method) in OpenAI's shape."""
        try:
            self.close_connection = True
            phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "error"
            err = APIError(code, message or phrase, None, phrase.lower().replace(" ", "_"))
            if getattr(self, "command", None) is None:
                self.command = "GET"
            if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":  # an unparsed request line: answer with headers
                self.request_version = "HTTP/1.0"
            self._error(err)
        except OSError:
            pass

    def _authorized(self) -> bool:
        key = self.served.api_key
        if key is None:
            return True
        scheme, _, token = self.headers.get("Authorization", "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _check_host(self) -> None:
        """A browser page on another site reaches this server by DNS rebinding only under a name of that site: a Host
        that is not a loopback name, an IP literal, the ``--host`` name or one of ``--allowed_hosts`` is refused."""
        host = (self.headers.get("Host") or "").strip().lower()
        if not host:
            return  # HTTP/1.0 without Host: not a browser
        name = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
        if name in LOOPBACK_NAMES or name in self.served.allowed_hosts or "*" in self.served.allowed_hosts:
            return
        try:
            ipaddress.ip_address(name)
            return
        except ValueError:
            pass
        raise APIError(403, f"Host {host!r} is not served here (allow it with --allowed_hosts {name})", None,
                       "host_not_allowed")

    def _check_json(self) -> None:
        """A POST's body is JSON and says so: a browser's cross-site "simple" request (text/plain, a form) is refused
        before it runs a generation."""
        kind = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            raise APIError(415, f"Content-Type must be application/json, not {kind or 'missing'!r}", None,
                           "unsupported_media_type")

    def _at_eof(self) -> bool:
        """Whether the client shut its sending side: readable with nothing to read (a half-close, or a close). Only a
        write tells the two apart (a closed socket answers it with a reset), so this alone never stops a request."""
        if self._eof:
            return True
        try:
            poller = select.poll()  # select.select refuses a descriptor >= 1024 (a server holding many connections)
            poller.register(self.connection, select.POLLIN)
            self._eof = bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            self._eof = True
        return self._eof

    def _write(self, data: bytes) -> None:
        """Send ``data`` now; a client that closed, or that reads nothing for ``--timeout`` seconds, is gone."""
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except (OSError, ValueError):  # BrokenPipe, ConnectionReset, a write timeout, a closed file
            raise ClientGone(self._tokens) from None

    def _route(self, method: str) -> None:
        try:
            self._check_host()
            if not self._authorized():
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", None, "invalid_api_key")
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            routes = {("GET", "/"): self._get_page, ("GET", "/v1/models"): self._get_models,
                      ("POST", "/v1/chat/completions"): self._post_chat}
            if (method, path) in routes:
                if method == "POST":
                    self._check_json()
                routes[method, path]()
            elif method == "GET" and path.startswith("/v1/models/"):
                self._get_model(path[len("/v1/models/"):])
            elif any(p == path for _, p in routes):
                raise APIError(405, f"{method} is not allowed on {path}", None, "method_not_allowed")
            else:
                raise APIError(404, f"Invalid URL ({method} {path})", None, "not_found")
        except APIError as err:
            self._drain()
            self._error(err)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError):
            self.close_connection = True
        except Exception:  # a bug: logged here, the client gets a 500 in OpenAI's shape, the server goes on
            traceback.print_exc(file=sys.stderr)
            try:
                self._error(APIError(500, "internal server error (see the server's log)", None, "internal_error",
                                     type="server_error"))
            except OSError:
                pass

    def _expects_continue(self) -> bool:
        return (self.request_version >= "HTTP/1.1"
                and (self.headers.get("Expect") or "").strip().lower() == "100-continue")

    def _drain(self) -> None:
        """Read an unread request body before answering (a client still sending would see a reset); a client waiting
        for ``100 Continue`` has sent none: it gets the answer and the connection closes."""
        if getattr(self, "_body_read", True):
            return
        self._body_read = True
        if self._expects_continue():
            self.close_connection = True
            return
        try:
            length = _byte_count(self.headers.get("Content-Length")) or 0
            if 0 < length <= MAX_BODY:
                self.rfile.read(length)
        except (ValueError, OSError):
            pass

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._body_read = False
        self._route("POST")

    def do_HEAD(self) -> None:
        self._route("GET")

    def do_PUT(self) -> None:
        self._body_read = False
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")

    def do_PATCH(self) -> None:
        self._body_read = False
        self._route("PATCH")

    # ------------------------------------------------------------------ endpoints

    def _get_page(self) -> None:
        self._send(200, _page(), "text/html; charset=utf-8", {"Cache-Control": "no-store"})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.served.name, "object": "model", "created": self.served.created, "owned_by": "lit-minimind",
                "max_model_len": self.served.context}

    def _get_models(self) -> None:
        self._json(200, {"object": "list", "data": [self._model_card()]})

    def _get_model(self, name: str) -> None:
        if name != self.served.name:
            raise APIError(404, f"The model '{name}' does not exist (this server has '{self.served.name}')", "model",
                           "model_not_found")
        self._json(200, self._model_card())

    def _read_body(self) -> bytes:
        self._body_read = True
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise APIError(411, "a Content-Length header is required", None, "length_required")
        length = _byte_count(raw)
        if length is None:
            raise APIError(400, f"bad Content-Length {raw!r}", None, "invalid_request")
        if length > MAX_BODY:
            self.close_connection = True
            raise APIError(413, f"the body is larger than {MAX_BODY} bytes", None, "request_too_large")
        if self._expects_continue():  # curl asks before a body over 1 MB: the checks above passed, so go on
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        body = self.rfile.read(length)
        if len(body) < length:
            raise APIError(400, "the body ended before its Content-Length", None, "invalid_request")
        return body

    def _prompt(self, request: ChatRequest) -> list[int]:
        import jinja2

        self._bound(request)
        try:
            text = render_chat(request.messages, self.served.template, add_generation_prompt=True, tools=request.tools,
                               open_thinking=request.open_thinking)
        except jinja2.exceptions.TemplateError as err:
            raise APIError(400, f"the chat template refused the messages: {err}", "messages", "invalid_value") from None
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate in a field no check above read (a tool's description, ...)
            raise APIError(400, "the request holds a lone surrogate (an unpaired \\ud800-\\udfff escape)", "messages",
                           "invalid_value") from None
        ids = self.served.tokenizer.encode(text).ids
        room = self.served.context - len(ids)
        if request.max_tokens is None:
            request.max_tokens = min(DEFAULT_MAX_TOKENS, room)
        if room < 1 or request.max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.served.context} tokens. However, you "
                                f"requested {len(ids) + max(request.max_tokens, 1)} tokens ({len(ids)} in the messages, "
                                f"{max(request.max_tokens, 1)} in the completion).", "max_tokens", "context_length_exceeded")
        return ids

    def _bound(self, request: ChatRequest) -> None:
        """Refuse, before rendering and tokenizing, messages too long for the context whatever their tokens: no token
        covers more than ``max_token_bytes`` bytes, so more bytes than ``context * max_token_bytes`` cannot fit."""
        size = sum(len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))  # no copy when ASCII
                   for text in (m["content"] for m in request.messages))
        size += len(json.dumps(request.tools)) if request.tools else 0
        limit = self.served.context * self.served.max_token_bytes
        if size > limit:
            raise APIError(400, f"This model's maximum context length is {self.served.context} tokens. However, your "
                                f"messages hold {size} bytes of text, more than that many tokens can (at most "
                                f"{self.served.max_token_bytes} bytes per token).", "messages", "context_length_exceeded")

    def _post_chat(self) -> None:
        self._begun, self._tokens, self._eof, self._opened = time.monotonic(), 0, False, False
        request = parse_request(self._read_body())
        ids = self._prompt(request)
        completion_id = f"chatcmpl-{secrets.token_hex(12)}"
        if request.stream:
            self._stream(request, ids, completion_id)
        else:
            self._complete(request, ids, completion_id)

    def _generate(self, request: ChatRequest, ids: list[int]) -> Iterator[tuple[str, Any]]:
        """Events of the reply (see :class:`ReplyParser`), then ``("finish", reason)`` and ``("usage", n)``, from the
        engine's batch; raises :class:`ClientGone` when the client left, :class:`APIError` (503) when the deadline came
        before the first token."""
        generator = torch.Generator()
        generator.manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        job = Job(ids, request.max_tokens, request.temperature, request.top_p, request.top_k,
                  None if request.ignore_eos else EOS_ID, generator, self._begun + self.served.deadline)
        text, stops, parser = TextStream(self.served.tokenizer), StopFilter(request.stop), ReplyParser(request.open_thinking)
        n = 0
        self.served.engine.submit(job)
        try:
            for token in job.tokens():
                if self._at_eof():  # closed or half-closed: a write tells (a closed socket resets it)
                    self._probe()
                if token is None:
                    if time.monotonic() > job.deadline + 30:  # the engine lost it (a bug): never wait forever
                        raise RuntimeError("the decoding engine did not end a job past its deadline")
                    continue
                n = self._tokens = n + 1
                yield from parser.push(stops.push(text.push(token)))
                if stops.stopped:
                    break
        finally:
            job.cancel()  # a stop string, a client gone, an error: it leaves the batch at the next token
        finish = getattr(job, "finish", "stop")
        if finish == "error":
            raise RuntimeError("the decoding engine failed (see the server's log)")
        if finish == "deadline":
            print(f"{self.client_address[0]}:{self.client_address[1]} - deadline: generation stopped after {n} tokens "
                  f"(--deadline {self.served.deadline:g})", file=sys.stderr, flush=True)
            if n == 0:
                raise APIError(503, f"the server is busy: no token within the request's deadline ({self.served.deadline:g} "
                                    "s, --deadline); try again later", None, "deadline_exceeded", "server_error")
        if not stops.stopped:
            yield from parser.push(stops.push(text.flush()))
        if not stops.stopped:
            yield from parser.push(stops.flush())
        yield from parser.flush()
        yield "finish", "stop" if stops.stopped or finish == "stop" else "length"
        yield "usage", n

    def _probe(self) -> None:
        """Write something harmless, so a closed client's socket resets and the next write fails: an SSE comment in a
        stream; in a plain reply the headers (200) early, then a space (JSON allows it before the body)."""
        if self._stream_chunk is not None:
            self._write(b": \n\n")
            return
        if not self._opened:
            self._opened = True
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            try:
                self.end_headers()
            except OSError:
                raise ClientGone(self._tokens) from None
        self._write(b" ")

    def _complete(self, request: ChatRequest, ids: list[int], completion_id: str) -> None:
        reasoning, content, calls, reason, n = [], [], [], "stop", 0
        self._stream_chunk = None
        try:
            for kind, value in self._generate(request, ids):
                if kind == "reasoning":
                    reasoning.append(value)
                elif kind == "content":
                    content.append(value)
                elif kind == "tool_call":
                    calls.append(value)
                elif kind == "finish":
                    reason = value
                elif kind == "usage":
                    n = value
        except ClientGone as gone:
            self._log_gone(gone)
            return
        except Exception as err:
            if not self._opened:
                raise
            if not isinstance(err, APIError):  # the status (200) is gone: the error as the body
                traceback.print_exc(file=sys.stderr)
                err = APIError(500, "internal server error (see the server's log)", None, "internal_error", "server_error")
            self._write(json.dumps(err.body()).encode())
            self.close_connection = True
            return
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [{"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": call}
                                     for call in calls]
            reason = "tool_calls"
        reply = {
            "id": completion_id, "object": "chat.completion", "created": int(time.time()), "model": self.served.name,
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n},
        }
        if self._opened:  # headers sent early (the client half-closed): the body ends with the connection
            self._write(json.dumps(reply, ensure_ascii=False).encode())
            self.close_connection = True
        else:
            self._json(200, reply)

    def _log_gone(self, gone: ClientGone) -> None:
        self.close_connection = True
        print(f"{self.client_address[0]}:{self.client_address[1]} - client disconnected: generation stopped after {gone.args[0]} tokens",
              file=sys.stderr, flush=True)

    def _stream(self, request: ChatRequest, ids: list[int], completion_id: str) -> None:
        created = int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": self.served.name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

        self._stream_chunk, write, calls = chunk, self._write, 0
        try:  # a small send buffer: a reader that stopped reading is found after STREAM_BUFFER bytes, not megabytes
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER)
        except OSError:
            pass
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            write(chunk({"role": "assistant", "content": ""}))
            try:
                for kind, value in self._generate(request, ids):
                    if kind in ("reasoning", "content"):
                        write(chunk({f"{kind}_content" if kind == "reasoning" else kind: value}))
                    elif kind == "tool_call":
                        write(chunk({"tool_calls": [{"index": calls, "id": f"call_{secrets.token_hex(12)}",
                                                     "type": "function", "function": value}]}))
                        calls += 1
                    elif kind == "finish":
                        write(chunk({}, "tool_calls" if calls else value))
                    elif kind == "usage":
                        n = value
                        if request.include_usage:
                            usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
                            body = {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                                    "model": self.served.name, "choices": [], "usage": usage}
                            write(f"data: {json.dumps(body)}\n\n".encode())
            except ClientGone:
                raise
            except APIError as err:  # headers are gone: the error as one more event
                write(f"data: {json.dumps(err.body())}\n\n".encode())
            except Exception:  # headers are gone: the error as one more event, as MiniMind's server does
                traceback.print_exc(file=sys.stderr)
                err = APIError(500, "internal server error (see the server's log)", None, "internal_error", "server_error")
                write(f"data: {json.dumps(err.body())}\n\n".encode())
            write(b"data: [DONE]\n\n")
        except ClientGone as gone:
            self._log_gone(gone)
        self.close_connection = True


def _byte_count(header: str | None) -> int | None:
    """A Content-Length header's value: plain ASCII digits only (``int()`` would take "6_6", "+66", " 66 "), else None."""
    return int(header) if header is not None and header.isascii() and header.isdigit() else None


class BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them: one more is answered 503 at once and closed
    (each thread waits at most ``--timeout`` seconds on a read or a write, so idle connections leave)."""

    daemon_threads = True
    request_queue_size = 128
    max_connections = 2048

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open_connections, self._count = 0, threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count:
            full = self.open_connections >= self.max_connections
            self.open_connections += not full
        if not full:
            super().process_request(request, client_address)
            return
        body = json.dumps(APIError(503, f"the server holds its maximum of {self.max_connections} connections "
                                        "(--max_connections); try again later", None, "too_many_connections",
                                   "server_error").body()).encode()
        try:
            request.settimeout(1)
            request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.open_connections -= 1


def make_server(served: Served, host: str = "127.0.0.1", port: int = 8998, max_connections: int = 2048,
                timeout: float = 60.0) -> BoundedServer:
    """The server, its decoding engine started (a ``Served`` without one gets one of ``max_batch`` 16)."""
    if served.engine is None:
        served.engine = Engine(served.model)
    if not served.engine.thread.is_alive():
        served.engine.start()
    handler = type("ServedHandler", (Handler,), {"served": served, "timeout": timeout})
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # --host ::1, an IPv6 address
    server_class = type("Server", (BoundedServer,), {"address_family": family, "max_connections": max_connections})
    return server_class((host, port), handler)


def _open_files(wanted: int) -> None:
    """Raise this process's soft limit of open files to ``wanted`` (as far as the hard limit allows): each connection
    is one (the usual soft limit, 1024, would refuse connections long before ``--max_connections``)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
    except (ImportError, ValueError, OSError):
        pass


def _model_name(src: str) -> str:
    path = Path(src)
    return path.name if path.is_dir() else path.stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.serve", description=description(__doc__))
    parser.add_argument("weights", metavar="SRC",
                        help="fp16 export, *_resume.pth, Lightning .ckpt or Hugging Face directory (what generate loads)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8998, help="port (default 8998, MiniMind's; 0: any free port)")
    parser.add_argument("--api_key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every request (else 401)")
    parser.add_argument("--lora", default=None, metavar="FILE", help="LoRA adapters to apply to the weights (not merged)")
    parser.add_argument("--tokenizer_path", default=None,
                        help="directory with tokenizer.json (default: a Hugging Face directory's own, else the embedded one)")
    parser.add_argument("--name", default=None, help="the model's id in /v1/models and replies (default: SRC's name)")
    parser.add_argument("--allowed_hosts", default="", metavar="NAMES",
                        help="comma-separated Host names answered besides localhost, IP addresses and --host (a browser "
                             "page elsewhere could reach the server under any other name: DNS rebinding); '*': any")
    parser.add_argument("--max_batch", type=int, default=16, metavar="N",
                        help="requests decoded together, one forward per token for all (default 16); more wait in "
                             "the order they came")
    parser.add_argument("--max_connections", type=int, default=2048, metavar="N",
                        help="open connections, one thread each (default 2048); one more is answered 503 at once")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a read or a write blocking longer drops the client: an idle connection, a stream "
                             "reader that stopped reading (default 60)")
    parser.add_argument("--deadline", type=float, default=600.0, metavar="SECONDS",
                        help="a request's wall-clock limit, waiting included: its generation stops there "
                             "(finish_reason 'length'; 503 if no token came yet) (default 600)")
    parser.add_argument("--threads", type=int, default=1, metavar="N",
                        help="torch's threads for the model (default 1: the server's own threads share the cores; "
                             "more pays only for a large model on many cores)")
    args = parser.parse_args(argv)
    for flag in ("max_batch", "max_connections", "timeout", "deadline", "threads"):
        if not getattr(args, flag) > 0:
            print(f"error: --{flag} must be positive, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    if not args.host.strip():
        print("error: --host '': give an address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)",
              file=sys.stderr)
        return 2
    try:
        model, tokenizer, tokenizer_dir = load(args.weights, args.lora, args.tokenizer_path)
        template = load_chat_template(tokenizer_dir)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    allowed = frozenset(n.strip().lower() for n in [*args.allowed_hosts.split(","), args.host] if n.strip())
    torch.set_num_threads(args.threads)
    model = model.float().eval()
    served = Served(model, tokenizer, template, args.name or _model_name(args.weights), args.api_key,
                    engine=Engine(model, args.max_batch), deadline=args.deadline, allowed_hosts=allowed)
    _open_files(args.max_connections + 64)
    try:
        server = make_server(served, args.host, args.port, args.max_connections, args.timeout)
    except OSError as err:
        print(f"error: cannot listen on {args.host}:{args.port}: {err.strerror or err}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    if ":" in host:
        host = f"[{host}]"  # a URL's IPv6 address
    if args.host not in LOOPBACK_NAMES:
        print(f"warning: listening on {args.host}: reachable from other machines"
              + ("" if args.api_key else ", with no API key (--api_key)"), file=sys.stderr, flush=True)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"lit-minimind serve: {served.name} ({params:.2f}M parameters, float32 on cpu, batches of up to "
          f"{args.max_batch}), "
          f"listening on http://{host}:{port} (chat page: /, API: /v1)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
