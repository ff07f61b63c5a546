"""``python -m lit_minimind.eval_toolcall``: greedy tool-use rollouts scored, on a local model file and through
``python -m lit_minimind.serve`` (a real server subprocess on a free port), which must give the same transcripts
and scores; the score table's counting on replies whose calls are known."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from lit_minimind.cli import eval_toolcall as et
from lit_minimind.data.agent import EMBEDDED_AGENT_DATA
from lit_minimind.model.agent import TOOL_ERROR
from tests.helpers.runs import MINIMIND, ROOT, cli_env, need_shared

pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[dev]')")

TOKENIZER = MINIMIND / "tokenizer"
MEMORIZED = ROOT / "tests" / "fixtures" / "serve" / "memorized_64.pth"  # answers PARIS with a get_weather call
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
         "expect": ["get_weather"], "gt": ["Paris"]}
LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """``python -m lit_minimind.serve`` of the memorized model on port 0; its API's URL."""
    need_shared()
    proc = subprocess.Popen([sys.executable, "-m", "lit_minimind.serve", str(MEMORIZED), "--tokenizer_path", str(TOKENIZER),
                             "--port", "0"], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        match = LISTENING.search(proc.stdout.readline())
        assert match, "the server printed no listening line"
        yield f"http://{match.group(1)}:{match.group(2)}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run_cli(tmp_path: Path, name: str, *args: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "lit_minimind.eval_toolcall", *args, "--max_new_tokens", "24",
                           "--output", str(out)], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "💬: 帮我算一下 256 乘以 37 等于多少" in done.stdout or "--data" in args
    assert re.search(r"^\s+all(\s+(\d\.\d\d|-)){5}$", done.stdout, re.M), done.stdout[-1500:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.parametrize("data", [None, str(EMBEDDED_AGENT_DATA)], ids=["minimind_cases", "agent_rl_jsonl"])
def test_local_file_and_server_give_the_same_transcripts_and_scores(server: str, tmp_path: Path, data: str | None) -> None:
    extra = ["--data", data] if data else []
    local, local_out = run_cli(tmp_path, "local", str(MEMORIZED), "--tokenizer_path", str(TOKENIZER), *extra)
    served, served_out = run_cli(tmp_path, "served", "--base_url", server, "--api_key", "none", *extra)
    assert len(local["cases"]) == (24 if data else 8)
    assert served == local and served_out == local_out
    assert local["scores"]["expected"] is None or data is None
    assert all(t["content"] or t["tool_calls"] for case in local["cases"] for t in case["transcript"])


def test_a_tool_call_is_run_and_counted_the_same_local_and_served(server: str) -> None:
    """The memorized model calls get_weather (offered, JSON arguments, the expected tool) in its first reply; the
    project has no such tool, so the result is MiniMind's error text, and the rollout goes on to --max_turns."""
    local_log, served_log = io.StringIO(), io.StringIO()
    local = et.run_case(et.local_chat(str(MEMORIZED), 64, str(TOKENIZER)), PARIS, 2, local_log)
    served = et.run_case(et.server_chat(server, "none", "m", 64), PARIS, 2, served_log)
    assert served == local and served_log.getvalue() == local_log.getvalue()
    first = local["transcript"][0]
    assert first["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert ("📦 可用工具: ['get_weather']\n\n💬: What is the weather in Paris?\n🧠: \n"
            f'📞 [Tool Calling]: get_weather | args={{"city": "Paris"}}\n✅ [Tool Called]: {TOOL_ERROR}\n🧠: ') in local_log.getvalue()
    scores = et.shares([local])
    assert local["calls"] >= 1 and scores["known"] == 1.0 and scores["expected"] == 1.0
    assert scores["well-formed"] == local["well_formed"] / local["turns"] and local["well_formed"] >= 1
    assert scores["gt calls"] == 0.0  # get_weather is not one of the project's tools: never a valid call


def test_scores_count_what_they_say() -> None:
    """shares() over hand-made rows: turns, calls, expected tools, gt."""
    def chat_of(replies: list[dict[str, Any]]) -> et.Chat:
        it = iter(replies)
        return lambda messages, tools: next(it)

    call = {"name": "calculate_math", "arguments": '{"expression": "256*37"}'}
    case = et.minimind_cases()[0]
    good = et.run_case(chat_of([{"content": "", "reasoning": "", "tool_calls": [call]},
                                {"content": "256 乘以 37 等于 9472。", "reasoning": "", "tool_calls": []}]), case, 3, io.StringIO())
    assert good["transcript"][1]["content"].endswith("9472。") and good["final"].endswith("9472。")
    bad = et.run_case(chat_of([{"content": "<tool_call>{oops</tool_call>", "reasoning": "",
                                "tool_calls": [{"name": "get_current_time", "arguments": "[1]"}]}] * 3), case, 3, io.StringIO())
    assert et.shares([good]) == {"well-formed": 0.5, "known": 1.0, "expected": 1.0, "gt calls": 1.0, "answer gt": 1.0}
    assert et.shares([bad]) == {"well-formed": 0.0, "known": 0.0, "expected": 0.0, "gt calls": 0.0, "answer gt": 0.0}
    assert et.shares([good, bad])["well-formed"] == 1 / 5
    assert bad["final"] == "" and bad["turns"] == 3


def test_bad_arguments_get_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": [{"role": "user", "content": "hi"}]}\n')
    for args, expected in [([str(MEMORIZED), "--data", str(bad)], "no \"gt\""), ([], "give MODEL or --base_url"),
                           ([str(MEMORIZED), "--max_turns", "0"], "--max_turns must be at least 1"),
                           ([str(tmp_path / "none.pth")], "none.pth")]:
        done = subprocess.run([sys.executable, "-m", "lit_minimind.eval_toolcall", *args], cwd=ROOT, env=cli_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
