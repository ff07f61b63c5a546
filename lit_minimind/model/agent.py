"""MiniMind's agent tool-use RL (``trainer/train_agent.py``): its six tools, tool calls, and its reward.

The tools answer from MiniMind's fixed tables (mock results), as its ``MOCK_RESULTS`` do; ``calculate_math``
is the one that computes. MiniMind's ``eval``\\ s what the model wrote; here :func:`safe_eval` evaluates the
same expression on its syntax tree with only arithmetic allowed (module docstring of :func:`safe_eval`), so
every arithmetic expression gives MiniMind's text and anything else (a name, an attribute but ``math.X``, a
string, a call but a whitelisted ``math`` function, a result too large to print) is refused: the tool fails,
``{"error": "tool not found"}`` as MiniMind's failed tools. Every tool call runs under a deadline
(:data:`TOOL_TIMEOUT`, MiniMind's ``signal.alarm(1)``), in a worker thread so that it bounds any thread.

A tool call is the JSON inside ``<tool_call>...</tool_call>`` (:func:`parse_tool_calls`: what is not JSON is
skipped, as MiniMind's). MiniMind crashes on a call that is JSON but not an object, or whose name cannot be
a dict key; here such a call is an unknown tool (a failed call, scored as one).

The reward (:func:`agent_reward`, MiniMind's ``calculate_rewards``), per completion, over its turns' answers
(each turn's text after ``</think>``): ``-0.5`` per unbalanced ``<tool_call>`` tag in each turn; then

* without a tool call: length 5-800 characters ``+0.5`` else ``-0.5``; with ``</think>``: thinking 20-300
  characters ``+1`` else ``-0.5``, exactly one ``</think>`` ``+0.25`` else ``-0.25``; the reward model's score
  of the answer; minus the repetition penalty of the answer;
* with tool calls: ``+0.5`` when the valid calls (a tool offered, its arguments present) number ``len(gt)``
  and none is invalid, else ``-0.5`` per call of difference; ``+2.5 * share of gt found`` in the final text
  (after the last ``</tool_call>``; numbers compared to 1e-6); ``-0.5`` when the turns ran out with a tool
  call pending (no final text); minus the repetition penalty of the final text;

clipped to [-3, 3].
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from lit_minimind.model.grpo import THINK_END, prompt_messages, rep_penalty

__all__ = ["TOOLS", "TOOL_NAMES", "TOOL_TIMEOUT", "TOOL_ERROR", "MAX_TURNS", "UnsafeExpression", "safe_eval",
           "calculate_math", "run_tool", "execute_tool", "tool_result", "parse_tool_calls", "call_name_args",
           "valid_call", "validate_gt_in_text", "agent_reward", "Trajectory", "rollout_one", "rollout_batch",
           "sampled_log_probs", "trajectory_rewards", "pack", "token_log_probs", "agent_loss"]

MAX_TURNS = 3  # train_agent.py's rollout: up to three generations per sample
TOOL_TIMEOUT = 1.0  # seconds, MiniMind's signal.alarm(1)
TOOL_ERROR = '{"error": "tool not found"}'  # MiniMind's text for a failed or unknown tool
RESULT_CHARS = 2048  # MiniMind cuts a tool's JSON result to this many characters

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "calculate_math", "description": "计算数学表达式", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "unit_converter", "description": "单位换算", "parameters": {
        "type": "object", "properties": {"value": {"type": "number"}, "from_unit": {"type": "string"},
                                         "to_unit": {"type": "string"}}, "required": ["value", "from_unit", "to_unit"]}}},
    {"type": "function", "function": {"name": "get_current_weather", "description": "获取天气", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}},
    {"type": "function", "function": {"name": "get_current_time", "description": "获取时间", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string", "default": "Asia/Shanghai"}}, "required": []}}},
    {"type": "function", "function": {"name": "get_exchange_rate", "description": "查询汇率", "parameters": {
        "type": "object", "properties": {"from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
        "required": ["from_currency", "to_currency"]}}},
    {"type": "function", "function": {"name": "translate_text", "description": "翻译文本", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}, "target_language": {"type": "string"}},
        "required": ["text", "target_language"]}}},
]
TOOL_NAMES = tuple(t["function"]["name"] for t in TOOLS)

# MiniMind's mock data
WEATHER = {"北京": ("28°C", "晴"), "上海": ("15°C", "多云"), "广州": ("32°C", "闷热"), "深圳": ("30°C", "晴"),
           "杭州": ("22°C", "阴"), "成都": ("18°C", "小雨"), "武汉": ("25°C", "多云"), "南京": ("20°C", "晴"),
           "西安": ("16°C", "大风"), "重庆": ("26°C", "阴"), "Tokyo": ("12°C", "晴"), "New York": ("8°C", "多云"),
           "London": ("5°C", "小雨"), "Paris": ("10°C", "阴"), "Sydney": ("25°C", "晴朗")}
TIMES = {"Asia/Shanghai": "2025-03-07 14:30:00", "America/New_York": "2025-03-07 01:30:00",
         "Europe/London": "2025-03-07 06:30:00", "Asia/Tokyo": "2025-03-07 15:30:00",
         "Europe/Paris": "2025-03-07 07:30:00", "Australia/Sydney": "2025-03-07 17:30:00"}
RATES = {("USD", "CNY"): 7.21, ("EUR", "CNY"): 7.85, ("GBP", "CNY"): 9.12, ("JPY", "CNY"): 0.048,
         ("USD", "EUR"): 0.92, ("USD", "GBP"): 0.79, ("CNY", "JPY"): 20.83, ("AUD", "CNY"): 4.72}
TRANSLATIONS = {("你好世界", "english"): "Hello World", ("Good morning", "chinese"): "早上好",
                ("今天天气真好", "english"): "The weather is nice today", ("I love programming", "chinese"): "我喜欢编程",
                ("机器学习很有趣", "english"): "Machine learning is interesting", ("Happy birthday", "chinese"): "生日快乐"}
UNITS = {"km_miles": 0.621371, "miles_km": 1.60934, "kg_pounds": 2.20462, "pounds_kg": 0.453592,
         "meters_feet": 3.28084, "feet_meters": 0.3048, "celsius_fahrenheit": 1.8, "fahrenheit_celsius": 0.5556}


# ----------------------------------------------------------------- the safe calculator
class UnsafeExpression(ValueError):
    """An expression :func:`safe_eval` refuses: not arithmetic, or too large or slow to compute."""


MAX_EXPRESSION_CHARS = 10_000
MAX_NODES = 2_000
MAX_DEPTH = 200  # the evaluation recurses once per level (a sum of n terms is n deep)
MAX_INT_BITS = 1 << 16  # ~19,700 digits: past Python's 4,300-digit str limit, so MiniMind's str() failed too
MAX_FACTORIAL = 5_000  # factorial / comb / perm arguments (5000! has ~54,000 bits)
EVAL_SECONDS = 0.5

# MiniMind's textual replacements before eval
REPLACEMENTS = (("^", "**"), ("×", "*"), ("÷", "/"), ("−", "-"), ("（", "("), ("）", ")"))

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
          ast.RShift: operator.rshift, ast.BitAnd: operator.and_, ast.BitOr: operator.or_, ast.BitXor: operator.xor}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert, ast.Not: operator.not_}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
           ast.GtE: operator.ge}
MATH_CONSTANTS = ("pi", "e", "tau", "inf", "nan")
MATH_FUNCTIONS = ("acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "comb", "copysign", "cos",
                  "cosh", "degrees", "erf", "erfc", "exp", "exp2", "expm1", "fabs", "factorial", "floor", "fmod", "gamma",
                  "gcd", "hypot", "isclose", "isfinite", "isinf", "isnan", "isqrt", "lcm", "ldexp", "lgamma", "log",
                  "log10", "log1p", "log2", "nextafter", "perm", "pow", "radians", "remainder", "sin", "sinh", "sqrt",
                  "tan", "tanh", "trunc", "ulp")
BIG_ARGUMENT = ("factorial", "comb", "perm")
NUMBER = (int, float, complex)  # bool is an int


def _bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_size(value: Any) -> Any:
    if _bits(value) > MAX_INT_BITS:
        raise UnsafeExpression(f"an integer of more than {MAX_INT_BITS} bits")
    return value


def _binary(op: type, left: Any, right: Any) -> Any:
    if not isinstance(left, NUMBER) or not isinstance(right, NUMBER):
        raise UnsafeExpression("arithmetic on something that is not a number")
    if op is ast.Pow and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * math.log2(abs(left)) > MAX_INT_BITS:
            raise UnsafeExpression(f"a power of more than {MAX_INT_BITS} bits")
    if op is ast.LShift and isinstance(right, int) and right > MAX_INT_BITS:
        raise UnsafeExpression(f"a shift of more than {MAX_INT_BITS} bits")
    return _check_size(BINARY[op](left, right))


def _call(name: str, args: list[Any]) -> Any:
    if any(not isinstance(a, NUMBER) for a in args):
        raise UnsafeExpression(f"math.{name} of something that is not a number")
    if name in BIG_ARGUMENT and any(_bits(a) > 0 and abs(a) > MAX_FACTORIAL for a in args if isinstance(a, int)):
        raise UnsafeExpression(f"math.{name} of an argument over {MAX_FACTORIAL}")
    if sum(_bits(a) for a in args) > 2 * MAX_INT_BITS:  # lcm / gcd of many big integers: one long C call
        raise UnsafeExpression(f"math.{name} of integers of more than {2 * MAX_INT_BITS} bits together")
    return _check_size(getattr(math, name)(*args))


def safe_eval(expression: str, deadline: float | None = None) -> Any:
    """The value of an arithmetic ``expression`` as Python's ``eval`` gives it, or :class:`UnsafeExpression`.

    Allowed: number literals (and ``True``, ``False``, ``None``), ``+ - * / // % ** << >> & | ^ ~``, unary ``+ - not``,
    comparisons, parentheses, tuples, ``math.<constant>`` and ``math.<function>(numbers)`` of the whitelisted
    scalar functions (no keywords, no ``*args``). Bounded: the source's length, the tree's size, every
    integer's size (a power, shift, factorial, comb or perm that would pass it is refused before it is
    computed) and the time (``deadline``, a ``time.monotonic()`` value, checked at every node). Python's own
    errors (division by zero, a math domain error, an overflow) propagate as from ``eval``.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"an expression of more than {MAX_EXPRESSION_CHARS} characters")
    tree = ast.parse(expression.lstrip(" \t"), mode="eval")  # eval strips leading spaces and tabs
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise UnsafeExpression(f"an expression of more than {MAX_NODES} nodes")
    if _depth(tree) > MAX_DEPTH:
        raise UnsafeExpression(f"an expression nested more than {MAX_DEPTH} deep")
    deadline = time.monotonic() + EVAL_SECONDS if deadline is None else deadline

    def value(node: ast.AST) -> Any:
        if time.monotonic() > deadline:
            raise UnsafeExpression("the expression took too long")
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, NUMBER)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return _binary(type(node.op), value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            operand = value(node.operand)
            if not isinstance(operand, NUMBER):
                raise UnsafeExpression("a unary operator on something that is not a number")
            return UNARY[type(node.op)](operand)
        if isinstance(node, ast.Compare) and all(type(op) in COMPARE for op in node.ops):
            left, result = value(node.left), True
            for op, right_node in zip(node.ops, node.comparators):
                right = value(right_node)
                if not isinstance(left, NUMBER) or not isinstance(right, NUMBER):
                    raise UnsafeExpression("a comparison of something that is not a number")
                result = COMPARE[type(op)](left, right)
                if not result:
                    return result
                left = right
            return result
        if isinstance(node, ast.Tuple) and isinstance(node.ctx, ast.Load):
            return tuple(value(element) for element in node.elts)
        if _is_math(node, MATH_CONSTANTS):
            return getattr(math, node.attr)
        if (isinstance(node, ast.Call) and _is_math(node.func, MATH_FUNCTIONS) and not node.keywords
                and not any(isinstance(a, ast.Starred) for a in node.args) and hasattr(math, node.func.attr)):
            return _call(node.func.attr, [value(a) for a in node.args])
        raise UnsafeExpression(f"not arithmetic: {type(node).__name__}")

    return value(tree)


def _depth(tree: ast.AST) -> int:
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _is_math(node: ast.AST, names: tuple[str, ...]) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math"
            and node.attr in names and isinstance(node.ctx, ast.Load))


def calculate_math(args: dict[str, Any]) -> dict[str, str]:
    """MiniMind's ``calculate_math`` tool, its ``eval`` replaced by :func:`safe_eval`."""
    expression = str(args.get("expression", "0"))
    for old, new in REPLACEMENTS:
        expression = expression.replace(old, new)
    return {"result": str(safe_eval(expression))}


# ----------------------------------------------------------------- the other tools (MiniMind's mock results)
def unit_converter(args: dict[str, Any]) -> dict[str, Any]:
    key = f"{args.get('from_unit', '').lower()}_{args.get('to_unit', '').lower()}"
    return {"result": round(float(args.get("value", 0)) * UNITS.get(key, 1), 4)}


def get_current_weather(args: dict[str, Any]) -> dict[str, Any]:
    temperature, condition = WEATHER.get(args.get("location"), ("22°C", "晴"))
    return {"city": args.get("location"), "temperature": temperature, "humidity": "65%", "condition": condition}


def get_current_time(args: dict[str, Any]) -> dict[str, Any]:
    zone = args.get("timezone", "Asia/Shanghai")
    return {"datetime": TIMES.get(zone, "2025-03-07 14:30:00"), "timezone": zone}


def get_exchange_rate(args: dict[str, Any]) -> dict[str, Any]:
    pair = (args.get("from_currency"), args.get("to_currency"))
    return {"from": pair[0], "to": pair[1], "rate": RATES.get(pair, 1.0)}


def translate_text(args: dict[str, Any]) -> dict[str, Any]:
    return {"translated_text": TRANSLATIONS.get((args.get("text"), args.get("target_language")), args.get("text", ""))}


TOOL_FUNCTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "calculate_math": calculate_math, "unit_converter": unit_converter, "get_current_weather": get_current_weather,
    "get_current_time": get_current_time, "get_exchange_rate": get_exchange_rate, "translate_text": translate_text}

# MiniMind's argument checks (CHECK_ARGS): what makes a call valid
CHECK_ARGS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "calculate_math": lambda a: bool(a.get("expression")),
    "unit_converter": lambda a: a.get("value") is not None and a.get("from_unit") and a.get("to_unit"),
    "get_current_weather": lambda a: bool(a.get("location")),
    "get_current_time": lambda a: True,
    "get_exchange_rate": lambda a: bool(a.get("from_currency")) and bool(a.get("to_currency")),
    "translate_text": lambda a: bool(a.get("text")) and bool(a.get("target_language")),
}


def run_tool(name: Any, args: Any, timeout: float = TOOL_TIMEOUT) -> dict[str, Any] | None:
    """MiniMind's ``execute_tool``: the tool's result, or None for an unknown tool, a failure or a timeout.

    The tool runs in a daemon thread joined for ``timeout`` seconds (MiniMind's ``alarm(1)``, which only the
    main thread can set and which a long C computation outlives); the calculator also stops itself at its
    deadline, so none is left running."""
    function = TOOL_FUNCTIONS.get(name) if isinstance(name, str) else None
    if function is None:
        return None
    outcome: list[Any] = []

    def work() -> None:
        try:
            outcome.append(function(args))
        except Exception:  # MiniMind's bare except: any failure is a failed tool
            outcome.append(None)

    worker = threading.Thread(target=work, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    return outcome[0] if outcome else None


def tool_result(name: Any, args: Any, timeout: float = TOOL_TIMEOUT) -> str:
    """The ``tool`` turn's text: the result's JSON (cut to 2,048 characters), or MiniMind's error text."""
    result = run_tool(name, args, timeout)
    try:
        text = json.dumps(result, ensure_ascii=False) if result else TOOL_ERROR
    except (TypeError, ValueError):
        text = TOOL_ERROR
    return text[:RESULT_CHARS]


execute_tool = run_tool


# ----------------------------------------------------------------- calls and the reward
def parse_tool_calls(text: str) -> list[Any]:
    """The JSON value of every ``<tool_call>...</tool_call>`` block (blocks that are not JSON skipped)."""
    calls = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            calls.append(json.loads(body.strip()))
        except (ValueError, RecursionError):  # not JSON, or nested past the stack
            pass
    return calls


def call_name_args(call: Any) -> tuple[Any, Any]:
    """A call's ``name`` and its ``arguments`` (a JSON string decoded, ``{}`` when it is not JSON).

    A call that is not an object is an unknown tool with no arguments (MiniMind crashes on it)."""
    if not isinstance(call, dict):
        return "", {}
    name, raw = call.get("name", ""), call.get("arguments", {})
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError):
            raw = {}
    return name, raw


def valid_call(call: Any, valid_names: set[str]) -> bool:
    """MiniMind's valid call: a tool offered to the model, with the arguments its check requires."""
    name, args = call_name_args(call)
    check = CHECK_ARGS.get(name) if isinstance(name, str) else None
    if not (isinstance(name, str) and name in valid_names and check):
        return False
    try:
        return bool(check(args))
    except Exception:  # arguments that are not an object (MiniMind crashes): not a valid call
        return False


NUMBER_IN_TEXT = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])")
NUMBER_ONLY = re.compile(r"[-+]?\d+(?:\.\d+)?")


def validate_gt_in_text(text: Any, gt: list[Any]) -> set[Any]:
    """MiniMind's ``validate_gt_in_text``: the ground truths found in ``text`` (as a substring, case-insensitive,
    or a number equal to 1e-6 to a number in the text, thousands separators ignored)."""
    text = str(text)
    numbers = [float(x) for x in NUMBER_IN_TEXT.findall(text.replace(",", ""))]
    found = set()
    for g in gt:
        s = str(g).strip()
        if s and s.lower() in text.lower():
            found.add(g)
            continue
        bare = s.replace(",", "")
        if NUMBER_ONLY.fullmatch(bare) and any(abs(float(bare) - n) < 1e-6 for n in numbers):
            found.add(g)
    return found


def turn_answer(turn: str) -> str:
    """A turn's text after its thinking (``</think>``), stripped."""
    return turn.split(THINK_END, 1)[-1].strip() if THINK_END in turn else turn.strip()


def agent_reward(response: str, turn_outputs: list[str], unfinished: bool, tools: list[dict[str, Any]] | None,
                 gt: list[Any], score: Callable[[str], float] | None = None) -> float:
    """MiniMind's reward of one completion (module docstring), before its float32 rounding.

    Args:
        response: the last turn's text.
        turn_outputs: every turn's text.
        unfinished: the last turn still called a tool (the turns ran out).
        tools: the tools offered to the model (their names make a call valid).
        gt: the record's ground truths.
        score: the reward model's score of an answer (MiniMind's ``get_score`` on the prompt's messages), or None.
    """
    reward = 0.0
    answers = [turn_answer(turn) for turn in turn_outputs]
    answer = answers[-1] if answers else response.strip()
    valid_names = {t["function"]["name"] for t in tools} if tools else set()
    calls = [call for a in answers for call in parse_tool_calls(a)]
    reward -= 0.5 * sum(abs(a.count("<tool_call>") - a.count("</tool_call>")) for a in answers)
    if not calls:
        reward += 0.5 if 5 <= len(response.strip()) <= 800 else -0.5
        if THINK_END in response:
            thinking, answer = response.split(THINK_END, 1)
            reward += 1.0 if 20 <= len(thinking.strip()) <= 300 else -0.5
            reward += 0.25 if response.count(THINK_END) == 1 else -0.25
            answer = answer.strip()
        if score is not None:
            reward += score(answer)
        reward -= rep_penalty(answer)
        return max(min(reward, 3.0), -3.0)
    valid = sum(valid_call(call, valid_names) for call in calls)
    gap = abs(valid - len(gt)) + max(0, len(calls) - valid)
    reward += 0.5 if gap == 0 else -0.5 * gap
    final_text = "" if unfinished else (answer.split("</tool_call>")[-1] if "</tool_call>" in answer else answer)
    if gt:
        reward += 2.5 * len(validate_gt_in_text(final_text, gt)) / len(gt)
    if unfinished:
        reward -= 0.5
    reward -= rep_penalty(final_text if final_text else answer)
    return max(min(reward, 3.0), -3.0)


def scorer_of(scorer: Any, prompt: str) -> Callable[[str], float] | None:
    """``agent_reward``'s ``score`` from a reward scorer (:func:`lit_minimind.model.grpo.load_scorer`) and the
    sample's rendered prompt, whose messages MiniMind parses back for it."""
    if scorer is None:
        return None
    messages = prompt_messages(prompt)
    return lambda answer: scorer.get_score(messages, answer)


# ----------------------------------------------------------------- multi-turn rollout, packing, loss
@dataclass
class Trajectory:
    """One sample's multi-turn rollout (MiniMind's ``rollout_single``): the first turn's prompt tokens; after them
    every token of the turns, the model's (``response_mask`` 1) and the re-rendered context between turns, the
    tool results among them (0), with the sampling policy's log-probs of its own tokens (0.0 elsewhere); each
    turn's text; whether the turns ran out with a tool call pending."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_old_logps: list[float] = field(default_factory=list)
    turn_outputs: list[str] = field(default_factory=list)
    unfinished: bool = False
    context: str = ""
    thinking: bool = False

    @property
    def completion(self) -> str:
        """The last turn's text (what MiniMind's reward calls the response)."""
        return self.turn_outputs[-1] if self.turn_outputs else ""


def rollout_one(model: Any, tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                max_new_tokens: int, thinking_ratio: float, rng: Any, chat_template: str | None = None,
                max_turns: int = MAX_TURNS, timeout: float = TOOL_TIMEOUT) -> Trajectory:
    """Up to ``max_turns`` generations of ``model`` on ``messages``, each turn's tool calls run and their results
    appended as ``tool`` turns (MiniMind's ``rollout_single``). Thinking opens when ``rng.random() <
    thinking_ratio`` (one draw); the tokens are sampled from torch's global stream
    (:func:`lit_minimind.model.grpo.rollout`, MiniMind's settings). A turn's EOS and PAD tokens are dropped from
    the model's tokens; the context added between turns is the re-rendered conversation past the tokens so far."""
    from lit_minimind.data.chat_template import render_chat
    from lit_minimind.data.tokenizer import EOS_ID, PAD_ID
    from lit_minimind.model.grpo import rollout

    messages = [dict(m) for m in messages]
    thinking = rng.random() < thinking_ratio
    device = next(model.parameters()).device
    trajectory: Trajectory | None = None
    for turn in range(max_turns):
        context = render_chat(messages, chat_template, add_generation_prompt=True, tools=tools, open_thinking=thinking)
        context_ids = tokenizer.encode(context, add_special_tokens=False).ids
        if trajectory is None:
            trajectory = Trajectory(prompt_ids=context_ids, thinking=thinking)
        ids = torch.tensor([context_ids], device=device)
        output = rollout(model, ids, torch.ones_like(ids), 1, max_new_tokens)
        new_ids = output[0, len(context_ids):].tolist()
        logps = sampled_log_probs(model, output, len(new_ids))
        text = tokenizer.decode(new_ids, skip_special_tokens=True)
        kept = [(t, lp) for t, lp in zip(new_ids, logps) if t not in (PAD_ID, EOS_ID)]
        trajectory.turn_outputs.append(text)
        trajectory.response_ids.extend(t for t, _ in kept)
        trajectory.response_mask.extend([1] * len(kept))
        trajectory.response_old_logps.extend(lp for _, lp in kept)
        trajectory.context = context + text
        calls = parse_tool_calls(text)
        if not calls:
            break
        trajectory.unfinished = turn == max_turns - 1
        messages.append({"role": "assistant", "content": text})
        for call in calls:
            messages.append({"role": "tool", "content": tool_result(*call_name_args(call), timeout=timeout)})
        observed = render_chat(messages, chat_template, add_generation_prompt=not trajectory.unfinished, tools=tools,
                               open_thinking=thinking)
        delta = tokenizer.encode(observed, add_special_tokens=False).ids[len(trajectory.prompt_ids)
                                                                          + len(trajectory.response_ids):]
        trajectory.response_ids.extend(delta)
        trajectory.response_mask.extend([0] * len(delta))
        trajectory.response_old_logps.extend([0.0] * len(delta))
        trajectory.context = observed
    assert trajectory is not None, "max_turns must be >= 1"
    return trajectory


@torch.no_grad()
def sampled_log_probs(model: Any, output: torch.Tensor, n: int) -> list[float]:
    """The sampling policy's fp32 log-probs of the last ``n`` tokens of ``output`` ``(1, T)`` (MiniMind's rollout
    engine's ``compute_per_token_logps``: a forward keeping the last ``n + 1`` positions, PAD masked)."""
    if n <= 0:
        return []
    from lit_minimind.data.tokenizer import PAD_ID

    logits = model(output, attention_mask=(output != PAD_ID).long(), logits_to_keep=n + 1).logits[:, :-1, :]
    return torch.gather(logits.float().log_softmax(dim=-1), 2, output[:, -n:].unsqueeze(-1))[0, :, 0].tolist()


def rollout_batch(model: Any, tokenizer: Any, batch: dict[str, list[Any]], num_generations: int, max_new_tokens: int,
                  thinking_ratio: float, rng: Any, chat_template: str | None = None) -> list[Trajectory]:
    """Every sample of ``batch`` (:func:`lit_minimind.data.agent.collate_agent`) rolled out ``num_generations``
    times, sample after sample (MiniMind's ``rollout_batch`` order: draws and tokens in its sequence)."""
    return [rollout_one(model, tokenizer, messages, tools, max_new_tokens, thinking_ratio, rng, chat_template)
            for messages, tools in zip(batch["messages"], batch["tools"]) for _ in range(num_generations)]


def trajectory_rewards(trajectories: list[Trajectory], batch: dict[str, list[Any]], num_generations: int,
                       scorer: Any = None, chat_template: str | None = None) -> torch.Tensor:
    """MiniMind's ``calculate_rewards`` of the batch's trajectories (float32, as its tensor holds them); the
    scorer judges against the prompt rendered without the thinking switch, as MiniMind's."""
    from lit_minimind.data.chat_template import render_chat

    rewards = []
    for i, trajectory in enumerate(trajectories):
        sample = i // num_generations
        score = None
        if scorer is not None:
            prompt = render_chat(batch["messages"][sample], chat_template, add_generation_prompt=True,
                                 tools=batch["tools"][sample])
            score = scorer_of(scorer, prompt)
        rewards.append(agent_reward(trajectory.completion, trajectory.turn_outputs, trajectory.unfinished,
                                    batch["tools"][sample], batch["gt"][sample], score))
    return torch.tensor(rewards, dtype=torch.float32)


def pack(trajectories: list[Trajectory], max_total_len: int,
         device: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, loss_mask, old_logps)``: each trajectory's prompt and turns, the last ``max_total_len`` tokens
    kept, right-padded with PAD; ``loss_mask`` ``(N, L - 1)`` is 1 where position ``t + 1`` is the model's own
    token (MiniMind's completion mask: tool results and contexts 0; its cut after an EOS, kept for fidelity,
    never bites since a turn's EOS is dropped); ``old_logps`` ``(N, L - 1)`` the sampling policy's log-probs of
    those tokens (0.0 elsewhere), the ratio's old policy: a cut context or a re-rendered turn makes the trained
    log-probs differ from them."""
    from lit_minimind.data.tokenizer import EOS_ID, PAD_ID

    rows, masks, olds = [], [], []
    for t in trajectories:
        ids, mask = t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.response_mask
        old = [0.0] * max(len(t.prompt_ids) - 1, 0) + t.response_old_logps
        if len(ids) > max_total_len:
            ids, mask = ids[-max_total_len:], mask[-max_total_len:]
            old = old[-(len(ids) - 1):]
        rows.append(ids)
        masks.append(mask)
        olds.append(old)
    width = max(len(r) for r in rows)
    old_logps = torch.tensor([o + [0.0] * (width - 1 - len(o)) for o in olds], device=device, dtype=torch.float32)
    input_ids = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], device=device)
    response = torch.tensor([m + [0] * (width - len(m)) for m in masks], device=device, dtype=torch.float32)
    loss_mask = response[:, 1:]
    is_eos = (input_ids[:, 1:] == EOS_ID) & loss_mask.bool()
    last = torch.full((loss_mask.size(0),), loss_mask.size(1) - 1, device=input_ids.device, dtype=torch.long)
    has_eos = is_eos.any(dim=1)
    last[has_eos] = is_eos.int().argmax(dim=1)[has_eos]
    positions = torch.arange(loss_mask.size(1), device=input_ids.device).unsqueeze(0)
    return input_ids, loss_mask * (positions <= last.unsqueeze(1)).float(), old_logps


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs ``(N, L - 1)`` of tokens ``1..L-1`` from full-sequence ``logits``."""
    return torch.gather(F.log_softmax(logits[:, :-1, :].float(), dim=-1), 2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def agent_loss(logps: torch.Tensor, ref_logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
               loss_mask: torch.Tensor, loss_type: str, beta: float, epsilon: float,
               epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMind's agent policy loss (GRPO / CISPO per token, :func:`lit_minimind.model.grpo.per_token_policy_loss`):
    each row's mean over its own tokens, then the mean over rows that have any (0 when none); and its console's
    KL to the reference (over all rows' tokens, detached)."""
    from lit_minimind.model.grpo import per_token_policy_loss

    per_token, diff = per_token_policy_loss(logps, ref_logps, advantages, loss_type, beta, epsilon, epsilon_high,
                                            old_logps)
    counts = loss_mask.sum(dim=1)
    valid = counts > 0
    if valid.any():
        loss = ((per_token * loss_mask).sum(dim=1)[valid] / counts[valid].clamp(min=1)).mean()
    else:
        loss = per_token.sum() * 0.0
    kl_ref = (diff.detach() * loss_mask).sum() / counts.sum().clamp(min=1)
    return loss, kl_ref
