"""``python -m lit_minimind.eval_toolcall MODEL``: score a model's tool calls (MiniMind's ``scripts/eval_toolcall.py``).

Greedy multi-turn rollouts (up to ``--max_turns`` replies per case: each reply's tool calls run by the project's
tools, :func:`lit_minimind.model.agent.tool_result`, their results appended as ``tool`` turns) on MiniMind's eight
cases (their prompts and tool lists; ``random_number`` and ``text_length`` are offered but have no implementation
here, so they answer MiniMind's error text) or on an agent RL jsonl file (``--data``: its prompts, tools and ``gt``).
Each transcript is printed as MiniMind's script prints it, then a score table, per case and overall:

* ``well-formed``: replies whose every ``<tool_call>`` block is a JSON object naming a function, with at least one;
* ``known``: calls to an offered tool whose arguments are a JSON object;
* ``expected``: calls to the case's expected tool (MiniMind's cases; none for a jsonl file);
* ``gt calls``: cases whose valid calls number ``len(gt)``, none invalid (the agent reward's term);
* ``answer gt``: the share of ``gt`` found in the final answer (:func:`validate_gt_in_text`).

A reply is split as the server splits it (:class:`lit_minimind.cli.serve.ReplyParser`) and decoded greedily as the
server's engine decodes it, so ``--base_url`` (an OpenAI-compatible server, e.g. ``python -m
lit_minimind.serve MODEL``) gives the same transcripts and scores for the same model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

from lit_minimind.cli.plain import description
from lit_minimind.model.agent import MAX_TURNS, TOOLS, call_name_args, tool_result, valid_call, validate_gt_in_text

Chat = Callable[[list[dict[str, Any]], list[dict[str, Any]]], dict[str, Any]]

EXTRA_TOOLS = [  # MiniMind's two tools this project does not implement (offered; a call answers the error text)
    {"type": "function", "function": {"name": "random_number", "description": "生成指定范围内的随机数", "parameters": {
        "type": "object", "properties": {"min": {"type": "integer", "default": 0}, "max": {"type": "integer", "default": 100}},
        "required": []}}},
    {"type": "function", "function": {"name": "text_length", "description": "计算文本的字符数和单词数", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
]
TOOL_BY_NAME = {t["function"]["name"]: t for t in TOOLS + EXTRA_TOOLS}

# MiniMind's eight cases: prompt, tools offered, the tools expected, the ground truth from this project's mock results
CASES: list[tuple[str, list[str], list[str], list[Any]]] = [
    ("帮我算一下 256 乘以 37 等于多少", ["calculate_math", "get_current_time"], ["calculate_math"], [9472]),
    ("现在几点了？", ["get_current_time", "random_number"], ["get_current_time"], ["14:30"]),
    ("帮我把100公里换算成英里", ["unit_converter", "calculate_math"], ["unit_converter"], [62.1371]),
    ("帮我生成一个1到1000的随机数，然后计算它的平方", ["random_number", "calculate_math", "text_length"],
     ["random_number", "calculate_math"], []),
    ("北京今天天气怎么样？", ["get_current_weather", "get_current_time"], ["get_current_weather"], ["28°C"]),
    ("查一下美元兑人民币汇率", ["get_exchange_rate", "get_current_time"], ["get_exchange_rate"], [7.21]),
    ("把'你好世界'翻译成英文", ["translate_text", "text_length"], ["translate_text"], ["Hello World"]),
    ("What is the weather in Tokyo? Also convert 30 celsius to fahrenheit.",
     ["get_current_weather", "unit_converter", "get_current_time"], ["get_current_weather", "unit_converter"], ["12°C"]),
]
METRICS = ("well-formed", "known", "expected", "gt calls", "answer gt")


def minimind_cases() -> list[dict[str, Any]]:
    """MiniMind's eight cases as ``{"messages", "tools", "expect", "gt"}``."""
    return [{"messages": [{"role": "user", "content": prompt}], "tools": [TOOL_BY_NAME[n] for n in names],
             "expect": expect, "gt": gt} for prompt, names, expect, gt in CASES]


def jsonl_cases(path: str) -> list[dict[str, Any]]:
    """An agent RL jsonl file's records (checked as training checks them) as cases without expected tools."""
    from lit_minimind.data.agent import AgentDataset

    dataset = AgentDataset(path)
    return [{**dataset[i], "expect": None} for i in range(len(dataset))]


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the server keeps them (role, content, an assistant's tool calls): both backends see the same."""
    return [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls")} for m in messages]


def local_chat(weights: str, max_new_tokens: int, tokenizer_path: str | None = None) -> Chat:
    """Greedy replies of a local model, decoded as the server's engine decodes a lone request (its prefill and
    decode step, the argmax each token) and split by the server's reply parser."""
    import torch

    from lit_minimind.cli.generate import load
    from lit_minimind.cli.serve import ReplyParser, TextStream
    from lit_minimind.data.chat_template import load_chat_template, render_chat
    from lit_minimind.data.tokenizer import EOS_ID
    from lit_minimind.model.batched import decode_step, prefill

    model, tokenizer, tokenizer_dir = load(weights, None, tokenizer_path)
    template = load_chat_template(tokenizer_dir)
    model = model.float().eval()
    context = int(model.config.max_position_embeddings)

    def chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        text = render_chat(messages, template, add_generation_prompt=True, tools=tools or None, open_thinking=False)
        ids = tokenizer.encode(text).ids
        if len(ids) + max_new_tokens > context:
            raise ValueError(f"the conversation ({len(ids)} tokens) and --max_new_tokens {max_new_tokens} exceed the "
                             f"model's context of {context} tokens")
        stream, parser, events = TextStream(tokenizer), ReplyParser(False), []
        with torch.inference_mode():
            cache, logits = prefill(model, ids)
            for n in range(max_new_tokens):
                token = int(logits[0].argmax())
                if token == EOS_ID:
                    break
                events += parser.push(stream.push(token))
                if n + 1 < max_new_tokens:
                    logits = decode_step(model, [cache], [token])
        events += parser.push(stream.flush()) + parser.flush()
        return reply_of(events)

    return chat


def reply_of(events: list[tuple[str, Any]]) -> dict[str, Any]:
    """``{"content", "reasoning", "tool_calls": [{"name", "arguments"}]}`` from :class:`ReplyParser` events."""
    reply: dict[str, Any] = {"content": "", "reasoning": "", "tool_calls": []}
    for kind, value in events:
        if kind == "tool_call":
            reply["tool_calls"].append(value)
        else:
            reply[kind] += value
    return reply


def server_chat(base_url: str, api_key: str, model: str, max_new_tokens: int) -> Chat:
    """Greedy replies (temperature 0) of an OpenAI-compatible server."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600,
                           http_client=httpx.Client(trust_env=False))

    def chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> dict[str, Any]:
        try:
            response = client.chat.completions.create(model=model, messages=messages, tools=tools or None,
                                                      temperature=0, max_tokens=max_new_tokens)
        except openai.OpenAIError as err:
            raise ValueError(f"--base_url {base_url}: {err}") from None
        message = response.choices[0].message
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
        return {"content": message.content or "", "reasoning": getattr(message, "reasoning_content", None) or "",
                "tool_calls": calls}

    return chat


def run_case(chat: Chat, case: dict[str, Any], max_turns: int, out: Any) -> dict[str, Any]:
    """One case's rollout, printed as MiniMind prints it; its transcript and counts."""
    messages, tools = plain_messages(case["messages"]), case["tools"] or []
    names = {t["function"]["name"] for t in tools}
    print(f"📦 可用工具: {[t['function']['name'] for t in tools]}\n", file=out)
    print(f"💬: {messages[-1]['content']}", file=out)
    turns, calls, final = [], [], ""
    for _ in range(max_turns):
        reply = chat(messages, tools)
        turns.append(reply)
        content = reply["content"]
        print(f"🧠: {content}", file=out)
        if not reply["tool_calls"]:
            final = content
            break
        messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"type": "function", "function": call} for call in reply["tool_calls"]]})
        for call in reply["tool_calls"]:
            calls.append(call)
            name, args = call_name_args(call)
            result = tool_result(name, args)
            print(f"📞 [Tool Calling]: {name} | args={call['arguments']}", file=out)
            print(f"✅ [Tool Called]: {result}", file=out)
            messages.append({"role": "tool", "content": result})
    print("\n" + "-" * 50 + "\n", file=out)
    known = sum(call["name"] in names and _is_object(call["arguments"]) for call in calls)
    valid = sum(valid_call(call, names) for call in calls)
    row = {"turns": len(turns), "well_formed": sum(bool(t["tool_calls"]) and "<tool_call>" not in t["content"] for t in turns),
           "calls": len(calls), "known": known, "gt": case["gt"], "final": final,
           "transcript": [{"content": t["content"], "reasoning": t["reasoning"], "tool_calls": t["tool_calls"]}
                          for t in turns]}
    if case.get("expect") is not None:
        row["expected"] = sum(call["name"] in case["expect"] for call in calls)
    if case["gt"]:
        row["gt_calls"] = int(valid == len(case["gt"]) and valid == len(calls))
        row["answer_gt"] = len(validate_gt_in_text(final, case["gt"])) / len(case["gt"])
    return row


def _is_object(arguments: Any) -> bool:
    if isinstance(arguments, dict):
        return True
    try:
        return isinstance(json.loads(arguments), dict)
    except (TypeError, ValueError, RecursionError):
        return False


def shares(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The five scores over ``rows`` (None where nothing was counted)."""
    def ratio(num: float, den: float) -> float | None:
        return num / den if den else None

    with_expect = [r for r in rows if "expected" in r]
    with_gt = [r for r in rows if "answer_gt" in r]
    return {"well-formed": ratio(sum(r["well_formed"] for r in rows), sum(r["turns"] for r in rows)),
            "known": ratio(sum(r["known"] for r in rows), sum(r["calls"] for r in rows)),
            "expected": ratio(sum(r["expected"] for r in with_expect), sum(r["calls"] for r in with_expect)),
            "gt calls": ratio(sum(r["gt_calls"] for r in with_gt), len(with_gt)),
            "answer gt": ratio(sum(r["answer_gt"] for r in with_gt), len(with_gt))}


def table(rows: list[dict[str, Any]]) -> str:
    """The score table: one line per case, then the overall line."""
    def cells(scores: dict[str, float | None]) -> str:
        return "".join(f"{'-' if scores[m] is None else f'{scores[m]:.2f}':>12}" for m in METRICS)

    lines = [f"{'case':>8}" + "".join(f"{m:>12}" for m in METRICS)]
    lines += [f"{i + 1:>8}" + cells(shares([r])) for i, r in enumerate(rows)]
    lines.append(f"{'all':>8}" + cells(shares(rows)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lit_minimind.eval_toolcall", description=description(__doc__))
    parser.add_argument("weights", metavar="MODEL", nargs="?",
                        help="fp16 export, *_resume.pth, Lightning .ckpt or Hugging Face directory (what generate loads); "
                             "not needed with --base_url")
    parser.add_argument("--data", default=None, metavar="FILE.jsonl",
                        help="agent RL records (conversations with tools, gt) instead of MiniMind's eight cases")
    parser.add_argument("--max_turns", type=int, default=MAX_TURNS, help=f"replies per case (default {MAX_TURNS})")
    parser.add_argument("--max_new_tokens", type=int, default=512, metavar="N", help="tokens per reply (default 512)")
    parser.add_argument("--tokenizer_path", default=None, help="directory with tokenizer.json (as generate's)")
    parser.add_argument("--base_url", default=None, metavar="URL",
                        help="an OpenAI-compatible server's API (e.g. http://127.0.0.1:8998/v1) instead of MODEL")
    parser.add_argument("--api_key", default="none", metavar="KEY", help="the server's API key")
    parser.add_argument("--model", default="minimind", metavar="NAME", help="the model name sent to the server")
    parser.add_argument("--output", default=None, metavar="FILE.json", help="write the transcripts and scores here")
    args = parser.parse_args(argv)
    for flag in ("max_turns", "max_new_tokens"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag} must be at least 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    if (args.weights is None) == (args.base_url is None):
        print("error: give MODEL or --base_url (one of them)", file=sys.stderr)
        return 2
    from lit_minimind.errors import CheckpointError, DataError

    try:
        cases = jsonl_cases(args.data) if args.data else minimind_cases()
        chat = (server_chat(args.base_url, args.api_key, args.model, args.max_new_tokens) if args.base_url
                else local_chat(args.weights, args.max_new_tokens, args.tokenizer_path))
        rows = [run_case(chat, case, args.max_turns, sys.stdout) for case in cases]
    except (CheckpointError, DataError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps({"scores": shares(rows), "cases": rows}, ensure_ascii=False, indent=1) + "\n")
    return 0
