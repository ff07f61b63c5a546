"""Agent RL's tools, tool calls and reward (lit_minimind.model.agent) against MiniMind's own functions.

tests/fixtures/agent/tools.json holds what MiniMind's train_agent.py (d65ef2c) returns for the same inputs
(its generator make_minimind_agent_tools.py is beside it). Hostile expressions run on the port only."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from lit_minimind.model import agent
from lit_minimind.model.agent import (
    TOOL_ERROR,
    UnsafeExpression,
    agent_reward,
    parse_tool_calls,
    run_tool,
    safe_eval,
    scorer_of,
    tool_result,
    validate_gt_in_text,
)

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "agent" / "tools.json").read_text(encoding="utf-8"))


class LengthScorer:
    """The generator's stand-in reward model (make_minimind_agent_tools.LengthScorer)."""

    def get_score(self, messages, answer):
        return (sum(len(m["content"]) * (i + 1) for i, m in enumerate(messages)) % 13) / 5 - len(answer) % 7 / 3


def test_tools_are_minimind_s():
    assert agent.TOOLS == FIXTURE["tools"]


@pytest.mark.parametrize("name, args, expected", FIXTURE["tool_results"],
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(FIXTURE["tool_results"])])
def test_tool_turn_text_is_minimind_s(name, args, expected):
    refused = name == "calculate_math" and isinstance(args, dict) and args.get("expression") in FIXTURE["refused"]
    assert tool_result(name, args) == (TOOL_ERROR if refused else expected)


def test_refused_expressions_are_ones_minimind_computes():
    """The refusals are a real difference (MiniMind's eval computes them), each one not arithmetic."""
    by_expression = {a.get("expression"): text for n, a, text in FIXTURE["tool_results"] if n == "calculate_math"}
    assert all(by_expression[e] != TOOL_ERROR for e in FIXTURE["refused"] if e != "math.sqrt(x=4)")
    for expression in FIXTURE["refused"]:
        with pytest.raises((UnsafeExpression, SyntaxError)):
            safe_eval(expression)


HOSTILE = [
    "__import__('os').system('touch /tmp/agent_pwned')", "().__class__.__bases__[0].__subclasses__()",
    "math.__loader__", "math.__dict__['sqrt'](4)", "open('/etc/passwd').read()", "globals()", "(lambda: 1)()",
    "[c for c in ().__class__.__base__.__subclasses__()]", "9**9**9", "2**10**8", "10**(10**6)", "1<<(1<<40)",
    "math.factorial(10**6)", "math.comb(10**7, 5000)", "math.perm(100000, 50000)", "'a'*10**9", "(1,)*10**9",
    "[1]*10**9", "9**99999", "-" * 5000 + "1", "(" * 300 + "1" + ")" * 300, "1+" * 5000 + "1", "x" * 100_000,
    "1" * 200_000, "f'{1}'", "math.sqrt.__self__", "type(1)", "(2).bit_length()", "breakpoint()",
    "math.lcm(" + ",".join(["2**65000-1"] * 200) + ")", "math.gcd(" + ",".join(["3**41000"] * 200) + ")",
]


@pytest.mark.parametrize("expression", HOSTILE)
def test_hostile_expression_is_a_scored_failure(expression, tmp_path):
    started = time.monotonic()
    assert tool_result("calculate_math", {"expression": expression}) == TOOL_ERROR
    assert time.monotonic() - started < agent.TOOL_TIMEOUT + 0.5
    assert not Path("/tmp/agent_pwned").exists()


def test_power_chain_is_refused_before_it_is_computed():
    started = time.monotonic()
    with pytest.raises(UnsafeExpression, match="power"):
        safe_eval("9**9**9")
    assert time.monotonic() - started < 0.1
    assert safe_eval("2**2**2**2") == 65536  # small towers stay computed


def test_a_hanging_tool_ends_at_its_deadline(monkeypatch):
    release = threading.Event()
    monkeypatch.setitem(agent.TOOL_FUNCTIONS, "get_current_time", lambda args: release.wait(30))
    started = time.monotonic()
    assert tool_result("get_current_time", {}, timeout=0.2) == TOOL_ERROR
    assert time.monotonic() - started < 1.0
    release.set()


@pytest.mark.parametrize("call", [[1, 2], "s", 3, None, {"name": ["x"]}, {"name": {"a": 1}, "arguments": {}},
                                  {"arguments": {"expression": "1"}}])
def test_bad_calls_are_unknown_or_failed_tools(call):
    name, args = agent.call_name_args(call)
    assert tool_result(name, args) == TOOL_ERROR
    assert not agent.valid_call(call, set(agent.TOOL_NAMES))


def test_arguments_that_are_not_json_are_none():
    """MiniMind: arguments given as a string that is not JSON are {} (calculate_math then computes "0"),
    and the call is not valid (no expression)."""
    call = {"name": "calculate_math", "arguments": "[1"}
    assert agent.call_name_args(call) == ("calculate_math", {})
    assert tool_result(*agent.call_name_args(call)) == '{"result": "0"}'
    assert not agent.valid_call(call, set(agent.TOOL_NAMES))
    assert not agent.valid_call({"name": "calculate_math", "arguments": {"expression": "1"}}, {"get_current_time"})


@pytest.mark.parametrize("text, calls", FIXTURE["parse"], ids=range(len(FIXTURE["parse"])))
def test_parse_tool_calls_is_minimind_s(text, calls):
    assert parse_tool_calls(text) == calls


@pytest.mark.parametrize("text, gt, found", FIXTURE["gt"], ids=range(len(FIXTURE["gt"])))
def test_gt_found_is_minimind_s(text, gt, found):
    assert sorted(map(str, validate_gt_in_text(text, gt))) == found


def test_rewards_are_minimind_s():
    prompt = FIXTURE["scorer_prompt"]
    assert len(FIXTURE["rewards"]) == 200
    seen = set()
    for turns, unfinished, gt, scored, expected in FIXTURE["rewards"]:
        score = scorer_of(LengthScorer() if scored else None, prompt)
        value = agent_reward(turns[-1], turns, unfinished, agent.TOOLS, gt, score)
        assert torch.tensor(value, dtype=torch.float32).item() == expected, (turns, unfinished, gt, scored)
        seen.add(expected)
    assert len(seen) > 20  # the cases reach many different rewards


def test_run_tool_unknown_and_non_string_names():
    assert run_tool("rm_rf", {}) is None
    assert run_tool(["calculate_math"], {"expression": "1"}) is None
    assert run_tool("calculate_math", {"expression": "6*7"}) == {"result": "42"}


def test_any_json_arguments_give_text_never_an_exception():
    """Random JSON values as a call's name and arguments, for every tool: always a tool turn's text."""
    import random

    rng = random.Random(0)
    leaves = [None, True, 0, -1, 1e308, float("inf"), "", "北京", "km", "1e400", "9**9**9", "x" * 3000, "USD"]

    def value(depth: int = 0):
        kind = rng.random()
        if depth < 3 and kind < 0.2:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if depth < 3 and kind < 0.5:
            keys = ["expression", "value", "from_unit", "to_unit", "location", "timezone", "from_currency",
                    "to_currency", "text", "target_language", "other"]
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}
        return rng.choice(leaves)

    names = list(agent.TOOL_NAMES) + ["", "nope"]
    for _ in range(400):
        call = {"name": rng.choice(names), "arguments": value()} if rng.random() < 0.9 else value()
        name, args = agent.call_name_args(call)
        text = tool_result(name, args)
        assert isinstance(text, str) and 0 < len(text) <= 2048
        agent.valid_call(call, set(agent.TOOL_NAMES))  # never raises
